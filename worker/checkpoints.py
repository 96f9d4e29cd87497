"""Single-file checkpoints (the layout A1111, ComfyUI and Civitai use): their family and their loading,
and the loading of any model of SLOTQ_MODELS_DIR with the VAE file its sidecar names.

A single file holds the weights only; the layout of each component (configs, tokenizers) comes from
the family's configuration source, SLOTQ_CHECKPOINT_CONFIGS, read from disk and never fetched. A Flux
file holds its transformer alone (BFL's layout; a ``.gguf`` file holds it quantized, loaded through
diffusers' GGUF support and the gguf package): the other components are those of that source, the
Flux base, a diffusers folder with their weights. A Wan file holds its transformer alone too (Wan's
own layout, converted by diffusers' own ``convert_wan_transformer_to_diffusers``): the T5 encoder, the
VAE, the scheduler and tokenizer (and an image-to-video model's CLIP image encoder and processor) are
those of its family's base, a diffusers folder with their weights. An LTX-Video file holds its
transformer (LTX-Video's layout), and may hold its VAE beside it under ``vae.`` (Lightricks' own files
do), both converted by diffusers' own converters: the T5 encoder, the scheduler and tokenizer, and the
VAE where the file has none, are those of the ``ltx`` base, a diffusers folder with their weights.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import diffusers
import torch
from accelerate import init_empty_weights
from diffusers import (
    AutoencoderKL,
    AutoencoderKLLTXVideo,
    DiffusionPipeline,
    FluxPipeline,
    FluxTransformer2DModel,
    GGUFQuantizationConfig,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    ModelMixin,
    WanTransformer3DModel,
)
from diffusers.loaders.single_file_utils import (
    convert_ltx_transformer_checkpoint_to_diffusers,
    convert_ltx_vae_checkpoint_to_diffusers,
    convert_wan_transformer_to_diffusers,
)
from diffusers.models.model_loading_utils import load_gguf_checkpoint
from huggingface_hub import snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError
from safetensors import SafetensorError
from safetensors.torch import load_file

from shared.contract.checkpoints import (
    COMFY_PREFIX,
    GGUF_SUFFIX,
    LTX_FAMILY,
    LTX_VAE_PREFIX,
    MODEL_SUFFIXES,
    PICKLE_SUFFIXES,
    WAN_FAMILIES,
    UnusableModelError,
    check_flux_transformer,
    check_ltx_file,
    check_wan_transformer,
    family_of_names,
    header_names,
    read_sidecar,
    refuse_gguf,
)
from shared.contract.models import FAMILY_SPECS, Family, family_spec

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]

# Each family's pipeline class, as its record names it (diffusers exports every one at its top level).
PIPELINES: dict[Family, type[DiffusionPipeline]] = {family: getattr(diffusers, spec.pipeline_class)
                                                    for family, spec in FAMILY_SPECS.items()}
# What diffusers reads from a configuration source: configs and tokenizer files, no weights; file-name
# patterns, as Path.match reads them (worker/tiny/checkpoints.py copies a folder's configs with them).
CONFIG_PATTERNS = ("*.json", "*.txt", "*.model")
# The same as snapshot_download's allow_patterns, which match a whole path: at the top and in subfolders.
_ALLOW_PATTERNS = [form for pattern in CONFIG_PATTERNS for form in (pattern, f"**/{pattern}")]

# A FLUX.1 transformer's weights, BFL's names -> diffusers', as diffusers' own
# convert_flux_transformer_checkpoint_to_diffusers maps them. That converter takes FLUX.1's width
# (3072) as given and cannot read a narrower model; this mapping reads any width and block count
# (tests/worker/test_checkpoints.py holds it to diffusers' at FLUX.1's width).
FLUX_TOP = {
    "img_in.": "x_embedder.",
    "txt_in.": "context_embedder.",
    "time_in.in_layer.": "time_text_embed.timestep_embedder.linear_1.",
    "time_in.out_layer.": "time_text_embed.timestep_embedder.linear_2.",
    "vector_in.in_layer.": "time_text_embed.text_embedder.linear_1.",
    "vector_in.out_layer.": "time_text_embed.text_embedder.linear_2.",
    "guidance_in.in_layer.": "time_text_embed.guidance_embedder.linear_1.",
    "guidance_in.out_layer.": "time_text_embed.guidance_embedder.linear_2.",
    "final_layer.linear.": "proj_out.",
    "final_layer.adaLN_modulation.1.": "norm_out.linear.",  # its halves swapped: BFL's shift, scale
}
FLUX_SWAPPED = "final_layer.adaLN_modulation.1."
FLUX_DOUBLE = {  # inside double_blocks.N. -> inside transformer_blocks.N.
    "img_mod.lin.": "norm1.linear.",
    "txt_mod.lin.": "norm1_context.linear.",
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight",
    "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
    "img_attn.proj.": "attn.to_out.0.",
    "txt_attn.proj.": "attn.to_add_out.",
    "img_mlp.0.": "ff.net.0.proj.",
    "img_mlp.2.": "ff.net.2.",
    "txt_mlp.0.": "ff_context.net.0.proj.",
    "txt_mlp.2.": "ff_context.net.2.",
}
FLUX_SINGLE = {  # inside single_blocks.N. -> inside single_transformer_blocks.N.
    "modulation.lin.": "norm.linear.",
    "norm.query_norm.scale": "attn.norm_q.weight",
    "norm.key_norm.scale": "attn.norm_k.weight",
    "linear2.": "proj_out.",
}
# One weight in BFL's layout, several in diffusers': each part the model's width wide, the last the rest.
FLUX_DOUBLE_FUSED: dict[str, tuple[str, ...]] = {
    "img_attn.qkv.": ("attn.to_q.", "attn.to_k.", "attn.to_v."),
    "txt_attn.qkv.": ("attn.add_q_proj.", "attn.add_k_proj.", "attn.add_v_proj."),
}
FLUX_SINGLE_FUSED: dict[str, tuple[str, ...]] = {
    "linear1.": ("attn.to_q.", "attn.to_k.", "attn.to_v.", "proj_mlp."),
}
# BFL's block kind -> diffusers' blocks, the renamed weights inside one, and the fused ones.
FLUX_BLOCKS: dict[str, tuple[str, dict[str, str], dict[str, tuple[str, ...]]]] = {
    "double_blocks": ("transformer_blocks", FLUX_DOUBLE, FLUX_DOUBLE_FUSED),
    "single_blocks": ("single_transformer_blocks", FLUX_SINGLE, FLUX_SINGLE_FUSED),
}


class CheckpointError(ValueError):
    """A single-file checkpoint that the worker will not or cannot load."""


def is_single_file(model: str) -> bool:
    """Whether SLOTQ_MODEL names a single-file checkpoint (a safetensors or GGUF file, or a pickle)."""
    suffix = Path(model).suffix.lower()
    return suffix in MODEL_SUFFIXES or suffix in PICKLE_SUFFIXES


def family_of_checkpoint(path: Path) -> Family:
    """The family of a single-file checkpoint, from its key names (its header only)."""
    family = family_of_names(_key_names(path))
    if family is not None:
        return family
    raise CheckpointError(f"{path}: not an SD or SDXL checkpoint in the single-file layout (no "
                          f"cond_stage_model.* or conditioner.embedders.* weights), nor a FLUX.1 transformer "
                          f"(no double_blocks.*), nor a Wan 2.1 transformer (no head.modulation), nor an "
                          f"LTX-Video transformer (no patchify_proj.weight)")


def _key_names(path: Path) -> list[str]:
    """The tensor names of a safetensors or GGUF file; a pickle is refused before it is opened."""
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: {path.suffix} files are pickles, which can run code when loaded; "
                              f"only .safetensors files are loaded (convert it once where you trust it)")
    if path.suffix.lower() not in MODEL_SUFFIXES:
        raise CheckpointError(f"{path}: not a .safetensors or .gguf file")
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
        return Path(snapshot_download(source, allow_patterns=_ALLOW_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, ValueError) as exc:
        raise CheckpointError(
            f"the configuration {source!r} is neither a folder nor in the local hub cache ({exc}); download "
            f"its configs once: hf download {source} --include '*.json' '*.txt'") from None


def load_folder_model(path: Path, configs: Mapping[Family, str], dtype: torch.dtype) -> DiffusionPipeline:
    """Load a model of SLOTQ_MODELS_DIR, a single file or a diffusers folder, with the VAE file its
    sidecar names (if any) in place of its own; offline."""
    try:
        vae_file = read_sidecar(path).vae
    except UnusableModelError as exc:
        raise CheckpointError(str(exc)) from None
    if not path.is_dir():
        family = _family(path)
        if vae_file is not None and family_spec(family).is_video:
            raise CheckpointError(f"{path}: its sidecar names a VAE file, which replaces an image model's "
                                  f"VAE only: a {family} file's VAE is its base's")
        vae = None if vae_file is None else load_vae(vae_file, config_folder(configs[family]), dtype)
        return load_checkpoint(path, configs, dtype, vae=vae)
    # A diffusers folder holds its own VAE's config: the one the VAE file replaces.
    components = {} if vae_file is None else {"vae": load_vae(vae_file, path, dtype)}
    # safetensors only: a part whose weights are pickles (.bin) fails here rather than reaching
    # torch.load (the folder's listing offers no such model).
    return DiffusionPipeline.from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True,
                                             **components)


def load_vae(path: Path, config: Path, dtype: torch.dtype) -> AutoencoderKL:
    """Load a VAE file (the LDM layout of A1111's VAE files, or diffusers') with the VAE config of a
    configuration source."""
    log.info("loading the VAE %s with the config of %s", path, config)
    vae = AutoencoderKL.from_single_file(str(path), config=str(config), subfolder="vae",
                                         local_files_only=True, dtype=dtype)
    _check_weights(vae, "VAE", path)
    return vae


def load_checkpoint(path: Path, configs: Mapping[Family, str], dtype: torch.dtype,
                    vae: AutoencoderKL | None = None) -> DiffusionPipeline:
    """Load a single-file checkpoint as its family's pipeline, with that family's configs, offline;
    the family is the one its sidecar (``<stem>.json``) forces, else the one its keys show. A VAE
    given is used in place of the file's (or the Flux base's)."""
    family = _family(path)
    folder = config_folder(configs[family])
    log.info("loading %s (%s) with the configs of %s", path, family, folder)
    components = {} if vae is None else {"vae": vae}
    if family in WAN_FAMILIES:  # its transformer alone: Wan's layout
        return _load_wan(path, family, folder, dtype, components)
    if family == LTX_FAMILY:  # its transformer, and its VAE or not: LTX-Video's layout
        return _load_ltx(path, folder, dtype, components)
    if family_spec(family).single_file == "transformer":  # its transformer alone: Flux's layout
        return _load_flux(path, folder, dtype, components)
    if path.suffix.lower() == GGUF_SUFFIX:
        raise CheckpointError(str(refuse_gguf(path, family)))
    try:
        pipe = PIPELINES[family].from_single_file(str(path), config=str(folder), local_files_only=True,
                                                  dtype=dtype, **components)
    except NotImplementedError as exc:
        # A weight the file lacks stays on the meta device; diffusers' own models fail moving it.
        if "meta tensor" not in str(exc):
            raise
        raise CheckpointError(f"{path}: the file lacks weights of its UNet or VAE") from exc
    _check_complete(pipe, path)
    return pipe


def _family(path: Path) -> Family:
    """A single file's family: the one its sidecar forces, else the one its keys show."""
    _key_names(path)  # a pickle is refused, whatever its sidecar says
    try:
        forced = read_sidecar(path).family
    except UnusableModelError as exc:
        raise CheckpointError(str(exc)) from None
    return forced or family_of_checkpoint(path)


