"""Config-driven PT2E quantizer for pt2e_fq.

    from quantizers import FakeQuantQuantizer, presets
    quantizer = FakeQuantQuantizer(presets.get_preset("w8a8").set_module_name("head", None))
"""

from . import mixed_precision, presets
from .config import OpConfig, QuantizerConfig
from .patterns import OP_TYPES
from .qspec_dict import ConfigError
from .quantizer import FakeQuantQuantizer, UnsupportedQuantizationError

__all__ = [
    "FakeQuantQuantizer",
    "QuantizerConfig",
    "OpConfig",
    "OP_TYPES",
    "ConfigError",
    "UnsupportedQuantizationError",
    "presets",
    "mixed_precision",
]
