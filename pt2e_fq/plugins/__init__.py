"""Workarounds for third-party packages, one module each: `torchao` (its
import's log noise), `torchvision` (the schemas its PyPI wheel cannot
register beside a CPU torch). Nothing here is imported unless asked for."""
