"""Import torchao without two messages that are noise to our users.

- On a CPU-only torch build (`torch.version.cuda is None`), torchao logs
  "Failed to load .../torchao/_C_*.so" for each of its prebuilt CUDA
  kernels. They cannot load there, and pt2e_fq does not use them.
- torchao registers an Enum with `pytree.register_constant`, which torch
  2.13 logs as deprecated: a note for torchao's developers.

Only these records are dropped, and only while torchao is first imported;
if torchao is already imported, nothing changes.
"""

import logging
import sys

import torch


class _DropRecords(logging.Filter):
    def __init__(self, predicate):
        super().__init__()
        self.predicate = predicate

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.predicate(record.getMessage())


def _torchao_cuda_library(message: str) -> bool:
    return message.startswith("Failed to load") and "torchao" in message and "_C" in message


def _enum_constant_deprecation(message: str) -> bool:
    return "is an Enum subclass" in message and "register_constant" in message


def import_torchao() -> None:
    if "torchao" in sys.modules:
        return
    filters = [(logging.getLogger("torch.utils._pytree"), _DropRecords(_enum_constant_deprecation))]
    if torch.version.cuda is None:
        filters.append((logging.getLogger("torchao"), _DropRecords(_torchao_cuda_library)))
    for logger, f in filters:
        logger.addFilter(f)
    try:
        import torchao  # noqa: F401
    finally:
        for logger, f in filters:
            logger.removeFilter(f)
