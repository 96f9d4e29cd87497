"""Tiny LoRA adapters for each tiny model, in diffusers' LoRA format, for tests and offline demos.

Every tiny model (``tiny``, ``tiny-sdxl``, ``tiny-flux``, ``tiny-wan``, ``tiny-wan-i2v``,
``tiny-ltx``; see worker/tiny/model.py and worker/tiny/video.py) gets the same three adapters,
``ink``, ``neon`` and ``moss``, in a folder of its own. Each is made with peft on that model's own
denoiser (the UNet of SD and SDXL, the attention projections of the Flux, Wan and LTX-Video
transformers) and written with its pipeline's ``save_lora_weights``, so the worker loads it with the
same ``load_lora_weights`` call as a real one. A random tiny denoiser barely notices a LoRA of
ordinary size, so these have large, seeded weights: each visibly changes an image, and a build is
deterministic.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import (
    FluxPipeline,
    FluxTransformer2DModel,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
    WanPipeline,
    WanTransformer3DModel,
)
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from shared.contract.adapters import SUFFIX
from worker.tiny.files import write_once
from worker.tiny.model import ensure_tiny_model
from worker.tiny.video import TINY_VIDEO_MODELS, ensure_tiny_video_model

ADAPTERS = {"ink": 1, "neon": 2, "moss": 3}  # name -> seed, the same for every model
RANK = 4
# The attention projections, as LoRA trainers pick them; peft matches each as a module-name suffix.
UNET_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
# Flux's double-stream blocks also project the text stream (add_*, to_add_out); its single-stream
# blocks have only to_q/to_k/to_v.
FLUX_TARGETS = (*UNET_TARGETS, "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

Layers = dict[str, torch.Tensor]


def _save_sd(folder: Path, layers: Layers, weight_name: str) -> None:
    """Write SD UNet layers (peft's keys) in diffusers' format."""
    unet = convert_state_dict_to_diffusers(layers)
    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=unet, weight_name=weight_name)


def _save_sdxl(folder: Path, layers: Layers, weight_name: str) -> None:
    """Write SDXL UNet layers (peft's keys) in diffusers' format."""
    unet = convert_state_dict_to_diffusers(layers)
    StableDiffusionXLPipeline.save_lora_weights(folder, unet_lora_layers=unet, weight_name=weight_name)


def _save_flux(folder: Path, layers: Layers, weight_name: str) -> None:
    """Write Flux transformer layers; Flux's loader reads peft's keys as they are."""
    FluxPipeline.save_lora_weights(folder, transformer_lora_layers=layers, weight_name=weight_name)


def _save_wan(folder: Path, layers: Layers, weight_name: str) -> None:
    """Write Wan transformer layers; its loader reads peft's keys as they are."""
    WanPipeline.save_lora_weights(folder, transformer_lora_layers=layers, weight_name=weight_name)


def _save_ltx(folder: Path, layers: Layers, weight_name: str) -> None:
    """Write LTX-Video transformer layers; its loader reads peft's keys as they are."""
    LTXPipeline.save_lora_weights(folder, transformer_lora_layers=layers, weight_name=weight_name)


Denoiser = (type[UNet2DConditionModel] | type[FluxTransformer2DModel] | type[WanTransformer3DModel]
            | type[LTXVideoTransformer3DModel])


@dataclass(frozen=True)
class _Recipe:
    """How one tiny model's adapters are made: their folder, the module they adapt, their size, the writer."""

    folder: str  # under the cache; bump its version when the adapters change
    denoiser: Denoiser
    subfolder: str
    targets: tuple[str, ...]
    gain: float  # the std of every A and B entry: a change a test can see, short of a blown-up image
    save: Callable[[Path, Layers, str], None]


# Each family's gain: large enough that an adapter at scale 1 visibly moves a random model's image and
# scale 0.5 gives an image of its own (tests/worker/test_tiny_loras.py checks both), small enough not to
# saturate the attention, past which half a scale looks like a whole one; SD keeps the gain its
# adapters were first built with. The tiny Wan's random VAE makes nearly flat clips (two seeds differ by
# about 0.003 a pixel): its adapters move a clip as much as a new seed does.
RECIPES: dict[str, _Recipe] = {
    "tiny": _Recipe("tiny-sd-loras-v1", UNet2DConditionModel, "unet", UNET_TARGETS, 3.0, _save_sd),
    "tiny-sdxl": _Recipe("tiny-sdxl-loras-v2", UNet2DConditionModel, "unet", UNET_TARGETS, 1.0, _save_sdxl),
    "tiny-flux": _Recipe("tiny-flux-loras-v1", FluxTransformer2DModel, "transformer", FLUX_TARGETS, 0.7,
                         _save_flux),
    # Self- and cross-attention of every block (attn1, attn2), as video LoRA trainers target them.
    "tiny-wan": _Recipe("tiny-wan-loras-v1", WanTransformer3DModel, "transformer", UNET_TARGETS, 1.0,
                        _save_wan),
    "tiny-wan-i2v": _Recipe("tiny-wan-i2v-loras-v1", WanTransformer3DModel, "transformer", UNET_TARGETS,
                            0.3, _save_wan),
    "tiny-ltx": _Recipe("tiny-ltx-loras-v1", LTXVideoTransformer3DModel, "transformer", UNET_TARGETS, 0.3,
                        _save_ltx),
}


def ensure_tiny_loras(cache_dir: Path, model: str = "tiny") -> Path:
    """Write the named tiny model's adapters (ink, neon, moss) under cache_dir once; return their folder."""
    if model not in RECIPES:
        raise ValueError(f"unknown tiny model {model!r}; known: {', '.join(RECIPES)}")
    recipe = RECIPES[model]
    final = Path(cache_dir) / recipe.folder
    if final.is_dir():
        return final
    ensure = ensure_tiny_video_model if model in TINY_VIDEO_MODELS else ensure_tiny_model
    weights = ensure(cache_dir, model)
    return write_once(final, lambda folder: _save_adapters(folder, recipe, weights))


def _save_adapters(folder: Path, recipe: _Recipe, weights: Path) -> None:
    """Write the adapters (ink, neon, moss) of the tiny model whose weights are there into the folder."""
    for name, seed in ADAPTERS.items():
        recipe.save(folder, _lora_layers(recipe, weights, seed), f"{name}{SUFFIX}")


def _lora_layers(recipe: _Recipe, weights: Path, seed: int) -> Layers:
    """One adapter's layers (peft's keys) on the tiny model's denoiser, seeded and of a visible size."""
    denoiser = recipe.denoiser.from_pretrained(weights, subfolder=recipe.subfolder)
    denoiser.add_adapter(LoraConfig(r=RANK, lora_alpha=RANK, target_modules=list(recipe.targets),
                                    init_lora_weights=False))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, parameter in denoiser.named_parameters():
            if "lora_" in key:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * recipe.gain)
    return get_peft_model_state_dict(denoiser)
