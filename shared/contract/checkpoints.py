"""The folder of models (SLOTQ_MODELS_DIR): which models it offers, and the family of each, read
without torch.

A model of the folder is a single-file checkpoint (``<name>.safetensors``: a whole SD 1.x or SDXL
pipeline, a FLUX.1 transformer alone, a Wan 2.1 transformer alone, text- or image-to-video, or an
LTX-Video transformer, alone or with its VAE;
``<name>.gguf``: a quantized FLUX.1 transformer) or a diffusers folder (a sub-folder with
``model_index.json``), named after its stem; its sidecar,
``<name>.json`` beside it, may force its family, name a VAE file used in place of its own, and set its
memory settings. The API and the workers read the same
folder (in compose both mount it), as they do SLOTQ_LORA_DIR: the API knows the models without a live
worker, and a worker whose SLOTQ_MODEL_NAME names one loads it. Pickles (``.ckpt`` and the like) can
run code when loaded: they are never offered, nor a diffusers folder whose weights are pickles alone.

The layouts read: SD 1.x and SDXL's original (LDM) one, as A1111, ComfyUI and Civitai save whole
pipelines; BFL's for a FLUX.1 transformer (``double_blocks``, ``single_blocks``); Wan's own for a Wan
transformer (``blocks.N.self_attn``, ``head.modulation``; ``img_emb`` and ``cross_attn.k_img`` in an
image-to-video one), as Wan-AI's release files and ComfyUI's repackaged ones hold it; LTX-Video's own
for an LTX-Video transformer (``patchify_proj``, ``transformer_blocks.N``), its VAE beside it under
``vae.`` or not, as Lightricks' files hold them. A transformer's names may stand under ComfyUI's prefix,
``model.diffusion_model.``. A transformer file holds the transformer alone (an LTX-Video one may hold its
VAE too), whole: every weight of its blocks and of the layers around them, nothing else (the other
components come from its family's configuration source, SLOTQ_CHECKPOINT_CONFIGS).

Its files come from the internet: each is read as untrusted input. Only regular files are opened (a
FIFO would block the reader), headers and JSON with a bound on their size and nesting, and a file that
fails to read is not offered, with one line in the log, never an error of the listing; so is a
safetensors file shorter than its header says (an interrupted download or copy).
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel, ConfigDict, ValidationError

from shared.contract.folders import FILE_ERRORS, NamedWeights, UnusableModelError, parsed_once, shown
from shared.contract.memory import MemoryOptions
from shared.contract.models import FAMILIES, FAMILY_SPECS, MODEL_NAME_PATTERN, PIPELINE_CLASSES, Family

log = logging.getLogger(__name__)

SAFE_SUFFIX = ".safetensors"
GGUF_SUFFIX = ".gguf"  # llama.cpp's format of quantized weights, for FLUX.1 transformers here
MODEL_SUFFIXES = (SAFE_SUFFIX, GGUF_SUFFIX)
# Pickle formats: loading one runs whatever code it holds, so none is ever opened.
PICKLE_SUFFIXES = frozenset({".ckpt", ".pt", ".pth", ".bin", ".pkl", ".pickle"})
# The key prefix each family's text encoders have in the original layout; SDXL's second encoder
# comes first, as an SD checkpoint has none of it.
FAMILY_PREFIXES: tuple[tuple[str, Family], ...] = (
    ("conditioner.embedders.1.", "sdxl"),
    ("cond_stage_model.", "sd"),
)
# The prefix of a transformer's names in the files ComfyUI saves (a Flux or Wan one may have it).
COMFY_PREFIX = "model.diffusion_model."
# A FLUX.1 transformer in BFL's layout (their files, and ComfyUI's and Civitai's): its blocks and the
# layers around them, nothing else.
FLUX_BLOCKS = ("double_blocks.", "single_blocks.")
FLUX_ROOTS = (*FLUX_BLOCKS, "img_in.", "txt_in.", "time_in.", "vector_in.", "guidance_in.", "final_layer.")
# A Wan 2.1 transformer in Wan's layout (Wan-AI's files, ComfyUI's), under ComfyUI's prefix or not: the
# layers around its blocks, then each block's (its self- and cross-attention, feed-forward, modulation);
# an image-to-video one has its image embedder too, and in each block's cross-attention may have the
# image's keys and values (Wan 2.1's do). Nothing else: a VACE or Animate model's extra layers are not
# read (diffusers' own converter, convert_wan_transformer_to_diffusers, maps all these names).
WAN_FAMILIES: tuple[Family, ...] = ("wan", "wan_i2v")
WAN_MARK = "head.modulation"  # diffusers' own tell of a Wan file (CHECKPOINT_KEY_NAMES["wan"])
_WEIGHT_BIAS = ("weight", "bias")
WAN_TOP = (*(f"{layer}.{kind}" for layer in ("patch_embedding", "text_embedding.0", "text_embedding.2",
                                             "time_embedding.0", "time_embedding.2", "time_projection.1",
                                             "head.head") for kind in _WEIGHT_BIAS), WAN_MARK)
WAN_IMAGE_TOP = tuple(f"img_emb.proj.{index}.{kind}" for index in (0, 1, 3, 4) for kind in _WEIGHT_BIAS)
WAN_BLOCK = ("modulation", "norm3.weight", "norm3.bias",
             *(f"{attention}.{part}.{kind}" for attention in ("self_attn", "cross_attn")
               for part in "qkvo" for kind in _WEIGHT_BIAS),
             *(f"{attention}.{norm}.weight" for attention in ("self_attn", "cross_attn")
               for norm in ("norm_q", "norm_k")),
             *(f"ffn.{index}.{kind}" for index in (0, 2) for kind in _WEIGHT_BIAS))
WAN_BLOCK_IMAGE = ("cross_attn.k_img.weight", "cross_attn.k_img.bias", "cross_attn.v_img.weight",
                   "cross_attn.v_img.bias", "cross_attn.norm_k_img.weight")
WAN_ROOTS = ("patch_embedding.", "text_embedding.", "time_embedding.", "time_projection.", "head.", "blocks.",
             "img_emb.")
# A block's weight: its index (at most 9 digits: a hostile name's int() stays cheap) and its name inside.
WAN_BLOCK_NAME = re.compile(r"blocks\.(\d{1,9})\.(.+)", re.DOTALL)
# An LTX-Video transformer in LTX-Video's layout (Lightricks' files, such as ltx-video-2b-v0.9.5.safetensors,
# and ComfyUI's), under ComfyUI's prefix or not: the layers around its blocks, then each block's (its self-
# and cross-attention with their q and k norms, feed-forward, modulation); diffusers' converter,
# convert_ltx_transformer_checkpoint_to_diffusers, only renames patchify_proj, adaln_single, q_norm and
# k_norm (its diffusers model's names, tests/worker/test_video_checkpoints.py holds these to them).
LTX_FAMILY: Family = "ltx"
# diffusers' tells of one (CHECKPOINT_KEY_NAMES["ltx-video"]): its patch embedder, or a block's modulation.
LTX_MARK, LTX_BLOCK_MARK = "patchify_proj.weight", "scale_shift_table"
LTX_TOP = (*(f"{layer}.{kind}" for layer in ("patchify_proj", "proj_out", "caption_projection.linear_1",
                                             "caption_projection.linear_2", "adaln_single.linear",
                                             "adaln_single.emb.timestep_embedder.linear_1",
                                             "adaln_single.emb.timestep_embedder.linear_2")
             for kind in _WEIGHT_BIAS), "scale_shift_table")
LTX_BLOCK = ("scale_shift_table",
             *(f"{attention}.{part}.{kind}" for attention in ("attn1", "attn2")
               for part in ("to_q", "to_k", "to_v", "to_out.0") for kind in _WEIGHT_BIAS),
             *(f"{attention}.{norm}.weight" for attention in ("attn1", "attn2")
               for norm in ("q_norm", "k_norm")),
             *(f"ff.net.{layer}.{kind}" for layer in ("0.proj", "2") for kind in _WEIGHT_BIAS))
LTX_ROOTS = ("patchify_proj.", "proj_out.", "caption_projection.", "adaln_single.", "scale_shift_table",
             "transformer_blocks.")
LTX_BLOCK_NAME = re.compile(r"transformer_blocks\.(\d{1,9})\.(.+)", re.DOTALL)
# Its VAE, where the file holds it too (Lightricks' files do), under this prefix, in any of LTX-Video's
# versions' layouts (diffusers' convert_ltx_vae_checkpoint_to_diffusers reads 0.9.0's, 0.9.1's, 0.9.5's):
# its encoder and decoder, whose ends and each resnet's convolutions are checked here, and its latents'
# statistics, two of which diffusers reads. Its every name and shape are checked against the base's VAE
# when a worker loads it.
LTX_VAE_PREFIX = "vae."
LTX_VAE_ROOTS = tuple(LTX_VAE_PREFIX + root for root in ("encoder.", "decoder.", "per_channel_statistics."))
LTX_VAE_TOP = (*(f"{LTX_VAE_PREFIX}{part}.{end}.conv.{kind}" for part in ("encoder", "decoder")
                 for end in ("conv_in", "conv_out") for kind in _WEIGHT_BIAS),
               *(f"{LTX_VAE_PREFIX}per_channel_statistics.{name}"
                 for name in ("mean-of-means", "std-of-means")))
LTX_VAE_RESNET = tuple(f"{conv}.conv.{kind}" for conv in ("conv1", "conv2") for kind in _WEIGHT_BIAS)
# A resnet of its VAE: the block it is in, its index (at most 9 digits) and its name inside.
LTX_VAE_RESNET_NAME = re.compile(r"(.+\.res_blocks)\.(\d{1,9})\.(.+)", re.DOTALL)
# A model's sidecar, <stem>.json beside it: {"family": "sdxl", "vae": "file.safetensors", "memory":
# {...}} (other keys, such as those A1111 keeps in the same file, are ignored).
SIDECAR_SUFFIX = ".json"
DIFFUSERS_INDEX = "model_index.json"
# A header of a model's tensors takes a few hundred kilobytes (a full Flux checkpoint's about 150 KB);
# the safetensors format allows 100 MB, which takes a listing seconds and hundreds of MB to parse (an
# 18.7 MB header, 280,000 names, took 1.3 s here). This bound keeps the one parse of a file's version
# to about a second; a larger header is not offered, with its reason in the log. GGUF's too.
MAX_HEADER_BYTES = 16 * 2**20
MAX_JSON_BYTES = 2**20  # a sidecar or a config: a few kilobytes in practice
# A safetensors header nests 3 deep, model_index.json 2, a sidecar or a config 3; json.loads recurses per
# level, so a file nested 200,000 deep would raise RecursionError (or exhaust a thread's C stack).
MAX_NESTING = 16
# GGUF's header: magic, version, tensor count, metadata count; then the metadata, each value typed by
# number (these of fixed size: uint8 ... float64, bool), then each tensor's name, shape, type and offset.
GGUF_HEADER = struct.Struct("<4sIQQ")
GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
GGUF_STRING, GGUF_ARRAY = 8, 9


def open_regular(path: Path) -> BinaryIO:
    """Open a regular file to read; ValueError for anything else, which is never opened: a FIFO
    would block the reader until a writer came, a device may act on being opened."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError("not a regular file")
    # O_NONBLOCK: should a FIFO replace the file between the two calls, opening it does not block.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise ValueError("not a regular file")
    return os.fdopen(descriptor, "rb")


