"""Single-file checkpoints, in the layout A1111, ComfyUI and Civitai use, written from tiny diffusers folders.

The original (LDM) layout keeps a whole pipeline in one file: the UNet under ``model.diffusion_model.``,
the VAE under ``first_stage_model.``, SD 1.x's CLIP under ``cond_stage_model.transformer.``, SDXL's
two encoders under ``conditioner.embedders.0.transformer.`` (CLIP) and ``conditioner.embedders.1.model.``
(OpenCLIP). The mapping here is the inverse of diffusers' ``convert_ldm_*`` loaders
(``diffusers/loaders/single_file_utils.py``) and follows its repository's
``scripts/convert_diffusers_to_original_{stable_diffusion,sdxl}.py``, made generic over block counts.

A Flux file holds its transformer alone, in BFL's layout (``double_blocks``, ``single_blocks``, q, k
and v fused): the inverse of worker/checkpoints.py's ``flux_to_diffusers``. A VAE file (A1111's) holds
a VAE in the LDM layout, without the ``first_stage_model.`` prefix. A GGUF file holds the Flux file's
weights, its matrices quantized (Q8_0), as llama.cpp's tools and ComfyUI-GGUF's write them.

A Wan file holds its transformer alone, in Wan's own layout (Wan-AI's release files, ComfyUI's
``wan2.1_t2v_1.3B_fp16.safetensors``: ``blocks.N.self_attn.q``, ``head.modulation``, ``img_emb`` in an
image-to-video one), optionally under ComfyUI's ``model.diffusion_model.`` prefix: the inverse of
diffusers' ``convert_wan_transformer_to_diffusers``, which the worker loads it with.

An LTX-Video file holds its transformer in LTX-Video's layout (``patchify_proj``, ``adaln_single``,
``attn1.q_norm``), under ComfyUI's prefix or not, and may hold its VAE beside it under ``vae.``, as
Lightricks' ``ltx-video-2b-v0.9*.safetensors`` do: the inverse of diffusers'
``convert_ltx_transformer_checkpoint_to_diffusers`` and, for a VAE of LTX-Video 0.9.0's shape (four
levels; the tiny one's), of ``convert_ltx_vae_checkpoint_to_diffusers``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.contract.checkpoints import LTX_VAE_PREFIX
from worker.checkpoints import CONFIG_PATTERNS, FLUX_BLOCKS, FLUX_SWAPPED, FLUX_TOP, swap_halves

Tensors = dict[str, torch.Tensor]

UNET_PREFIX = "model.diffusion_model."
VAE_PREFIX = "first_stage_model."
SD_CLIP_PREFIX = "cond_stage_model.transformer."
SDXL_CLIP_PREFIX = "conditioner.embedders.0.transformer."
SDXL_OPEN_CLIP_PREFIX = "conditioner.embedders.1.model."

_UNET_TOP = {
    "time_embedding.linear_1.": "time_embed.0.", "time_embedding.linear_2.": "time_embed.2.",
    "add_embedding.linear_1.": "label_emb.0.0.", "add_embedding.linear_2.": "label_emb.0.2.",
    "conv_in.": "input_blocks.0.0.", "conv_norm_out.": "out.0.", "conv_out.": "out.2.",
}
_UNET_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0",
                "conv2": "out_layers.3", "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_VAE_TOP = {"encoder.conv_norm_out.": "encoder.norm_out.", "decoder.conv_norm_out.": "decoder.norm_out."}
_VAE_ATTENTION = {"group_norm.": "norm.", "to_q.": "q.", "to_k.": "k.", "to_v.": "v.",
                  "to_out.0.": "proj_out."}
_OPEN_CLIP_TOP = {
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.final_layer_norm.weight": "ln_final.weight",
    "text_model.final_layer_norm.bias": "ln_final.bias",
}
_TEXT_MODEL_PARTS = ("embeddings.", "encoder.", "final_layer_norm.")  # a CLIP text model's, under text_model.
_OPEN_CLIP_LAYER = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc",
                    "mlp.fc2": "mlp.c_proj", "self_attn.out_proj": "attn.out_proj"}
# A Wan transformer's names, diffusers' -> Wan's: diffusers' convert_wan_transformer_to_diffusers read
# backwards (its norm2 is Wan's norm3, the cross-attention's norm; Wan's norm1 and norm2 hold no weights).
_WAN_TOP = {
    "condition_embedder.time_embedder.linear_1.": "time_embedding.0.",
    "condition_embedder.time_embedder.linear_2.": "time_embedding.2.",
    "condition_embedder.text_embedder.linear_1.": "text_embedding.0.",
    "condition_embedder.text_embedder.linear_2.": "text_embedding.2.",
    "condition_embedder.time_proj.": "time_projection.1.",
    "condition_embedder.image_embedder.norm1.": "img_emb.proj.0.",
    "condition_embedder.image_embedder.ff.net.0.proj.": "img_emb.proj.1.",
    "condition_embedder.image_embedder.ff.net.2.": "img_emb.proj.3.",
    "condition_embedder.image_embedder.norm2.": "img_emb.proj.4.",
    "patch_embedding.": "patch_embedding.",
    "proj_out.": "head.head.",
    "scale_shift_table": "head.modulation",
}
_WAN_BLOCK = {  # inside blocks.N.
    "attn1.": "self_attn.", "attn2.": "cross_attn.", "norm2.": "norm3.", "ffn.net.0.proj.": "ffn.0.",
    "ffn.net.2.": "ffn.2.", "scale_shift_table": "modulation",
}
_WAN_ATTENTION = {  # inside an attention
    "to_q.": "q.", "to_k.": "k.", "to_v.": "v.", "to_out.0.": "o.", "norm_q.": "norm_q.",
    "norm_k.": "norm_k.", "add_k_proj.": "k_img.", "add_v_proj.": "v_img.", "norm_added_k.": "norm_k_img.",
}
# An LTX-Video transformer's names, diffusers' -> LTX-Video's: diffusers'
# convert_ltx_transformer_checkpoint_to_diffusers's renames read backwards (it renames no other part).
_LTX_TRANSFORMER = {"proj_in.": "patchify_proj.", "time_embed.": "adaln_single.", ".norm_q.": ".q_norm.",
                    ".norm_k.": ".k_norm."}
# LTX-Video 0.9.0's VAE, diffusers' parts -> LTX-Video's blocks: convert_ltx_vae_checkpoint_to_diffusers's
# table read backwards. LTX-Video numbers each part of a level as a block of its own: in the encoder a
# level's resnets, its downsampler, its resnet that widens the channels, the middle last; in the decoder the
# middle first, then a level's resnet that narrows the channels, its upsampler, its resnets.
_LTX_VAE_BLOCKS = {
    "encoder.down_blocks.0.resnets.": "encoder.down_blocks.0.res_blocks.",
    "encoder.down_blocks.0.downsamplers.0.": "encoder.down_blocks.1.",
    "encoder.down_blocks.0.conv_out.": "encoder.down_blocks.2.",
    "encoder.down_blocks.1.resnets.": "encoder.down_blocks.3.res_blocks.",
    "encoder.down_blocks.1.downsamplers.0.": "encoder.down_blocks.4.",
    "encoder.down_blocks.1.conv_out.": "encoder.down_blocks.5.",
    "encoder.down_blocks.2.resnets.": "encoder.down_blocks.6.res_blocks.",
    "encoder.down_blocks.2.downsamplers.0.": "encoder.down_blocks.7.",
    "encoder.down_blocks.3.resnets.": "encoder.down_blocks.8.res_blocks.",
    "encoder.mid_block.resnets.": "encoder.down_blocks.9.res_blocks.",
    "decoder.mid_block.resnets.": "decoder.up_blocks.0.res_blocks.",
    "decoder.up_blocks.0.resnets.": "decoder.up_blocks.1.res_blocks.",
    "decoder.up_blocks.1.upsamplers.0.": "decoder.up_blocks.2.",
    "decoder.up_blocks.1.resnets.": "decoder.up_blocks.3.res_blocks.",
    "decoder.up_blocks.2.conv_in.": "decoder.up_blocks.4.",
    "decoder.up_blocks.2.upsamplers.0.": "decoder.up_blocks.5.",
    "decoder.up_blocks.2.resnets.": "decoder.up_blocks.6.res_blocks.",
    "decoder.up_blocks.3.conv_in.": "decoder.up_blocks.7.",
    "decoder.up_blocks.3.upsamplers.0.": "decoder.up_blocks.8.",
    "decoder.up_blocks.3.resnets.": "decoder.up_blocks.9.res_blocks.",
}
_LTX_VAE_ENDS = ("encoder.conv_in.", "encoder.conv_out.", "decoder.conv_in.", "decoder.conv_out.")
_LTX_RESNET = {"conv_shortcut.conv.": "conv_shortcut.", "norm3.": "norm3.norm."}  # inside a resnet
_LTX_STATISTICS = {"latents_mean": "mean-of-means", "latents_std": "std-of-means"}
# The statistics LTX-Video's files carry that diffusers does not read (its converter drops them).
_LTX_UNREAD_STATISTICS = ("channel", "mean-of-stds", "mean-of-stds_over_std-of-means")


def _renamed(name: str, table: dict[str, str]) -> str:
    """The name with the first of the table's parts it holds replaced."""
    for old, new in table.items():
        if old in name:
            return name.replace(old, new, 1)
    return name


