"""The folder of models (SLOTQ_MODELS_DIR): which models it offers, and the family of each, read
without torch.

A model of the folder is a single-file checkpoint (``<name>.safetensors``) or a diffusers folder (a
sub-folder with ``model_index.json``), named after its stem. The API and the workers read the same
folder (in compose both mount it), as they do SLOTQ_LORA_DIR: the API knows the models without a live
worker, and a worker whose SLOTQ_MODEL_NAME names one loads it. Pickles (``.ckpt`` and the like) can
run code when loaded: they are never offered.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.contract.models import FAMILIES, MODEL_NAME_PATTERN, PIPELINE_CLASSES, Family

log = logging.getLogger(__name__)

SAFE_SUFFIX = ".safetensors"
# Pickle formats: loading one runs whatever code it holds, so none is ever opened.
PICKLE_SUFFIXES = frozenset({".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"})
# The key prefix each family's text encoders have in the original layout; SDXL's second encoder
# comes first, as an SD checkpoint has none of it.
FAMILY_PREFIXES: tuple[tuple[str, Family], ...] = (
    ("conditioner.embedders.1.", "sdxl"),
    ("cond_stage_model.", "sd"),
)
# A model's sidecar, <stem>.json beside it: {"family": "sdxl"} forces its family (other keys, such as
# those A1111 keeps in the same file, are ignored).
SIDECAR_SUFFIX = ".json"
DIFFUSERS_INDEX = "model_index.json"
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors format's own bound on its JSON header


class UnusableModelError(ValueError):
    """A file or folder of SLOTQ_MODELS_DIR that is not offered, and why."""


class FolderModel(BaseModel):
    """One model of SLOTQ_MODELS_DIR: where it is, its family, and its size on disk."""

    model_config = ConfigDict(frozen=True)

    name: str
    path: Path
    family: Family
    size: int  # bytes: the file's, or the sum of a diffusers folder's files
    memory: dict[str, object] = {}  # its sidecar's "memory" settings over the service's (MemoryOptions)


def header_names(path: Path) -> list[str]:
    """The tensor names of a safetensors file, from its header alone (8 bytes of length, then JSON)."""
    try:
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(file.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise UnusableModelError(f"{path}: not a readable safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise UnusableModelError(f"{path}: not a readable safetensors file (its header is not a JSON object)")
    return [name for name in header if name != "__metadata__"]


def family_of_names(names: Iterable[str]) -> Family | None:
    """The family of a single-file checkpoint with these tensor names; None for none known."""
    names = list(names)
    for prefix, family in FAMILY_PREFIXES:
        if any(name.startswith(prefix) for name in names):
            return family
    return None


def sidecar_family(path: Path) -> Family | None:
    """The family a model's sidecar (``<stem>.json`` beside it) forces; None without one."""
    sidecar = path.with_name(path.name.removesuffix(SAFE_SUFFIX) + SIDECAR_SUFFIX)
    if not sidecar.is_file():
        return None
    try:
        family = json.loads(sidecar.read_text("utf-8")).get("family")
    except (OSError, ValueError, AttributeError) as exc:
        raise UnusableModelError(f"{sidecar}: not a JSON object: {exc}") from None
    if family is None:
        return None
    if family not in FAMILIES:
        raise UnusableModelError(f"{sidecar}: family {family!r} is none of {', '.join(FAMILIES)}")
    return family


def _folder_family(folder: Path) -> Family:
    """A diffusers folder's family, from its pipeline class in model_index.json."""
    try:
        name = json.loads((folder / DIFFUSERS_INDEX).read_text("utf-8")).get("_class_name")
    except (OSError, ValueError, AttributeError) as exc:
        raise UnusableModelError(f"{folder / DIFFUSERS_INDEX}: not readable: {exc}") from None
    if name not in PIPELINE_CLASSES:
        raise UnusableModelError(f"{folder}: {name} is not a text-to-image pipeline of a known family "
                                 f"({', '.join(sorted(PIPELINE_CLASSES))}); a sidecar can name one")
    return PIPELINE_CLASSES[name]


def _model_of(path: Path) -> FolderModel | None:
    """The model this entry of the folder is; None for an entry that is no model (a sidecar, a
    README); UnusableModelError for one that looks like a model but is not offered."""
    is_folder = path.is_dir()
    if is_folder and not (path / DIFFUSERS_INDEX).is_file():
        return None
    suffix = "" if is_folder else path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise UnusableModelError(f"{path}: {suffix} files are pickles, which can run code when loaded: "
                                 f"never offered (convert it once to .safetensors where you trust it)")
    if not is_folder and suffix != SAFE_SUFFIX:
        return None
    name = path.name.removesuffix(path.suffix) if suffix else path.name
    if not re.fullmatch(MODEL_NAME_PATTERN, name):
        raise UnusableModelError(f"{path}: {name!r} is not a model name (letters, digits, _ . -, at most 64)")
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if is_folder else path.stat().st_size
    return FolderModel(name=name, path=path, family=_family_of(path, name, is_folder), size=size)


def _family_of(path: Path, name: str, is_folder: bool) -> Family:
    """A model's family: the one its sidecar forces, else its pipeline class's or its keys'."""
    family = sidecar_family(path)
    if family is None and is_folder:
        family = _folder_family(path)
    if family is None:
        family = family_of_names(header_names(path))
    if family is None:
        raise UnusableModelError(f"{path}: not an SD or SDXL checkpoint in the single-file layout; a sidecar "
                                 f"{name}{SIDECAR_SUFFIX} with {{\"family\": ...}} can name its family")
    return family


def _read(models_dir: Path) -> dict[str, FolderModel]:
    """Every model of the folder by name, sorted; what is not offered is logged with the reason."""
    models: dict[str, FolderModel] = {}
    for path in sorted(models_dir.iterdir()):
        try:
            model = _model_of(path)
        except (UnusableModelError, ValidationError, OSError) as exc:
            log.warning("SLOTQ_MODELS_DIR: not offered: %s", exc)
            continue
        if model is None:
            continue
        if model.name in models:
            log.warning("SLOTQ_MODELS_DIR: not offered: %s: %s is offered under that name already",
                        path, models[model.name].path)
            continue
        models[model.name] = model
    return models


_listed: dict[Path, tuple[int, dict[str, FolderModel]]] = {}


def folder_models(models_dir: Path | None) -> dict[str, FolderModel]:
    """The models of SLOTQ_MODELS_DIR by name, sorted; read again only when the folder changes."""
    if models_dir is None:
        return {}
    try:
        changed = os.stat(models_dir).st_mtime_ns  # a file added or removed changes the folder's mtime
    except OSError:
        return {}
    cached = _listed.get(models_dir)
    if cached is None or cached[0] != changed:
        cached = _listed[models_dir] = (changed, _read(models_dir))
    return cached[1]