# Each JSON string (its escapes taken out first) and every byte but brackets, removed before the nesting
# is measured; UTF-8 leaves no ASCII byte inside another character, so the bytes measure the text.
JSON_STRING = re.compile(rb'"[^"]*"')
BRACKETS = bytes.maketrans(b"{}", b"[]")
NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))


def nests_deeper(data: bytes, limit: int = MAX_NESTING) -> bool:
    """Whether JSON nests deeper than limit (or its brackets do not match), told without recursion:
    each pass removes the innermost pairs, so limit passes leave nothing of JSON nested limit deep."""
    plain = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = JSON_STRING.sub(b"", plain).translate(BRACKETS, NOT_BRACKETS)
    if b"[" * (limit + 1) in brackets:
        return True  # the usual attack, told in one pass
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def parse_json(data: bytes) -> object:
    """A JSON document from outside: UTF-8, its nesting bounded before json.loads recurses into it."""
    text = data.decode("utf-8")
    if nests_deeper(data):
        raise ValueError(f"JSON nested deeper than {MAX_NESTING} levels")
    return json.loads(text)


def read_json(path: Path) -> dict[str, object]:
    """A JSON object from a regular file of at most MAX_JSON_BYTES; UnusableModelError for anything else."""
    try:
        with open_regular(path) as file:
            data = file.read(MAX_JSON_BYTES + 1)
        if len(data) > MAX_JSON_BYTES:
            raise ValueError(f"over {MAX_JSON_BYTES} bytes")
        said = parse_json(data)
    except FILE_ERRORS as exc:
        raise UnusableModelError(f"{path}: not readable JSON: {exc}") from None
    if not isinstance(said, dict):
        raise UnusableModelError(f"{path}: not a JSON object")
    return said