def _load_flux(path: Path, base: Path, dtype: torch.dtype,
               components: dict[str, AutoencoderKL]) -> DiffusionPipeline:
    """A Flux pipeline: the file's transformer, the rest from the Flux base (a diffusers folder)."""
    names = _key_names(path)
    try:
        check_flux_transformer(path, names)
    except UnusableModelError as exc:
        raise CheckpointError(str(exc)) from None
    state, quantization = _flux_file(path, dtype)
    state = flux_to_diffusers(state)
    _check_fits(FluxTransformer2DModel, state, base, path, "Flux base",
                "(a schnell file with a dev base, or the reverse?)")
    # Already in diffusers' names: from_single_file loads them as they are.
    transformer = FluxTransformer2DModel.from_single_file(state, config=str(base), subfolder="transformer",
                                                          local_files_only=True, dtype=dtype, **quantization)
    try:
        pipe = FluxPipeline.from_pretrained(base, transformer=transformer, local_files_only=True, dtype=dtype,
                                            **components)
    except OSError as exc:
        raise CheckpointError(f"the Flux base {base} lacks weights of its text encoders or VAE ({exc}); a "
                              f"Flux file holds its transformer alone: download the base once without it (hf "
                              f"download <its hub id> --exclude 'transformer/*' 'flux1-*.safetensors')"
                              ) from None
    _check_complete(pipe, path)
    return pipe


