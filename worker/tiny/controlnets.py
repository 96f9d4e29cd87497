"""Tiny ControlNets for the tiny SD and SDXL models, in SLOTQ_CONTROLNET_DIR's layout, for tests and
offline demos.

Each tiny model (``tiny``, ``tiny-sdxl``; see worker/tiny/model.py) gets a subfolder of its own in one
folder: ``chalk`` and ``ember`` in diffusers' layout, and ``chalk-file.safetensors``, chalk's weights in
the single-file layout. Each is diffusers' ``ControlNetModel.from_unet`` of the model's UNet, as
ControlNet training starts. Such a ControlNet changes nothing: its zero convolutions (the residuals it
adds to the UNet's, and the last layer of its control image's embedding) start at zero. Here they get
seeded random weights of a visible size, and so does the rest of the control image's embedding, whose
default initialisation fades a picture of thin edges to almost nothing over its eight layers: each
ControlNet changes an image and follows its control image, and a build is deterministic.

The single file of SD holds the original ControlNet's names (``control_model.input_blocks...``), which
diffusers' ``from_single_file`` converts. That of SDXL holds diffusers' names, which it reads as they
are: its converter of the original names maps no SDXL ``add_embedding`` (diffusers 0.42).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import ControlNetModel, UNet2DConditionModel
from safetensors.torch import save_file

from shared.contract.checkpoints import SAFE_SUFFIX
from worker.tiny.files import write_once
from worker.tiny.model import ensure_tiny_model

FOLDER = "tiny-controlnets-v1"  # under the cache; bump its version when the ControlNets change
MODELS = ("tiny", "tiny-sdxl")
CONTROLNETS = {"chalk": 1, "ember": 2}  # name -> seed, the same for every model
SINGLE_FILE = "chalk-file"  # chalk's weights in the single-file layout
# The std of the weights of the zero convolutions of the residuals: at scale 1 a ControlNet moves the
# pixels (in [0, 1]) of a 64 px, 2-step image by 0.05-0.06 on average (tests/worker/test_controlnets.py).
GAIN = 1.0
RESIDUALS = ("controlnet_down_blocks.", "controlnet_mid_block.")
EMBEDDING = "controlnet_cond_embedding."
# The control image's embedding is He-initialised (its variance kept through the layers, biases 0), and
# its last layer's output made about as large as the latents' own first layer's: a square's edges and
# a circle's then give images that differ by about 0.03.
EMBEDDING_OUT, EMBEDDING_OUT_GAIN = "controlnet_cond_embedding.conv_out.", 10.0

Tensors = dict[str, torch.Tensor]


def ensure_tiny_controlnets(cache_dir: Path, model: str = "tiny") -> Path:
    """Write the tiny model's ControlNets under cache_dir once; return the folder that holds them (under
    the model's name), as SLOTQ_CONTROLNET_DIR."""
    if model not in MODELS:
        raise ValueError(f"no tiny ControlNets for {model!r}; made for: {', '.join(MODELS)}")
    root = Path(cache_dir) / FOLDER
    final = root / model
    if final.is_dir():
        return root
    unet = UNet2DConditionModel.from_pretrained(ensure_tiny_model(cache_dir, model), subfolder="unet")
    write_once(final, lambda folder: _save_controlnets(folder, unet, model))
    return root


def _save_controlnets(folder: Path, unet: UNet2DConditionModel, model: str) -> None:
    """Write the ControlNets of the model's UNet into the folder, and chalk's weights as one file."""
    for name, seed in CONTROLNETS.items():
        _controlnet(unet, seed).save_pretrained(folder / name, safe_serialization=True)
    weights = _controlnet(unet, CONTROLNETS["chalk"]).state_dict()
    if model == "tiny":
        weights = original_names(weights, unet.config.layers_per_block)
    single = {key: tensor.contiguous() for key, tensor in weights.items()}
    save_file(single, folder / f"{SINGLE_FILE}{SAFE_SUFFIX}")


def _controlnet(unet: UNet2DConditionModel, seed: int) -> ControlNetModel:
    """A ControlNet of the UNet, its zero convolutions seeded and of a visible size."""
    with torch.random.fork_rng():  # from_unet draws its new layers from torch's global generator
        torch.manual_seed(seed)
        controlnet = ControlNetModel.from_unet(unet)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, parameter in controlnet.named_parameters():
            if key.startswith(RESIDUALS):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * GAIN)
            elif key.startswith(EMBEDDING) and key.endswith(".bias"):
                parameter.zero_()
            elif key.startswith(EMBEDDING):
                gain = EMBEDDING_OUT_GAIN if key.startswith(EMBEDDING_OUT) else 1.0
                he = (2 / parameter[0].numel()) ** 0.5  # parameter[0]: one output channel's inputs
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * he * gain)
    return controlnet.eval()


# diffusers' names -> the original ControlNet's, the inverse of diffusers' convert_controlnet_checkpoint:
# a pattern and the original name of what it matched, given its groups and the layers per block.
_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_Rename = Callable[[list[str], int], str]


def _input_block(groups: list[str], per: int) -> int:
    """The original input block of a down block's layer (block 0 is conv_in; each down block has its
    layers, then its downsampler)."""
    return 1 + int(groups[0]) * (per + 1) + int(groups[1])


_RULES: list[tuple[re.Pattern[str], _Rename]] = [(re.compile(pattern), rename) for pattern, rename in [
    (r"time_embedding\.linear_(\d)\.", lambda g, _: f"time_embed.{2 * int(g[0]) - 2}."),
    (r"conv_in\.", lambda g, _: "input_blocks.0.0."),
    (r"controlnet_cond_embedding\.conv_in\.", lambda g, _: "input_hint_block.0."),
    (r"controlnet_cond_embedding\.blocks\.(\d+)\.", lambda g, _: f"input_hint_block.{2 * int(g[0]) + 2}."),
    (r"controlnet_cond_embedding\.conv_out\.", lambda g, _: "input_hint_block.14."),
    (r"down_blocks\.(\d+)\.resnets\.(\d+)\.(\w+)\.",
     lambda g, per: f"input_blocks.{_input_block(g, per)}.0.{_RESNET.get(g[2], g[2])}."),
    (r"down_blocks\.(\d+)\.attentions\.(\d+)\.", lambda g, per: f"input_blocks.{_input_block(g, per)}.1."),
    (r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.",
     lambda g, per: f"input_blocks.{_input_block([g[0], str(per)], per)}.0.op."),
    (r"controlnet_down_blocks\.(\d+)\.", lambda g, _: f"zero_convs.{g[0]}.0."),
    (r"mid_block\.resnets\.(\d+)\.(\w+)\.",
     lambda g, _: f"middle_block.{2 * int(g[0])}.{_RESNET.get(g[1], g[1])}."),
    (r"mid_block\.attentions\.0\.", lambda g, _: "middle_block.1."),
    (r"controlnet_mid_block\.", lambda g, _: "middle_block_out.0."),
]]


def original_names(weights: Tensors, layers_per_block: int) -> Tensors:
    """An SD ControlNet's weights under the original ControlNet's names (``control_model.`` first)."""
    renamed: Tensors = {}
    for key, tensor in weights.items():
        rule = next(((match, rename) for pattern, rename in _RULES if (match := pattern.match(key))), None)
        if rule is None:
            raise ValueError(f"no original name for the ControlNet weight {key}")
        match, rename = rule
        original = rename(list(match.groups()), layers_per_block)
        renamed[f"control_model.{original}{key[match.end():]}"] = tensor
    return renamed