class FolderModel(BaseModel):
    """One model of SLOTQ_MODELS_DIR: where it is, its family, and its size on disk."""

    model_config = ConfigDict(frozen=True)

    name: str
    path: Path
    family: Family
    size: int  # bytes: the file's, or the sum of a diffusers folder's files
    memory: dict[str, object] = {}  # its sidecar's "memory" settings over the service's (MemoryOptions)
    vae: Path | None = None  # the VAE file its sidecar names, used in place of its own


class Sidecar(BaseModel):
    """What a model's sidecar says of it; empty without one."""

    model_config = ConfigDict(frozen=True)

    family: Family | None = None
    vae: Path | None = None  # a .safetensors file that exists
    memory: dict[str, object] = {}  # valid MemoryOptions fields, as given


def header_names(path: Path) -> list[str]:
    """The tensor names of a safetensors or GGUF file, from its header alone."""
    gguf = path.suffix.lower() == GGUF_SUFFIX
    try:
        with open_regular(path) as file:
            return _gguf_names(file) if gguf else _safetensors_names(file)
    except FILE_ERRORS as exc:
        kind = "GGUF" if gguf else "safetensors"
        raise UnusableModelError(f"{path}: not a readable {kind} file: {exc}") from None


def _safetensors_names(file: BinaryIO) -> list[str]:
    """A safetensors file's tensor names: 8 bytes of length, then a JSON object."""
    (length,) = struct.unpack("<Q", file.read(8))
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"a header of {length} bytes")
    header = parse_json(file.read(length))
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    weights = _data_bytes(header)
    holds = os.fstat(file.fileno()).st_size - 8 - length
    if weights > holds:
        raise ValueError(f"truncated: its header gives {weights} bytes of weights, the file holds "
                         f"{max(holds, 0)} (an interrupted download or copy?)")
    return [name for name in header if name != "__metadata__"]


