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
from shared.contract.checkpoints import PICKLE_SUFFIXES, SAFE_SUFFIX, read_json
from shared.contract.folders import NamedWeights, UnusableModelError

log = logging.getLogger(__name__)

IMAGE_ENCODER = "image_encoder"  # the subfolder of the image encoder
CONFIG = "config.json"  # what makes that subfolder an image encoder
ENCODER = f"{IMAGE_ENCODER}/"  # the image encoder's entry in a folder's listing: no job can send a "/"


def _ip_adapter_of(path: Path) -> tuple[str, Path] | None:
    """The IP-Adapter this entry of a folder is, by name, or its image encoder (as ENCODER); None for
    anything else; UnusableModelError for a pickle or a file that is not regular."""
    if path.is_dir():  # the image encoder, a model's own folder, or no IP-Adapter
        return (ENCODER, path) if path.name == IMAGE_ENCODER and _is_encoder(path) else None
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise UnusableModelError(f"{path}: a pickle, which can run code when loaded (convert it once to "
                                 f"{SAFE_SUFFIX} where you trust it)")
    if path.suffix.lower() != SAFE_SUFFIX:
        return None
    name = weights_file_name(path)
    return None if name is None else (name, path)


def _is_encoder(encoder: Path) -> bool:
    """Whether the subfolder is an image encoder with safetensors weights; one that is not used logged
    (not "offered": a job names no encoder)."""
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


# Read again also when the image encoder's subfolder changes: its files may come after the folder's.
listing = NamedWeights("SLOTQ_IP_ADAPTER_DIR", _ip_adapter_of, log, also=(IMAGE_ENCODER,))


def _ip_adapters_in(folder: Path) -> tuple[bool, dict[str, Path]]:
    """The folder's image encoder (whether it has one) and IP-Adapters; read again only when it changes."""
    found = listing.entries(folder)
    return ENCODER in found, {name: path for name, path in found.items() if name != ENCODER}


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