def _flux_file(path: Path, dtype: torch.dtype) -> tuple[Tensors, dict[str, GGUFQuantizationConfig]]:
    """A Flux file's weights in BFL's names, and for a GGUF file the quantization that keeps them
    quantized (diffusers dequantizes each layer's weights as it runs, to dtype)."""
    if path.suffix.lower() != GGUF_SUFFIX:
        return load_file(str(path)), {}
    try:
        # diffusers' own reader (its from_single_file's), not re-exported at its top level.
        state = load_gguf_checkpoint(str(path))
    except ImportError:
        raise CheckpointError(f"{path}: a GGUF file is read with the gguf package: pip install 'gguf>=0.10'"
                              ) from None
    return state, {"quantization_config": GGUFQuantizationConfig(compute_dtype=dtype)}


def _checked_file(path: Path, family: Family, check: Callable[[Path, list[str]], None]) -> Tensors:
    """A video family's file's weights, in its own layout, once the listing's ``check`` of its names
    passes (a GGUF file refused)."""
    if path.suffix.lower() == GGUF_SUFFIX:
        raise CheckpointError(str(refuse_gguf(path, family)))
    try:
        check(path, _key_names(path))
        return load_file(str(path))
    except UnusableModelError as exc:
        raise CheckpointError(str(exc)) from None
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None