def _data_bytes(header: dict[str, object]) -> int:
    """The bytes of weights a safetensors header describes: where its last tensor's data ends (an entry
    of another form is for safetensors itself to refuse, at loading)."""
    ends = [0]
    for entry in header.values():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if isinstance(offsets, list) and len(offsets) == 2 and type(offsets[1]) is int:
            ends.append(offsets[1])
    return max(ends)


def _gguf_names(file: BinaryIO) -> list[str]:
    """A GGUF file's tensor names (version 2 or 3): its metadata skipped, each tensor's name read."""
    magic, version, tensors, values = GGUF_HEADER.unpack(file.read(GGUF_HEADER.size))
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"magic {magic!r}, version {version}")
    for _ in range(values):
        _gguf_string(file)  # the key
        _gguf_skip(file, struct.unpack("<I", file.read(4))[0])
    names = []
    for _ in range(tensors):
        names.append(_gguf_string(file).decode())
        (dimensions,) = struct.unpack("<I", file.read(4))
        file.seek(8 * dimensions + 4 + 8, os.SEEK_CUR)  # the shape, the type, the offset
    _gguf_within(file)
    return names


def _gguf_within(file: BinaryIO) -> None:
    """Refuse a header past MAX_HEADER_BYTES: counts of 2**64 would otherwise read a whole file."""
    if file.tell() > MAX_HEADER_BYTES:
        raise ValueError(f"a header of over {MAX_HEADER_BYTES} bytes")


def _gguf_string(file: BinaryIO) -> bytes:
    _gguf_within(file)  # each item of a loop reads one string at least
    (length,) = struct.unpack("<Q", file.read(8))
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"a string of {length} bytes")
    return file.read(length)


def _gguf_skip(file: BinaryIO, kind: int, depth: int = 0) -> None:
    """Read past one metadata value of this type (arrays of arrays at most MAX_NESTING deep)."""
    _gguf_within(file)
    if kind == GGUF_STRING:
        _gguf_string(file)
    elif kind == GGUF_ARRAY:
        if depth >= MAX_NESTING:
            raise ValueError(f"arrays nested deeper than {MAX_NESTING} levels")
        item, count = struct.unpack("<IQ", file.read(12))
        if item in GGUF_SIZES:
            file.seek(GGUF_SIZES[item] * count, os.SEEK_CUR)
        else:
            for _ in range(count):
                _gguf_skip(file, item, depth + 1)
    elif kind in GGUF_SIZES:
        file.seek(GGUF_SIZES[kind], os.SEEK_CUR)
    else:
        raise ValueError(f"a metadata value of unknown type {kind}")


