"""Write-once folders: built in a private sibling and renamed into place, whole or not at all."""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


def write_once(final: Path, write: Callable[[Path], None],
               complete: Callable[[Path], bool] = Path.is_dir) -> Path:
    """Fill the folder ``final`` with ``write`` unless ``complete`` says it is there; return it."""
    if complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Built in a private sibling and renamed (atomic within one filesystem): readers see the whole
    # folder or none of it, and concurrent builders never write into each other's files.
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        tmp.mkdir()
        write(tmp)
        try:
            os.rename(tmp, final)
            log.info("built %s", final)
        except OSError:
            # Another builder won the race; its folder is complete, so use it.
            if not complete(final):
                raise
            log.debug("%s already built by another builder", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
