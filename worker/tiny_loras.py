"""Tiny LoRA adapters for the tiny SD model, in diffusers' LoRA format, for tests and offline demos.

Each adapter is made with peft on the tiny model's own UNet and written with
``StableDiffusionPipeline.save_lora_weights``, so the worker loads it with the same
``load_lora_weights`` call as a real one. A random tiny UNet barely notices a LoRA of ordinary size,
so these have large, seeded weights: each visibly changes an image, and a build is deterministic.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline, UNet2DConditionModel
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from shared.contract.adapters import SUFFIX
from worker.tiny_model import ensure_tiny_model

log = logging.getLogger(__name__)

FOLDER = "tiny-sd-loras-v1"  # bump when the adapters change
ADAPTERS = {"ink": 1, "neon": 2, "moss": 3}  # name -> seed
RANK = 4
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the attention projections, as LoRA trainers pick them
GAIN = 3.0  # how far from zero the B matrices are drawn: a change a test can see


def ensure_tiny_loras(cache_dir: Path) -> Path:
    """Write the tiny adapters (``ink``, ``neon``, ``moss``) under cache_dir once; return their folder."""
    final = Path(cache_dir) / FOLDER
    if final.is_dir():
        return final
    model = ensure_tiny_model(cache_dir, "tiny")
    tmp = final.with_name(f".{FOLDER}.tmp-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        tmp.mkdir(parents=True)
        for name, seed in ADAPTERS.items():
            _write_adapter(model, tmp, name, seed)
        try:
            os.rename(tmp, final)  # readers see the whole folder or none of it
            log.info("built tiny LoRA adapters at %s", final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_adapter(model: Path, folder: Path, name: str, seed: int) -> None:
    """One adapter for the tiny model's UNet, with seeded weights of a visible size."""
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet")
    unet.add_adapter(LoraConfig(r=RANK, lora_alpha=RANK, target_modules=TARGETS, init_lora_weights=False))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, parameter in unet.named_parameters():
            if "lora_" in key:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * GAIN)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    StableDiffusionPipeline.save_lora_weights(folder, unet_lora_layers=layers,
                                              weight_name=f"{name}{SUFFIX}")