def family_of_names(names: Iterable[str]) -> Family | None:
    """The family of a single-file checkpoint with these tensor names; None for none known."""
    names = list(names)
    # Flux first: a full Flux checkpoint may hold text encoders under an SD prefix.
    if any(name.removeprefix(COMFY_PREFIX).startswith(FLUX_BLOCKS) for name in names):
        return "flux"
    stripped = [name.removeprefix(COMFY_PREFIX) for name in names]
    wan = _wan_family(stripped)
    if wan is not None:
        return wan
    if _is_ltx(stripped):  # before SD's prefixes: an LTX-Video file with a text encoder is refused so
        return LTX_FAMILY
    for prefix, family in FAMILY_PREFIXES:
        if any(name.startswith(prefix) for name in names):
            return family
    return None


def _is_ltx(names: list[str]) -> bool:
    """Whether these names (ComfyUI's prefix taken off) are an LTX-Video transformer's, by diffusers'
    tells."""
    return LTX_MARK in names or any(
        (m := LTX_BLOCK_NAME.fullmatch(name)) is not None and m[2] == LTX_BLOCK_MARK for name in names)


def outside_flux_transformer(names: Iterable[str]) -> list[str]:
    """The names of a Flux file that are no FLUX.1 transformer's: a VAE's, text encoders', another model's."""
    return [name for name in names if not name.removeprefix(COMFY_PREFIX).startswith(FLUX_ROOTS)]


def check_flux_transformer(path: Path, names: Iterable[str]) -> None:
    """Refuse a Flux file holding more than a FLUX.1 transformer: a full checkpoint, rare, is not loaded."""
    outside = outside_flux_transformer(names)
    if outside:
        raise UnusableModelError(
            f"{path}: a Flux file with {len(outside)} weights outside a FLUX.1 transformer, such as "
            f"{', '.join(map(shown, outside[:3]))}: a full Flux checkpoint (transformer, VAE and text "
            f"encoders) or another model; only transformer-only FLUX.1 files are loaded, the rest from the "
            f"Flux base")


def _wan_family(names: list[str]) -> Family | None:
    """A Wan transformer's family from its names (ComfyUI's prefix taken off): image-to-video where it
    has an image embedder or image keys; None for names of no Wan transformer."""
    blocks = [m[2] for name in names if (m := WAN_BLOCK_NAME.fullmatch(name))]
    if WAN_MARK not in names and not any(inside.startswith("self_attn.") for inside in blocks):
        return None
    image = any(name.startswith("img_emb.") for name in names) or any(
        inside.startswith("cross_attn.") and "_img." in inside for inside in blocks)
    return "wan_i2v" if image else "wan"


def check_wan_transformer(path: Path, names: Iterable[str]) -> None:
    """Refuse a Wan file that is not one whole Wan transformer in Wan's layout: weights of another
    model beside it (a VAE, an encoder, VACE's), a weight missing (a truncated or partial file), a
    name no Wan transformer has."""
    stripped = [name.removeprefix(COMFY_PREFIX) for name in names]
    outside = [name for name in stripped if not name.startswith(WAN_ROOTS)]
    if outside:
        raise UnusableModelError(
            f"{path}: a Wan file with {len(outside)} weights outside a Wan 2.1 transformer, such as "
            f"{', '.join(map(shown, outside[:3]))}: a VAE's or an encoder's, or a VACE or Animate model's; "
            f"only transformer-only Wan files are loaded, the rest from the Wan base")
    found = set(stripped)
    if len(found) < len(stripped):
        raise UnusableModelError(f"{path}: a Wan file holding weights twice, under ComfyUI's prefix "
                                 f"({COMFY_PREFIX}) and without it")
    blocks = [(int(m[1]), m[2]) for name in stripped if (m := WAN_BLOCK_NAME.fullmatch(name))]
    indices = _block_indices(path, "Wan", "blocks", [index for index, _ in blocks])
    image_keys = any(inside.startswith("cross_attn.") and "_img." in inside for _, inside in blocks)
    image = image_keys or any(name.startswith("img_emb.") for name in stripped)
    block = WAN_BLOCK + (WAN_BLOCK_IMAGE if image_keys else ())
    expected = {*WAN_TOP, *(WAN_IMAGE_TOP if image else ()),
                *(f"blocks.{index}.{name}" for index in indices for name in block)}
    _check_names(path, "Wan 2.1", "Wan's", found, expected, "a first-last-frame one")