def unet_to_ldm(state: Tensors, config: dict) -> Tensors:
    """A diffusers UNet's weights under their LDM names (``input_blocks``, ``middle_block``, ...)."""
    # LDM numbers blocks through the levels: a level down is its layers and its downsampler, a level up
    # one layer more (the last one holding the upsampler).
    per_level = config["layers_per_block"] + 1
    attended = {int(m[1]) for name in state if (m := re.match(r"up_blocks\.(\d+)\.attentions\.", name))}
    return {_unet_name(name, per_level, attended): tensor for name, tensor in state.items()}


def _unet_name(name: str, per_level: int, attended_up: set[int]) -> str:
    """One UNet weight's LDM name."""
    if m := re.match(r"down_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", name):
        index, part = 1 + int(m[1]) * per_level + int(m[3]), 0 if m[2] == "resnets" else 1
        rest = _renamed(m[4], _UNET_RESNET) if part == 0 else m[4]
        return f"input_blocks.{index}.{part}.{rest}"
    if m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", name):
        return f"input_blocks.{(int(m[1]) + 1) * per_level}.0.op.{m[2]}"
    if m := re.match(r"mid_block\.resnets\.(\d+)\.(.*)", name):
        return f"middle_block.{2 * int(m[1])}.{_renamed(m[2], _UNET_RESNET)}"
    if m := re.match(r"mid_block\.attentions\.0\.(.*)", name):
        return f"middle_block.1.{m[1]}"
    if m := re.match(r"up_blocks\.(\d+)\.(resnets|attentions)\.(\d+)\.(.*)", name):
        index, part = int(m[1]) * per_level + int(m[3]), 0 if m[2] == "resnets" else 1
        rest = _renamed(m[4], _UNET_RESNET) if part == 0 else m[4]
        return f"output_blocks.{index}.{part}.{rest}"
    if m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.conv\.(.*)", name):
        level = int(m[1])
        # The upsampler follows the level's last resnet, and its attention where the level has one.
        part = 2 if level in attended_up else 1
        return f"output_blocks.{level * per_level + per_level - 1}.{part}.conv.{m[2]}"
    renamed = _renamed(name, _UNET_TOP)
    if renamed == name:
        raise ValueError(f"no LDM name for the UNet weight {name}")
    return renamed