def _load_wan(path: Path, family: Family, base: Path, dtype: torch.dtype,
              components: dict[str, AutoencoderKL]) -> DiffusionPipeline:
    """A Wan pipeline (text- or image-to-video): the file's transformer, the rest from the family's
    base (a diffusers folder)."""
    state = _checked_file(path, family, check_wan_transformer)
    # diffusers' own converter (what its from_single_file runs on such a file): Wan's names to diffusers'.
    state = convert_wan_transformer_to_diffusers(state)
    _check_fits(WanTransformer3DModel, state, base, path, f"{family} base",
                "(a 14B file with a 1.3B base, a Wan 2.2 file with a Wan 2.1 base, or the reverse?)")
    transformer = WanTransformer3DModel.from_single_file(state, config=str(base), subfolder="transformer",
                                                         local_files_only=True, dtype=dtype)
    _keep_in_float32(transformer, state)
    try:
        pipe = PIPELINES[family].from_pretrained(base, transformer=transformer, local_files_only=True,
                                                 use_safetensors=True, dtype=dtype, **components)
    except OSError as exc:
        raise CheckpointError(f"the {family} base {base} lacks weights of its other components ({exc}); a "
                              f"Wan file holds its transformer alone: download the base once without it (hf "
                              f"download <its hub id> --exclude 'transformer/*')") from None
    _check_complete(pipe, path)
    return pipe


