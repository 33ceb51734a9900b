"""`import pt2e_fq` drops torchao's import-time noise, and only that."""

import logging
import subprocess
import sys

from pt2e_fq.plugins import torchao as torchao_plugin


def test_import_prints_no_torchao_noise():
    # A fresh process: torchao is first imported by pt2e_fq there.
    done = subprocess.run([sys.executable, "-c", "import pt2e_fq"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "is an Enum subclass" not in done.stderr
    assert "Failed to load" not in done.stderr or "torchao" not in done.stderr


def test_filters_match_only_the_two_messages():
    assert torchao_plugin._torchao_cuda_library(
        "Failed to load /venv/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load")
    assert not torchao_plugin._torchao_cuda_library("Skipping import of cpp extensions due to incompatible torch")
    assert torchao_plugin._enum_constant_deprecation(
        "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an "
        "opaque value type. Calling register_constant() on Enum subclasses is deprecated")
    assert not torchao_plugin._enum_constant_deprecation("register_constant(cls) expects `cls` to have __eq__")


def test_filters_are_removed_after_the_import():
    assert not logging.getLogger("torchao").filters
    assert not logging.getLogger("torch.utils._pytree").filters
