"""Single-file checkpoints (the layout A1111, ComfyUI and Civitai use): their family and their loading.

A single file holds the weights only; the layout of each component (configs, tokenizers) comes from
the family's configuration source, SLOTQ_CHECKPOINT_CONFIGS, read from disk and never fetched.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch
from diffusers import DiffusionPipeline, StableDiffusionPipeline, StableDiffusionXLPipeline
from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

from shared.contract.checkpoints import (
    PICKLE_SUFFIXES,
    SAFE_SUFFIX,
    UnusableModelError,
    family_of_names,
    header_names,
    sidecar_family,
)
from shared.contract.models import Family

log = logging.getLogger(__name__)

PIPELINES: dict[Family, type[DiffusionPipeline]] = {
    "sd": StableDiffusionPipeline,
    "sdxl": StableDiffusionXLPipeline,
}
# What diffusers reads from a configuration source: configs and tokenizer files, no weights.
CONFIG_PATTERNS = ["*.json", "**/*.json", "*.txt", "**/*.txt", "*.model", "**/*.model"]


class CheckpointError(ValueError):
    """A single-file checkpoint that the worker will not or cannot load."""


def is_single_file(model: str) -> bool:
    """Whether SLOTQ_MODEL names a single-file checkpoint (a safetensors file or a pickle)."""
    suffix = Path(model).suffix.lower()
    return suffix == SAFE_SUFFIX or suffix in PICKLE_SUFFIXES


def family_of_checkpoint(path: Path) -> Family:
    """The family of a single-file checkpoint, from its key names (the safetensors header only)."""
    family = family_of_names(_key_names(path))
    if family is not None:
        return family
    raise CheckpointError(f"{path}: not an SD or SDXL checkpoint in the single-file layout "
                          f"(no cond_stage_model.* or conditioner.embedders.* weights)")


def _key_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file; a pickle is refused before it is opened."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: {path.suffix} files are pickles, which can run code when loaded; "
                              f"only .safetensors files are loaded (convert it once where you trust it)")
    if path.suffix.lower() != SAFE_SUFFIX:
        raise CheckpointError(f"{path}: not a .safetensors file")
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        return header_names(path)
    except UnusableModelError as exc:
        raise CheckpointError(str(exc)) from None


def config_folder(source: str) -> Path:
    """The local folder of a configuration source: a diffusers folder as it is, a hub id from the cache."""
    if Path(source).is_dir():
        return Path(source)
    try:
        # diffusers' from_single_file would download a hub id that is not cached despite
        # local_files_only=True: resolving it here first keeps the worker offline.
        return Path(snapshot_download(source, allow_patterns=CONFIG_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as exc:
        raise CheckpointError(
            f"the configuration {source!r} is neither a folder nor in the local hub cache ({exc}); download "
            f"its configs once: hf download {source} --include '*.json' '*.txt'") from None


def load_checkpoint(path: Path, configs: Mapping[Family, str], dtype: torch.dtype) -> DiffusionPipeline:
    """Load a single-file checkpoint as its family's pipeline, with that family's configs, offline;
    the family is the one its sidecar (``<stem>.json``) forces, else the one its keys show."""
    try:
        family = sidecar_family(path) or family_of_checkpoint(path)
    except UnusableModelError as exc:
        raise CheckpointError(str(exc)) from None
    if family not in PIPELINES:
        raise CheckpointError(f"{path}: a {family} single file is not loaded yet (only sd and sdxl ones); "
                              f"use its diffusers folder")
    folder = config_folder(configs[family])
    log.info("loading %s (%s) with the configs of %s", path, family, folder)
    try:
        pipe = PIPELINES[family].from_single_file(str(path), config=str(folder), local_files_only=True,
                                                  dtype=dtype)
    except NotImplementedError as exc:
        # A weight the file lacks stays on the meta device; diffusers' own models fail moving it.
        if "meta tensor" not in str(exc):
            raise
        raise CheckpointError(f"{path}: the file lacks weights of its UNet or VAE") from exc
    _check_complete(pipe, path)
    return pipe


def _check_complete(pipe: DiffusionPipeline, path: Path) -> None:
    """Refuse a pipeline whose text encoders the file left weights of unset (on the meta device):
    the first move to the device would fail with "Cannot copy out of meta tensor"."""
    for name, component in pipe.components.items():
        if not isinstance(component, torch.nn.Module):
            continue
        missing = [weight for weight, tensor in component.state_dict().items() if tensor.is_meta]
        if missing:
            raise CheckpointError(f"{path}: the file lacks {len(missing)} weights of the {name}, "
                                  f"such as {', '.join(missing[:3])}")
