"""IP-Adapters: which ones SLOTQ_IP_ADAPTER_DIR offers a model, and where each is, read without torch.

In the folder, a ``<name>.safetensors`` file is one IP-Adapter in the original format (``image_proj.*`` and
``ip_adapter.*`` weights, as diffusers' ``load_ip_adapter`` reads them), named by its stem, and
``image_encoder/`` the CLIP image encoder they take their reference image's embedding from, in transformers'
layout (``config.json`` and ``*.safetensors`` weights). A subfolder named after a model holds that model's
own IP-Adapters, and its own ``image_encoder/`` where the top-level one does not fit it, in the same
layout: h94/IP-Adapter's ``models/`` is such a folder, its ``sdxl_models/`` such a subfolder (renamed after
the SDXL model). A model is offered its own adapters and the top-level ones, its own first where two share
a name, and none where no image encoder is found for it: a pipeline holds one image encoder, which all
of a model's adapters share. An IP-Adapter fits one family's UNet only, as a ControlNet does. Pickles
(``.bin``, ``.ckpt`` and the like) can run code when loaded and are never offered. Its files come from
outside: only regular files are offered, and an image encoder whose ``config.json`` is no JSON object
within the bounds of shared/contract/checkpoints.py is not used, with one line in the log; the weights
are read by the worker alone, with safetensors' own bounds.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from shared.contract.adapters import weights_file_name
from shared.contract.checkpoints import PICKLE_SUFFIXES, SAFE_SUFFIX, UnusableModelError, read_json

log = logging.getLogger(__name__)

IMAGE_ENCODER = "image_encoder"  # the subfolder of the image encoder
CONFIG = "config.json"  # what makes that subfolder an image encoder


def _ip_adapter_of(path: Path) -> str | None:
    """The name of the IP-Adapter this entry of a folder is; None for anything else, a pickle logged."""
    if path.is_dir():
        return None  # the image encoder, a model's own folder, or no IP-Adapter
    if path.suffix.lower() in PICKLE_SUFFIXES:
        log.warning("SLOTQ_IP_ADAPTER_DIR: not offered: %s: a pickle, which can run code when loaded "
                    "(convert it once to %s where you trust it)", path, SAFE_SUFFIX)
        return None
    if path.suffix.lower() != SAFE_SUFFIX:
        return None
    return weights_file_name(path, "SLOTQ_IP_ADAPTER_DIR")


def _has_encoder(folder: Path) -> bool:
    """Whether the folder holds an image encoder with safetensors weights; a pickled one logged."""
    encoder = folder / IMAGE_ENCODER
    if not (encoder / CONFIG).is_file():
        return False
    if not any(weights.is_file() for weights in encoder.glob(f"*{SAFE_SUFFIX}")):
        log.warning("SLOTQ_IP_ADAPTER_DIR: not used: %s: no %s weights (pickled weights are never loaded)",
                    encoder, SAFE_SUFFIX)
        return False
    try:
        read_json(encoder / CONFIG)
    except UnusableModelError as exc:
        log.warning("SLOTQ_IP_ADAPTER_DIR: not used: %s", exc)
        return False
    return True


def _read(folder: Path) -> tuple[bool, dict[str, Path]]:
    """Whether the folder holds an image encoder, and the IP-Adapters directly in it by name."""
    found: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        name = _ip_adapter_of(path)
        if name is not None:
            found[name] = path
    return _has_encoder(folder), found


_listed: dict[Path, tuple[int, int, tuple[bool, dict[str, Path]]]] = {}


def _ip_adapters_in(folder: Path) -> tuple[bool, dict[str, Path]]:
    """The folder's image encoder (whether it has one) and IP-Adapters; read again only when it changes."""
    try:
        changed = os.stat(folder).st_mtime_ns  # an entry added or removed changes the folder's mtime
    except OSError:
        return False, {}
    try:
        encoder = os.stat(folder / IMAGE_ENCODER).st_mtime_ns  # its files may come after the folder
    except OSError:
        encoder = 0
    cached = _listed.get(folder)
    if cached is None or cached[:2] != (changed, encoder):
        cached = _listed[folder] = (changed, encoder, _read(folder))
    return cached[2]


def image_encoder_path(folder: Path | None, model: str) -> Path | None:
    """The image encoder the model's IP-Adapters share: its own subfolder's, else the top-level one; None
    where neither is."""
    if folder is None:
        return None
    for place in (folder / model, folder):
        if os.path.isdir(place) and _ip_adapters_in(place)[0]:
            return place / IMAGE_ENCODER
    return None


def ip_adapter_paths(folder: Path | None, model: str) -> dict[str, Path]:
    """Every IP-Adapter the folder offers the model, by name (sorted): its own subfolder's over the
    top-level ones; none without an image encoder for them."""
    if folder is None or image_encoder_path(folder, model) is None:
        return {}
    offered = _ip_adapters_in(folder)[1]
    if os.path.isdir(folder / model):
        offered = offered | _ip_adapters_in(folder / model)[1]
    return dict(sorted(offered.items()))


def available_ip_adapters(folder: Path | None, model: str) -> list[str]:
    """The names of the IP-Adapters a job on this model may name, sorted."""
    return list(ip_adapter_paths(folder, model))
