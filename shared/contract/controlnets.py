"""ControlNet models: which ones SLOTQ_CONTROLNET_DIR offers a model, and where each is, read without torch.

In the folder, a subfolder with ``config.json`` (and its weights as ``*.safetensors``) is one ControlNet
in diffusers' layout, named after the subfolder; a ``<name>.safetensors`` file is one in the
single-file layout, named by its stem; a subfolder without ``config.json``, named after a model, holds
that model's own ControlNets in the same layout. A model is offered its own and the top-level ones,
its own first where two share a name. A ControlNet fits one family's UNet only, so a folder serving
several families keeps each family's ControlNets under its models' names. As for models and LoRA
adapters, the API and the workers read the same folder; pickles (``.ckpt``, ``.bin`` weights and the
like) can run code when loaded and are never offered. Its files come from outside: only regular files
are offered, and a ControlNet whose ``config.json`` or sidecar (``<name>.json``, its single file's
configuration) is no JSON object within the bounds of shared/contract/checkpoints.py is not, with one
line in the log; the weights are read by the worker alone, with safetensors' own bounds.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from shared.contract.adapters import NAME_PATTERN, weights_file_name
from shared.contract.checkpoints import PICKLE_SUFFIXES, SAFE_SUFFIX, UnusableModelError, read_json

log = logging.getLogger(__name__)

CONFIG = "config.json"  # what makes a subfolder one ControlNet in diffusers' layout
SIDECAR_SUFFIX = ".json"  # beside a single file: its diffusers configuration (worker/controlnets.py)


def _controlnet_of(path: Path) -> str | None:
    """The name of the ControlNet this entry of a folder is; None for anything else, what is not
    offered logged."""
    if path.is_dir():
        return _folder_controlnet(path)
    if path.suffix.lower() == SAFE_SUFFIX:
        return _file_controlnet(path)
    if path.suffix.lower() in PICKLE_SUFFIXES:
        log.warning("SLOTQ_CONTROLNET_DIR: not offered: %s: a pickle, which can run code when loaded "
                    "(convert it once to %s where you trust it)", path, SAFE_SUFFIX)
    return None


def _folder_controlnet(path: Path) -> str | None:
    """The name of a ControlNet in diffusers' layout; None for a model's own folder or no ControlNet."""
    if not (path / CONFIG).is_file() or not re.fullmatch(NAME_PATTERN, path.name):
        return None
    if not any(weights.is_file() for weights in path.glob(f"*{SAFE_SUFFIX}")):
        log.warning("SLOTQ_CONTROLNET_DIR: not offered: %s: no %s weights (pickled weights are "
                    "never loaded)", path, SAFE_SUFFIX)
        return None
    return path.name if _readable(path / CONFIG) else None


def _file_controlnet(path: Path) -> str | None:
    """The name of a ControlNet in the single-file layout, its sidecar readable where it has one."""
    name = weights_file_name(path, "SLOTQ_CONTROLNET_DIR")
    if name is None:
        return None
    sidecar = path.with_suffix(SIDECAR_SUFFIX)
    return name if not sidecar.exists() or _readable(sidecar) else None


def _readable(config: Path) -> bool:
    """Whether a configuration is a JSON object within bounds; one that is not logged."""
    try:
        read_json(config)
    except UnusableModelError as exc:
        log.warning("SLOTQ_CONTROLNET_DIR: not offered: %s", exc)
        return False
    return True


def _read(folder: Path) -> dict[str, Path]:
    """The ControlNets directly in one folder, by name."""
    found: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        name = _controlnet_of(path)
        if name is not None and name not in found:  # "x/" and "x.safetensors": the folder, sorted first
            found[name] = path
    return found


_listed: dict[Path, tuple[int, dict[str, Path]]] = {}


def _controlnets_in(folder: Path) -> dict[str, Path]:
    """The ControlNets directly in the folder by name; read again only when the folder changes."""
    try:
        changed = os.stat(folder).st_mtime_ns  # an entry added or removed changes the folder's mtime
    except OSError:
        return {}
    cached = _listed.get(folder)
    if cached is None or cached[0] != changed:
        cached = _listed[folder] = (changed, _read(folder))
    return cached[1]


def controlnet_paths(folder: Path | None, model: str) -> dict[str, Path]:
    """Every ControlNet the folder offers the model, by name (sorted): its own subfolder's over the
    top-level ones."""
    if folder is None:
        return {}
    offered = _controlnets_in(folder)
    own = folder / model
    if not (own / CONFIG).is_file():  # else a top-level ControlNet of the model's name, no folder of its own
        offered = offered | _controlnets_in(own)
    return dict(sorted(offered.items()))


def available_controlnets(folder: Path | None, model: str) -> list[str]:
    """The names of the ControlNets a job on this model may name, sorted."""
    return list(controlnet_paths(folder, model))