def _load_ltx(path: Path, base: Path, dtype: torch.dtype,
              components: dict[str, AutoencoderKL]) -> DiffusionPipeline:
    """An LTX-Video pipeline: the file's transformer, and its VAE where it holds one (a VAE given wins),
    the rest from the ltx base (a diffusers folder)."""
    state = _checked_file(path, LTX_FAMILY, check_ltx_file)
    vae_state = {name: state.pop(name) for name in list(state) if name.startswith(LTX_VAE_PREFIX)}
    # diffusers' own converters (what its from_single_file runs on such a file): LTX-Video's names to
    # diffusers'.
    state = convert_ltx_transformer_checkpoint_to_diffusers(state)
    _check_fits(LTXVideoTransformer3DModel, state, base, path, "ltx base",
                "(a 13B file with a 2B base, or the reverse?)")
    transformer = LTXVideoTransformer3DModel.from_single_file(
        state, config=str(base), subfolder="transformer", local_files_only=True, dtype=dtype)
    _keep_in_float32(transformer, state)  # a no-op today: diffusers 0.42 keeps no LTX-Video module in float32
    if vae_state and "vae" not in components:
        components = {**components, "vae": _ltx_vae(vae_state, base, path, dtype)}
    try:
        pipe = LTXPipeline.from_pretrained(base, transformer=transformer, local_files_only=True,
                                           use_safetensors=True, dtype=dtype, **components)
    except OSError as exc:
        raise CheckpointError(f"the ltx base {base} lacks weights of its other components ({exc}); an "
                              f"LTX-Video file holds its transformer (and its VAE or not): download the rest "
                              f"of the base once (hf download <its hub id> --include model_index.json "
                              f"'scheduler/*' 'text_encoder/*' 'tokenizer/*' 'vae/*')") from None
    _check_complete(pipe, path)
    return pipe


def _ltx_vae(state: Tensors, base: Path, path: Path, dtype: torch.dtype) -> AutoencoderKLLTXVideo:
    """An LTX-Video file's VAE (its ``vae.`` weights), in the layout of the ltx base's VAE."""
    state = convert_ltx_vae_checkpoint_to_diffusers(state)
    _check_fits(AutoencoderKLLTXVideo, state, base, path, "ltx base",
                "(a VAE of another LTX-Video version than the base's, such as 0.9.5's with a 0.9.0 base?)",
                subfolder="vae")
    vae = AutoencoderKLLTXVideo.from_single_file(state, config=str(base), subfolder="vae",
                                                 local_files_only=True, dtype=dtype)
    _keep_in_float32(vae, state)
    return vae


def _keep_in_float32(model: ModelMixin, state: Tensors) -> None:
    """Keep the modules a model keeps in float32 (its _keep_in_fp32_modules) in float32, as its
    from_pretrained does: from_single_file casts them to the dtype too (a Wan transformer's norms,
    modulation, time embedder and rotary tables)."""
    kept = model._keep_in_fp32_modules or []

    def is_kept(name: str) -> bool:  # from_pretrained's test (load_model_dict_into_meta)
        return any(module in name.split(".") for module in kept)

    parameters = {name: tensor for name, tensor in model.named_parameters()
                  if is_kept(name) and tensor.dtype != torch.float32}
    buffers = {name: tensor for name, tensor in model.named_buffers()
               if is_kept(name) and tensor.dtype != torch.float32}
    if not parameters and not buffers:
        return
    for name, parameter in parameters.items():
        parameter.data = state[name].to(torch.float32)  # the file's values, not their rounding
    with init_empty_weights():  # weights on the meta device, buffers computed as at construction
        built = dict(type(model).from_config(model.config).named_buffers())
    for name, buffer in buffers.items():
        buffer.data = built[name]


