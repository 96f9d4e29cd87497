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
import re
from pathlib import Path

from shared.contract.adapters import NAME_PATTERN, weights_file_name
from shared.contract.checkpoints import PICKLE_SUFFIXES, SAFE_SUFFIX, read_json
from shared.contract.folders import NamedWeights, UnusableModelError

log = logging.getLogger(__name__)

CONFIG = "config.json"  # what makes a subfolder one ControlNet in diffusers' layout
SIDECAR_SUFFIX = ".json"  # beside a single file: its diffusers configuration (worker/controlnets.py)


def _controlnet_of(path: Path) -> tuple[str, Path] | None:
    """The ControlNet this entry of a folder is, by name; None for anything else; UnusableModelError
    for one not offered."""
    if path.is_dir():
        name = _folder_controlnet(path)
    elif path.suffix.lower() == SAFE_SUFFIX:
        name = _file_controlnet(path)
    elif path.suffix.lower() in PICKLE_SUFFIXES:
        raise UnusableModelError(f"{path}: a pickle, which can run code when loaded (convert it once to "
                                 f"{SAFE_SUFFIX} where you trust it)")
    else:
        name = None
    return None if name is None else (name, path)


def _folder_controlnet(path: Path) -> str | None:
    """The name of a ControlNet in diffusers' layout; None for a model's own folder or no ControlNet."""
    if not (path / CONFIG).is_file() or not re.fullmatch(NAME_PATTERN, path.name):
        return None
    if not any(weights.is_file() for weights in path.glob(f"*{SAFE_SUFFIX}")):
        raise UnusableModelError(f"{path}: no {SAFE_SUFFIX} weights (pickled weights are never loaded)")
    read_json(path / CONFIG)
    return path.name


def _file_controlnet(path: Path) -> str | None:
    """The name of a ControlNet in the single-file layout, its sidecar readable where it has one."""
    name = weights_file_name(path)
    sidecar = path.with_suffix(SIDECAR_SUFFIX)
    if name is not None and sidecar.exists():
        read_json(sidecar)
    return name


# "x/" and "x.safetensors": the folder's, sorted first, is offered.
listing = NamedWeights("SLOTQ_CONTROLNET_DIR", _controlnet_of, log)


def _controlnets_in(folder: Path) -> dict[str, Path]:
    """The ControlNets directly in the folder by name; read again only when the folder changes."""
    return listing.entries(folder)


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