def vae_to_ldm(state: Tensors, config: dict) -> Tensors:
    """A diffusers VAE's weights under their LDM names (``down``, ``mid``, ``up`` reversed)."""
    levels = len(config["up_block_types"])
    return {_vae_name(name, levels): _vae_tensor(name, tensor) for name, tensor in state.items()}


def _vae_name(name: str, levels: int) -> str:
    """One VAE weight's LDM name."""
    name = name.replace("conv_shortcut", "nin_shortcut")
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.resnets\.(.*)", name):
        return f"encoder.down.{m[1]}.block.{m[2]}"
    if m := re.match(r"encoder\.down_blocks\.(\d+)\.downsamplers\.0\.(.*)", name):
        return f"encoder.down.{m[1]}.downsample.{m[2]}"
    # LDM numbers the decoder's levels from the bottom, diffusers from the top.
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.resnets\.(.*)", name):
        return f"decoder.up.{levels - 1 - int(m[1])}.block.{m[2]}"
    if m := re.match(r"decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)", name):
        return f"decoder.up.{levels - 1 - int(m[1])}.upsample.{m[2]}"
    if m := re.match(r"(encoder|decoder)\.mid_block\.resnets\.(\d+)\.(.*)", name):
        return f"{m[1]}.mid.block_{int(m[2]) + 1}.{m[3]}"
    if m := re.match(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.*)", name):
        return f"{m[1]}.mid.attn_1.{_renamed(m[2], _VAE_ATTENTION)}"
    return _renamed(name, _VAE_TOP)