def _check_fits(model: type[ModelMixin], state: Tensors, base: Path, path: Path, kind: str,
                hint: str, subfolder: str = "transformer") -> None:
    """Refuse a component (its transformer, by default) whose weights are not those of the base's (their
    names, and their shapes where they are not quantized): diffusers would take them for another layout
    and fail converting them, or fail loading them."""
    config = model.load_config(str(base), subfolder=subfolder, local_files_only=True)
    with torch.device("meta"):
        expected = model.from_config(config).state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    shapes = sorted(name for name, tensor in state.items() if name in expected
                    and type(tensor) is torch.Tensor and tensor.shape != expected[name].shape)
    if missing or unexpected or shapes:
        other = [f"{name} {tuple(state[name].shape)}, not {tuple(expected[name].shape)}"
                 for name in shapes[:3]]
        part = "VAE" if subfolder == "vae" else subfolder
        raise CheckpointError(f"{path}: its {part} is not of the {kind}'s kind ({base}): missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}, of other shapes {other} {hint}")


def flux_to_diffusers(state: Tensors) -> Tensors:
    """A FLUX.1 transformer's weights from BFL's layout (under ComfyUI's prefix or not) to diffusers'."""
    state = {name.removeprefix(COMFY_PREFIX): tensor for name, tensor in state.items()}
    if "img_in.weight" not in state:
        raise CheckpointError("not a FLUX.1 transformer: no img_in.weight")
    width = state["img_in.weight"].shape[0]  # the model's: its blocks' fused weights are split by it
    converted: Tensors = {}
    for name, tensor in state.items():
        converted.update(_flux_weights(name, tensor, width))
    return converted


def _flux_weights(name: str, tensor: torch.Tensor, width: int) -> Tensors:
    """One weight of BFL's layout as diffusers' weights: renamed, or split where BFL fuses them."""
    m = re.fullmatch(r"(double_blocks|single_blocks)\.(\d+)\.(.*)", name)
    if m is None:
        swapped = name.startswith(FLUX_SWAPPED)
        return {_flux_renamed(name, FLUX_TOP, name): swap_halves(tensor) if swapped else tensor}
    blocks, renames, fused = FLUX_BLOCKS[m[1]]
    inside, rest = f"{blocks}.{m[2]}.", m[3]
    for old, parts in fused.items():
        if rest.startswith(old):
            sizes = [width] * (len(parts) - 1) + [tensor.shape[0] - width * (len(parts) - 1)]
            pieces, kind = tensor.split(sizes), rest.removeprefix(old)  # kind: weight or bias
            return {inside + part + kind: piece for part, piece in zip(parts, pieces, strict=True)}
    return {inside + _flux_renamed(rest, renames, name): tensor}


def _flux_renamed(name: str, table: dict[str, str], whole: str) -> str:
    """The name with the table's prefix it starts with replaced."""
    for old, new in table.items():
        if name.startswith(old):
            return new + name.removeprefix(old)
    raise CheckpointError(f"no diffusers name for the FLUX.1 transformer weight {whole}")


def swap_halves(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor with its two halves (along the first dimension) swapped: BFL's final modulation
    gives shift then scale, diffusers' scale then shift."""
    first, second = tensor.chunk(2)
    return torch.cat([second, first])


def _check_complete(pipe: DiffusionPipeline, path: Path) -> None:
    """Refuse a pipeline whose components the file left weights of unset (on the meta device): the
    first move to the device would fail with "Cannot copy out of meta tensor"."""
    for name, component in pipe.components.items():
        if isinstance(component, torch.nn.Module):
            _check_weights(component, name, path)


def _check_weights(module: torch.nn.Module, name: str, path: Path) -> None:
    """Refuse a component with weights the file left unset (on the meta device)."""
    missing = [weight for weight, tensor in module.state_dict().items() if tensor.is_meta]
    if missing:
        raise CheckpointError(f"{path}: the file lacks {len(missing)} weights of the {name}, "
                              f"such as {', '.join(missing[:3])}")