def _block_indices(path: Path, model: str, blocks: str, indices: Iterable[int]) -> list[int]:
    """A transformer's block numbers, in order; refused where it has none or a gap among them."""
    found = sorted(set(indices))
    if not found:
        raise UnusableModelError(f"{path}: not a whole {model} transformer: it has no blocks "
                                 f"({blocks}.0. ...)")
    if found != list(range(len(found))):
        gap = min(set(range(len(found) + 1)) - set(found))
        raise UnusableModelError(f"{path}: not a whole {model} transformer: it has blocks up to "
                                 f"{found[-1]} but none numbered {gap} (a truncated or partial file?)")
    return found


def _check_names(path: Path, model: str, layout: str, found: set[str], expected: set[str],
                 other: str) -> None:
    """Refuse a transformer whose names are not its expected ones, naming what it lacks and what no such
    transformer has."""
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        lacks = f"it lacks {len(missing)} of its weights, such as {', '.join(missing[:3])}" if missing else ""
        has = (f"it has {len(unexpected)} that no {model} transformer has, such as "
               f"{', '.join(map(shown, unexpected[:3]))}") if unexpected else ""
        raise UnusableModelError(f"{path}: not a whole {model} transformer in {layout} layout: "
                                 f"{'; '.join(part for part in (lacks, has) if part)} (a truncated or "
                                 f"partial file, or another model such as {other}?)")


def check_ltx_file(path: Path, names: Iterable[str]) -> None:
    """Refuse an LTX-Video file that is not one whole LTX-Video transformer in LTX-Video's layout, alone or
    with its whole VAE under ``vae.``: weights of another model beside them (a text encoder, an upscaler),
    a weight missing (a truncated or partial file), a name no LTX-Video transformer has."""
    names = list(names)
    vae = [name for name in names if name.startswith(LTX_VAE_PREFIX)]
    stripped = [name.removeprefix(COMFY_PREFIX) for name in names if not name.startswith(LTX_VAE_PREFIX)]
    outside = [name for name in stripped if not name.startswith(LTX_ROOTS)]
    outside += [name for name in vae if not name.startswith(LTX_VAE_ROOTS)]
    if outside:
        raise UnusableModelError(
            f"{path}: an LTX-Video file with {len(outside)} weights outside an LTX-Video transformer and its "
            f"VAE, such as {', '.join(map(shown, outside[:3]))}: a text encoder's or another model's; only "
            f"files of the transformer, alone or with its VAE ({LTX_VAE_PREFIX}*), are loaded, the rest from "
            f"the LTX-Video base")
    if len(set(stripped)) < len(stripped):
        raise UnusableModelError(f"{path}: an LTX-Video file holding weights twice, under ComfyUI's prefix "
                                 f"({COMFY_PREFIX}) and without it")
    _check_ltx_transformer(path, stripped)
    if vae:
        _check_ltx_vae(path, vae)


def _check_ltx_transformer(path: Path, names: list[str]) -> None:
    """Refuse an LTX-Video transformer (its names without ComfyUI's prefix) that is not whole."""
    indices = _block_indices(path, "LTX-Video", "transformer_blocks",
                             (int(m[1]) for name in names if (m := LTX_BLOCK_NAME.fullmatch(name))))
    expected = {*LTX_TOP, *(f"transformer_blocks.{index}.{name}" for index in indices for name in LTX_BLOCK)}
    _check_names(path, "LTX-Video", "LTX-Video's", set(names), expected, "an LTX-2 one")


def _check_ltx_vae(path: Path, names: list[str]) -> None:
    """Refuse an LTX-Video file's VAE that lacks its ends, its latents' statistics, a resnet of a block or
    a weight of a resnet (the rest of its layout differs by LTX-Video's version: a worker checks it against
    its base's VAE)."""
    resnets: dict[str, set[int]] = {}
    for name in names:
        if m := LTX_VAE_RESNET_NAME.fullmatch(name):
            resnets.setdefault(m[1], set()).add(int(m[2]))
    for block, indices in resnets.items():
        if indices != set(range(len(indices))):
            gap = min(set(range(len(indices) + 1)) - indices)
            raise UnusableModelError(f"{path}: not a whole LTX-Video VAE beside its transformer: "
                                     f"{shown(block)} has resnets up to {max(indices)} but none numbered "
                                     f"{gap} (a truncated or partial file?)")
    expected = {*LTX_VAE_TOP, *(f"{block}.{index}.{name}" for block, indices in resnets.items()
                                for index in indices for name in LTX_VAE_RESNET)}
    missing = sorted(expected - set(names))
    if missing:
        such = ", ".join(map(shown, missing[:3]))
        raise UnusableModelError(f"{path}: not a whole LTX-Video VAE beside its transformer: it lacks "
                                 f"{len(missing)} of its weights, such as {such} (a truncated or partial "
                                 f"file?)")