def _vae_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as LDM holds it: its VAE attention projections are 1x1 convolutions, not linear layers."""
    if ".attentions." in name and name.endswith(".weight") and tensor.ndim == 2:
        return tensor[:, :, None, None]
    return tensor


def clip_to_ldm(state: Tensors) -> Tensors:
    """A CLIP text model's weights as the single file names them, each under ``text_model.``."""
    # transformers 5 saves CLIPTextModel without its ``text_model.`` level; the single-file layout has it.
    return {f"text_model.{name}" if name.startswith(_TEXT_MODEL_PARTS) else name: tensor
            for name, tensor in state.items()}


def open_clip_to_ldm(state: Tensors) -> Tensors:
    """A CLIP text model with projection's weights in OpenCLIP's layout (SDXL's second encoder)."""
    state = clip_to_ldm(state)
    ldm = {new: state[old] for old, new in _OPEN_CLIP_TOP.items()}
    ldm["text_projection"] = state["text_projection.weight"].T.contiguous()  # OpenCLIP multiplies x @ P
    found = (re.match(r"text_model\.encoder\.layers\.(\d+)\.", name) for name in state)
    layers = sorted({int(m[1]) for m in found if m})
    for layer in layers:
        inside, outside = f"text_model.encoder.layers.{layer}.", f"transformer.resblocks.{layer}."
        for kind in ("weight", "bias"):  # OpenCLIP keeps q, k and v as one projection
            parts = [state[f"{inside}self_attn.{p}_proj.{kind}"] for p in "qkv"]
            ldm[f"{outside}attn.in_proj_{kind}"] = torch.cat(parts)
        for name, tensor in state.items():
            if name.startswith(inside) and "_proj." not in name.replace("out_proj.", ""):
                ldm[outside + _renamed(name.removeprefix(inside), _OPEN_CLIP_LAYER)] = tensor
    return ldm


def flux_transformer_to_bfl(state: Tensors) -> Tensors:
    """A diffusers Flux transformer's weights in BFL's layout."""
    state = dict(state)
    bfl: Tensors = {}
    for kind, (blocks, renames, fused) in FLUX_BLOCKS.items():
        found = (re.match(rf"{blocks}\.(\d+)\.", name) for name in state)
        for index in sorted({int(m[1]) for m in found if m}):
            inside = {name.removeprefix(f"{blocks}.{index}."): state.pop(name) for name in list(state)
                      if name.startswith(f"{blocks}.{index}.")}
            bfl.update(_prefixed(f"{kind}.{index}.", _flux_block_to_bfl(inside, renames, fused)))
    for name, tensor in state.items():
        bfl_name = _flux_name(name, FLUX_TOP)
        bfl[bfl_name] = swap_halves(tensor) if bfl_name.startswith(FLUX_SWAPPED) else tensor
    return bfl


def _flux_block_to_bfl(inside: Tensors, renames: dict[str, str],
                       fused: dict[str, tuple[str, ...]]) -> Tensors:
    """One Flux block's weights in BFL's layout: its q, k and v (and MLP input) fused in that order."""
    bfl = {old + kind: torch.cat([inside.pop(part + kind) for part in parts])
           for old, parts in fused.items() for kind in ("weight", "bias")}
    return {**bfl, **{_flux_name(name, renames): tensor for name, tensor in inside.items()}}


def _flux_name(name: str, table: dict[str, str]) -> str:
    """A diffusers name's BFL one: the table (BFL -> diffusers) read backwards."""
    for old, new in table.items():
        if name.startswith(new):
            return old + name.removeprefix(new)
    raise ValueError(f"no BFL name for the Flux transformer weight {name}")


