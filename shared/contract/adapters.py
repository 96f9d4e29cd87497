"""LoRA adapters: what a job may name, and which adapters the service has.

An adapter is a ``*.safetensors`` file in diffusers' LoRA format in SLOTQ_LORA_DIR; its name is the
file's stem. The API and the workers read the same folder (in compose both mount it), so the API
knows the names without a live worker and refuses an unknown one at admission. Only regular files
are offered (a FIFO would block the worker that opened it); the listing opens none, and the worker reads
each with safetensors' own bounds on its header.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from shared.contract.folders import NamedWeights, UnusableModelError

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


def weights_file_name(path: Path) -> str | None:
    """The name a ``<name>.safetensors`` file of a folder of weights is offered under: None for a
    name a job could not send; UnusableModelError for anything but a regular file (a FIFO would block
    the worker that opened it)."""
    name = path.name[:-len(SUFFIX)]
    if not re.fullmatch(NAME_PATTERN, name):
        return None
    if not path.is_file():
        raise UnusableModelError(f"{path}: not a regular file")
    return name


def adapter_path(lora_dir: Path, name: str) -> Path:
    """Where the adapter of this name is."""
    return lora_dir / f"{name}{SUFFIX}"


def _adapter_of(path: Path) -> tuple[str, Path] | None:
    """The adapter this entry of the folder is, by name; None for anything else."""
    if not path.name.endswith(SUFFIX):
        return None
    name = weights_file_name(path)
    return None if name is None else (name, path)


listing = NamedWeights("SLOTQ_LORA_DIR", _adapter_of, log)


def available_adapters(lora_dir: Path | None) -> list[str]:
    """The names of the adapters in the folder, sorted; read again only when the folder changes."""
    return sorted(listing.entries(lora_dir))
