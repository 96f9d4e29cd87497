"""What the worker process does before it imports torch and diffusers, so that a clean start prints
only what a user can act on.

- torchao is deferred: diffusers imports it, when it is installed, at its own import, and torchao then
  prints notes about CUDA kernels it cannot load on this machine and registers types with torch. The
  worker needs it only for a model that asks ``quantize=torchao-int8`` (worker/memory.py), which
  releases it then.
- Where torchvision is absent (the CPU install: PyPI's torchvision does not import beside the CPU
  build of torch), transformers falls back to its PIL image processors, which are what the worker
  wants there, and says so once per processor; that note alone is dropped.
- Progress bars of loading and writing weights go: a log is no place for them.

Deferring uses Python's documented way to block an import (``sys.modules[name] = None``), which makes
``importlib.util.find_spec``, and so diffusers' availability check, see the package as absent.
"""

from __future__ import annotations

import importlib.util
import logging
import sys

DEFERRED = ("torchao",)
_deferred: set[str] = set()
# transformers' note when it falls back to a PIL image processor; the logger that says it.
TORCHVISION_NOTE = "requires torchvision (not installed); falling back to"
TORCHVISION_NOTE_LOGGER = "transformers.utils.import_utils"


class _DropTorchvisionNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return TORCHVISION_NOTE not in record.getMessage()


def prepare() -> None:
    """Defer the optional packages and quiet the libraries' notes; call before torch is imported."""
    for package in DEFERRED:
        if package not in sys.modules and importlib.util.find_spec(package) is not None:
            sys.modules[package] = None  # type: ignore[assignment]  # Python's "import blocked" marker
            _deferred.add(package)
    if importlib.util.find_spec("torchvision") is None:
        logging.getLogger(TORCHVISION_NOTE_LOGGER).addFilter(_DropTorchvisionNote())
    from diffusers.utils import logging as diffusers_logging
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()
    disable_progress_bars()


def is_installed(package: str) -> bool:
    """Whether the package is installed, deferred or not, found without importing it."""
    return package in _deferred or importlib.util.find_spec(package) is not None


def release(package: str) -> None:
    """Let ``package`` be imported from now on (a model asked for it)."""
    if package in _deferred:
        del sys.modules[package]
        _deferred.discard(package)