def refuse_gguf(path: Path, family: Family) -> UnusableModelError:
    """The refusal of a GGUF file of a family other than Flux."""
    return UnusableModelError(f"{path}: a GGUF file of {family}: GGUF files are loaded as FLUX.1 "
                              f"transformers only")


def sidecar_of(path: Path) -> Path:
    """Where a model's sidecar is: ``<stem>.json`` beside its file or folder."""
    stem = path.name.removesuffix(path.suffix) if path.suffix.lower() in MODEL_SUFFIXES else path.name
    return path.with_name(stem + SIDECAR_SUFFIX)


def read_sidecar(path: Path) -> Sidecar:
    """What the sidecar of the model at path says, validated; an empty one where it has none."""
    sidecar = sidecar_of(path)
    if not sidecar.exists():
        return Sidecar()
    said = read_json(sidecar)  # a FIFO or a directory of that name is no sidecar to skip: it is refused
    return Sidecar(family=_sidecar_family(sidecar, said.get("family")),
                   vae=_sidecar_vae(sidecar, said.get("vae")),
                   memory=_sidecar_memory(sidecar, said.get("memory")))


def sidecar_family(path: Path) -> Family | None:
    """The family a model's sidecar forces; None without one."""
    return read_sidecar(path).family


def _sidecar_family(sidecar: Path, family: object) -> Family | None:
    """The family a sidecar forces, once it is known to be one."""
    if family is None:
        return None
    for known in FAMILIES:
        if family == known:
            return known
    raise UnusableModelError(f"{sidecar}: family {shown(repr(family))} is none of {', '.join(FAMILIES)}")


def _sidecar_vae(sidecar: Path, vae: object) -> Path | None:
    """The VAE file a sidecar names (relative to its folder), once it is known to be a safetensors VAE."""
    if vae is None:
        return None
    if not isinstance(vae, str) or not vae:
        raise UnusableModelError(f'{sidecar}: "vae" is not a file name: {shown(repr(vae))}')
    path = sidecar.parent / vae  # an absolute name stays as it is
    suffix = path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise UnusableModelError(f'{sidecar}: "vae" {path}: {suffix} files are pickles, which can run '
                                 f"code when loaded: never opened (convert it once to .safetensors where you "
                                 f"trust it)")
    if suffix != SAFE_SUFFIX:
        raise UnusableModelError(f'{sidecar}: "vae" {path}: not a .safetensors file')
    if not path.is_file():
        raise UnusableModelError(f'{sidecar}: "vae" {path}: no such file')
    if not parsed_once(path, _is_vae):
        raise UnusableModelError(f'{sidecar}: "vae" {path}: not a VAE (no decoder weights)')
    return path


def _sidecar_memory(sidecar: Path, memory: object) -> dict[str, object]:
    """A sidecar's memory settings, those it gives, once they are known to be valid MemoryOptions."""
    if memory is None:
        return {}
    if not isinstance(memory, dict):
        raise UnusableModelError(f'{sidecar}: "memory" is not an object: {shown(repr(memory))}')
    try:
        options = MemoryOptions.model_validate(memory)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in exc.errors())
        raise UnusableModelError(f'{sidecar}: "memory" is not valid ({problems}); its settings are '
                                 f"{', '.join(MemoryOptions.model_fields)}") from None
    return {name: getattr(options, name) for name in memory}


def _is_vae(path: Path) -> bool:
    """Whether a safetensors file holds a VAE's decoder."""
    return any("decoder." in name for name in header_names(path))


def _folder_family(folder: Path) -> Family:
    """A diffusers folder's family, from its pipeline class in model_index.json."""
    name = read_json(folder / DIFFUSERS_INDEX).get("_class_name")
    if not isinstance(name, str) or name not in PIPELINE_CLASSES:
        raise UnusableModelError(f"{folder}: {shown(name)} is not a text-to-image pipeline of a known "
                                 f"family ({', '.join(sorted(PIPELINE_CLASSES))}); a sidecar can name one")
    return PIPELINE_CLASSES[name]


