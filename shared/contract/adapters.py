"""LoRA adapters: what a job may name, and which adapters the service has.

An adapter is a ``*.safetensors`` file in diffusers' LoRA format in SLOTQ_LORA_DIR; its name is the
file's stem. The API and the workers read the same folder (in compose both mount it), so the API
knows the names without a live worker and refuses an unknown one at admission. Only regular files
are offered (a FIFO would block the worker that opened it); the listing opens none, and the worker reads
each with safetensors' own bounds on its header.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

MAX_LORAS = 4  # per job
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
SUFFIX = ".safetensors"


class LoraRef(BaseModel):
    """One adapter a job runs with, at its scale (0: as if absent; negative: against its direction)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(pattern=NAME_PATTERN, description="the adapter's file name in SLOTQ_LORA_DIR, "
                                                        "without `.safetensors`")
    scale: float = Field(1.0, ge=-2, le=2, allow_inf_nan=False)


def adapters_key(loras: list[LoraRef]) -> str:
    """Adapters and scales as one string, in a stable order ('' for the bare model): the part of a
    job's batch key that names them, and what the claim's affinity compares (lua/lib/line.lua)."""
    return ",".join(f"{lora.name}:{lora.scale!r}" for lora in sorted(loras, key=lambda lora: lora.name))


def weights_file_name(path: Path, setting: str) -> str | None:
    """The name a ``<name>.safetensors`` file of a folder of weights is offered under: None for a
    name a job could not send, and for anything but a regular file (a FIFO would block the worker
    that opened it; logged under ``setting``, the folder's)."""
    name = path.name[:-len(SUFFIX)]
    if not re.fullmatch(NAME_PATTERN, name):
        return None
    if not path.is_file():
        log.warning("%s: not offered: %s: not a regular file", setting, path)
        return None
    return name


def adapter_path(lora_dir: Path, name: str) -> Path:
    """Where the adapter of this name is."""
    return lora_dir / f"{name}{SUFFIX}"


_listed: dict[Path, tuple[int, list[str]]] = {}


def available_adapters(lora_dir: Path | None) -> list[str]:
    """The names of the adapters in the folder, sorted; read again only when the folder changes."""
    if lora_dir is None:
        return []
    try:
        changed = os.stat(lora_dir).st_mtime_ns  # a file added or removed changes the folder's mtime
    except OSError:
        return []
    cached = _listed.get(lora_dir)
    if cached is None or cached[0] != changed:
        stems = (path.name.removesuffix(SUFFIX) for path in lora_dir.glob(f"*{SUFFIX}") if path.is_file())
        names = sorted(stem for stem in stems if re.fullmatch(NAME_PATTERN, stem))  # a job can name these
        cached = _listed[lora_dir] = (changed, names)
    return cached[1]