def wan_transformer_to_original(state: Tensors) -> Tensors:
    """A diffusers Wan transformer's weights in Wan's own layout."""
    return {_wan_name(name): tensor for name, tensor in state.items()}


def _wan_name(name: str) -> str:
    """One Wan transformer weight's name in Wan's layout."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.*)", name)
    if m is None:
        return _wan_renamed(name, _WAN_TOP, name)
    inside = _wan_renamed(m[2], _WAN_BLOCK, name)
    if inside.startswith(("self_attn.", "cross_attn.")):
        attention, rest = inside.split(".", 1)
        inside = f"{attention}.{_wan_renamed(rest, _WAN_ATTENTION, name)}"
    return f"blocks.{m[1]}.{inside}"


def _wan_renamed(name: str, table: dict[str, str], whole: str) -> str:
    """The name with the table's prefix it starts with replaced."""
    for old, new in table.items():
        if name.startswith(old):
            return new + name.removeprefix(old)
    raise ValueError(f"no Wan name for the Wan transformer weight {whole}")


def ltx_transformer_to_original(state: Tensors) -> Tensors:
    """A diffusers LTX-Video transformer's weights in LTX-Video's layout."""
    return {_renamed_all(name, _LTX_TRANSFORMER): tensor for name, tensor in state.items()}


def _renamed_all(name: str, table: dict[str, str]) -> str:
    """The name with each of the table's parts it holds replaced once."""
    for old, new in table.items():
        name = name.replace(old, new, 1)
    return name


def ltx_vae_to_original(state: Tensors) -> Tensors:
    """A diffusers LTX-Video VAE's weights in LTX-Video 0.9.0's layout, without the file's ``vae.`` prefix
    (four levels, the last without a downsampler, the first of the decoder without an upsampler)."""
    original = {_ltx_vae_name(name): tensor for name, tensor in state.items()}
    means = state["latents_mean"]  # the statistics LTX-Video's files carry beside those diffusers reads
    unread = (torch.arange(len(means), dtype=means.dtype), torch.ones_like(means), torch.ones_like(means))
    return {**original, **{f"per_channel_statistics.{name}": tensor
                           for name, tensor in zip(_LTX_UNREAD_STATISTICS, unread, strict=True)}}


def _ltx_vae_name(name: str) -> str:
    """One LTX-Video VAE weight's name in LTX-Video 0.9.0's layout."""
    if name in _LTX_STATISTICS:
        return f"per_channel_statistics.{_LTX_STATISTICS[name]}"
    if name.startswith(_LTX_VAE_ENDS):
        return name
    for part, block in _LTX_VAE_BLOCKS.items():
        if name.startswith(part):
            return block + _renamed_all(name.removeprefix(part), _LTX_RESNET)
    raise ValueError(f"no LTX-Video 0.9.0 name for the VAE weight {name} (another layout than 0.9.0's?)")


def _component(folder: Path, name: str) -> tuple[Tensors, dict]:
    """The weights and config of one component of a diffusers folder."""
    (weights,) = (folder / name).glob("*.safetensors")
    return load_file(weights), json.loads((folder / name / "config.json").read_text("utf-8"))


def _prefixed(prefix: str, state: Tensors) -> Tensors:
    """The weights with the prefix before each name."""
    return {prefix + name: tensor for name, tensor in state.items()}


def checkpoint_of(folder: Path) -> Tensors:
    """The single-file state dict of a diffusers folder: an SD 1.x or SDXL pipeline's, a Flux, Wan or
    LTX-Video one's transformer alone."""
    if (folder / "transformer").is_dir():
        transformer, _ = _component(folder, "transformer")
        pipeline = json.loads((folder / "model_index.json").read_text("utf-8"))["_class_name"]
        if pipeline.startswith("Wan"):
            return wan_transformer_to_original(transformer)
        if pipeline.startswith("LTX"):
            return ltx_transformer_to_original(transformer)
        return flux_transformer_to_bfl(transformer)
    unet, unet_config = _component(folder, "unet")
    vae, vae_config = _component(folder, "vae")
    text, _ = _component(folder, "text_encoder")
    state = {**_prefixed(UNET_PREFIX, unet_to_ldm(unet, unet_config)),
             **_prefixed(VAE_PREFIX, vae_to_ldm(vae, vae_config))}
    if not (folder / "text_encoder_2").is_dir():
        return {**state, **_prefixed(SD_CLIP_PREFIX, clip_to_ldm(text))}
    text_2, _ = _component(folder, "text_encoder_2")
    return {**state, **_prefixed(SDXL_CLIP_PREFIX, clip_to_ldm(text)),
            **_prefixed(SDXL_OPEN_CLIP_PREFIX, open_clip_to_ldm(text_2))}


