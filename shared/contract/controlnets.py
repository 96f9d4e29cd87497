"""ControlNet models: which ones SLOTQ_CONTROLNET_DIR offers a model, and where each is, read without torch.

In the folder, a subfolder with ``config.json`` (and its weights as ``*.safetensors``) is one ControlNet
in diffusers' layout, named after the subfolder; a ``<name>.safetensors`` file is one in the
single-file layout, named by its stem; a subfolder without ``config.json``, named after a model, holds
that model's own ControlNets in the same layout. A model is offered its own and the top-level ones,
its own first where two share a name. A ControlNet fits one family's UNet only, so a folder serving
several families keeps each family's ControlNets under its models' names. As for models and LoRA
adapters, the API and the workers read the same folder; pickles (``.ckpt``, ``.bin`` weights and the
like) can run code when loaded and are never offered.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from shared.contract.adapters import NAME_PATTERN
from shared.contract.checkpoints import PICKLE_SUFFIXES, SAFE_SUFFIX

log = logging.getLogger(__name__)

CONFIG = "config.json"  # what makes a subfolder one ControlNet in diffusers' layout


def _controlnet_of(path: Path) -> str | None:
    """The name of the ControlNet this entry of a folder is; None for anything else, a pickle logged."""
    if path.is_dir():
        if not (path / CONFIG).is_file():
            return None  # a model's own folder, or no ControlNet
        if not any(path.glob(f"*{SAFE_SUFFIX}")):
            log.warning("SLOTQ_CONTROLNET_DIR: not offered: %s: no %s weights (pickled weights are "
                        "never loaded)", path, SAFE_SUFFIX)
            return None
        name = path.name
    elif path.suffix.lower() == SAFE_SUFFIX:
        name = path.name[:-len(SAFE_SUFFIX)]
    else:
        if path.suffix.lower() in PICKLE_SUFFIXES:
            log.warning("SLOTQ_CONTROLNET_DIR: not offered: %s: a pickle, which can run code when loaded "
                        "(convert it once to %s where you trust it)", path, SAFE_SUFFIX)
        return None
    return name if re.fullmatch(NAME_PATTERN, name) else None


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