def _folder_size(folder: Path) -> int:
    """A diffusers folder's size, the sum of its files; refused where a part's weights are pickles
    alone, which the worker's from_pretrained(use_safetensors=True) would not load."""
    size, safe, pickled = 0, set(), set()
    for file in folder.rglob("*"):
        if not file.is_file():
            continue
        size += file.stat().st_size
        suffix = file.suffix.lower()
        if suffix == SAFE_SUFFIX:
            safe.add(file.parent)
        elif suffix in PICKLE_SUFFIXES:
            pickled.add(file.parent)
    if pickled - safe:
        raise UnusableModelError(f"{min(pickled - safe)}: its weights are pickles alone, which can run code "
                                 f"when loaded: never offered (convert them once to .safetensors where you "
                                 f"trust them)")
    return size


def _model_of(path: Path) -> FolderModel | None:
    """The model this entry of the folder is; None for an entry that is no model (a sidecar, a
    README); UnusableModelError for one that looks like a model but is not offered."""
    is_folder = path.is_dir()
    if is_folder and not (path / DIFFUSERS_INDEX).exists():
        return None
    suffix = "" if is_folder else path.suffix.lower()
    if suffix in PICKLE_SUFFIXES:
        raise UnusableModelError(f"{path}: {suffix} files are pickles, which can run code when loaded: "
                                 f"never offered (convert it once to .safetensors where you trust it)")
    if not is_folder and suffix not in MODEL_SUFFIXES:
        return None
    name = path.name.removesuffix(path.suffix) if suffix else path.name
    if not re.fullmatch(MODEL_NAME_PATTERN, name):
        raise UnusableModelError(f"{path}: {name!r} is not a model name (letters, digits, _ . -, at most 64)")
    size = _folder_size(path) if is_folder else path.stat().st_size
    sidecar = read_sidecar(path)
    if is_folder:
        family = sidecar.family or _folder_family(path)
    else:
        family = parsed_once(path, _file_family, name, sidecar.family)
    if sidecar.vae is not None and FAMILY_SPECS[family].is_video:
        raise UnusableModelError(f"{sidecar_of(path)}: \"vae\" replaces an image model's VAE only: a "
                                 f"{family} model's VAE is its own (a file's: its base's)")
    return FolderModel(name=name, path=path, family=family, size=size, memory=sidecar.memory, vae=sidecar.vae)


def _file_family(path: Path, name: str, forced: Family | None) -> Family:
    """A single file's family: the one its sidecar forces, else its keys'; a Flux or Wan file must hold
    a whole transformer alone, an LTX-Video file a whole transformer, alone or with its whole VAE."""
    names = header_names(path)
    family = forced or family_of_names(names)
    if family is None:
        raise UnusableModelError(f"{path}: not an SD or SDXL checkpoint in the single-file layout, nor a "
                                 f"FLUX.1, Wan 2.1 or LTX-Video transformer; a sidecar "
                                 f"{name}{SIDECAR_SUFFIX} with {{\"family\": ...}} can name its family")
    gguf = path.suffix.lower() == GGUF_SUFFIX
    if family in WAN_FAMILIES:  # Wan's layout: the transformer alone
        if gguf:
            raise refuse_gguf(path, family)
        check_wan_transformer(path, names)
    elif family == LTX_FAMILY:  # LTX-Video's layout: the transformer, and its VAE or not
        if gguf:
            raise refuse_gguf(path, family)
        check_ltx_file(path, names)
    elif FAMILY_SPECS[family].single_file == "transformer":  # BFL's layout: the transformer alone
        check_flux_transformer(path, names)
    elif gguf:
        raise refuse_gguf(path, family)
    return family


def _model_entry(path: Path) -> tuple[str, FolderModel] | None:
    """The model this entry of the folder is, by its name (the mechanism is shared/contract/folders.py)."""
    model = _model_of(path)
    return None if model is None else (model.name, model)


listing = NamedWeights("SLOTQ_MODELS_DIR", _model_entry, log)


def folder_models(models_dir: Path | None) -> dict[str, FolderModel]:
    """The models of SLOTQ_MODELS_DIR by name, sorted; read again only when the folder changes."""
    return listing.entries(models_dir)