def write_checkpoint(folder: Path, path: Path) -> Path:
    """Write the diffusers folder's pipeline as one ``.safetensors`` file in the original layout."""
    state = {name: tensor.contiguous() for name, tensor in checkpoint_of(Path(folder)).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def write_wan_transformer(folder: Path, path: Path, prefix: str = "") -> Path:
    """Write a Wan diffusers folder's transformer as one ``.safetensors`` file in Wan's layout, each name
    after prefix (ComfyUI's ``model.diffusion_model.``, or none as in Wan-AI's files)."""
    state = {prefix + name: tensor.contiguous() for name, tensor in checkpoint_of(Path(folder)).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def write_ltx_file(folder: Path, path: Path, prefix: str = "", with_vae: bool = False) -> Path:
    """Write an LTX-Video diffusers folder's transformer as one ``.safetensors`` file in LTX-Video's layout,
    each name after prefix (ComfyUI's ``model.diffusion_model.``, or none); with_vae, its VAE beside it
    under ``vae.`` in LTX-Video 0.9.0's layout, as Lightricks' own files hold both."""
    state = _prefixed(prefix, checkpoint_of(Path(folder)))
    if with_vae:
        vae, _ = _component(Path(folder), "vae")
        state.update(_prefixed(LTX_VAE_PREFIX, ltx_vae_to_original(vae)))
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path))
    return path


def write_gguf(folder: Path, path: Path) -> Path:
    """Write a Flux diffusers folder's transformer as a GGUF file in BFL's layout (another one's in its
    file layout: GGUF files that are refused): each matrix whose rows are whole blocks of Q8_0 (32 values)
    quantized, the rest (biases, norms) kept in float32, as real GGUF files keep them."""
    import gguf  # the gguf package, only where GGUF files are written or read

    writer = gguf.GGUFWriter(str(path), "flux")
    for name, tensor in checkpoint_of(Path(folder)).items():
        values = tensor.float().numpy()
        if values.ndim == 2 and values.shape[1] % 32 == 0:
            quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_vae(folder: Path, path: Path, scale: float = 1.0) -> Path:
    """Write the diffusers folder's VAE as an A1111 VAE file (the LDM layout), its weights times scale:
    another VAE, which tells its images apart, for a scale other than 1."""
    vae, config = _component(Path(folder), "vae")
    state = {name: (tensor * scale).contiguous() for name, tensor in vae_to_ldm(vae, config).items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def write_base(folder: Path, destination: Path, without: tuple[str, ...] = ("transformer",)) -> Path:
    """Copy a diffusers folder without the weights of these components (its transformer's): the base a
    file holding them (Flux's, Wan's, LTX-Video's) is loaded into, which cannot quietly lend them."""

    def weights_left_out(directory: str, names: list[str]) -> list[str]:
        return [name for name in names if Path(directory).name in without and name.endswith(".safetensors")]

    shutil.copytree(folder, destination, ignore=weights_left_out, dirs_exist_ok=True)
    return destination


def write_configs(folder: Path, destination: Path) -> Path:
    """Copy the folder's configs and tokenizers, not its weights: where a single file takes its layout."""
    shutil.copytree(folder, destination, ignore=_not_configs, dirs_exist_ok=True)
    return destination


def _not_configs(directory: str, names: list[str]) -> list[str]:
    """The names copytree leaves out: every file that is not a config or tokenizer file."""
    return [name for name in names if not (Path(directory) / name).is_dir()
            and not any(Path(name).match(pattern) for pattern in CONFIG_PATTERNS)]
