"""Tiny IP-Adapters for the tiny SD and SDXL models, in SLOTQ_IP_ADAPTER_DIR's layout, for tests and
offline demos.

One folder serves both tiny models (``tiny``, ``tiny-sdxl``; see worker/tiny/model.py): a tiny CLIP image
encoder they share in ``image_encoder/`` (transformers' ``CLIPVisionModelWithProjection``: 2 layers, 32 px
images), and under each model's name ``plume.safetensors`` and ``slate.safetensors``, IP-Adapters in the
original format that diffusers' ``load_ip_adapter`` reads (``image_proj.*``: the projection of the
encoder's image embedding to four tokens; ``ip_adapter.<n>.to_k_ip`` / ``to_v_ip``: the keys and values of
those tokens in each cross-attention layer). h94/IP-Adapter's ``models/`` folder has the same layout.

A trained IP-Adapter starts from zero keys and values and changes nothing; here they get seeded random
weights of a visible size, so each adapter changes an image, follows its reference image, and a build is
deterministic. The image encoder needs no preprocessor configuration: diffusers makes a
``CLIPImageProcessor`` of the encoder's own ``image_size`` for a pipeline that has none.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import UNet2DConditionModel
from safetensors.torch import save_file
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

from shared.contract.checkpoints import SAFE_SUFFIX
from shared.contract.ip_adapters import IMAGE_ENCODER
from worker.tiny.files import write_once
from worker.tiny.model import ensure_tiny_model

FOLDER = "tiny-ip-adapters-v1"  # under the cache; bump its version when the adapters or encoder change
MODELS = ("tiny", "tiny-sdxl")
IP_ADAPTERS = {"plume": 1, "slate": 2}  # name -> seed, the same for every model
ENCODER_SEED = 0
EMBEDDING = 32  # the encoder's projection_dim: what the adapters' image projection takes
TOKENS = 4  # diffusers' ImageProjection: every "proj.weight" adapter makes four image tokens
# The std of the keys' and values' weights: at scale 1 an adapter moves the pixels (in [0, 1]) of a
# 64 px, 2-step image by about 0.1 on average (tests/worker/test_ip_adapters.py); a layer's own
# values are initialised about sqrt(32) times smaller.
GAIN = 1.0
ENCODER = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, projection_dim=EMBEDDING)

Tensors = dict[str, torch.Tensor]


def ensure_tiny_ip_adapters(cache_dir: Path, model: str = "tiny") -> Path:
    """Write the image encoder and the tiny model's IP-Adapters under cache_dir once; return the folder that
    holds them (the model's under its name), as SLOTQ_IP_ADAPTER_DIR."""
    if model not in MODELS:
        raise ValueError(f"no tiny IP-Adapters for {model!r}; made for: {', '.join(MODELS)}")
    root = Path(cache_dir) / FOLDER
    final = root / model
    if final.is_dir():
        return root
    unet = UNet2DConditionModel.from_pretrained(ensure_tiny_model(cache_dir, model), subfolder="unet")
    write_once(root / IMAGE_ENCODER, _save_encoder)  # before any adapter that needs it shows
    write_once(final, lambda folder: _save_adapters(folder, unet))
    return root


def _save_encoder(folder: Path) -> None:
    with torch.random.fork_rng():  # transformers draws the initial weights from torch's global generator
        torch.manual_seed(ENCODER_SEED)
        encoder = CLIPVisionModelWithProjection(ENCODER).eval()
    encoder.save_pretrained(folder, safe_serialization=True)


def _save_adapters(folder: Path, unet: UNet2DConditionModel) -> None:
    for name, seed in IP_ADAPTERS.items():
        save_file(ip_adapter_weights(unet, seed), folder / f"{name}{SAFE_SUFFIX}")


def ip_adapter_weights(unet: UNet2DConditionModel, seed: int) -> Tensors:
    """Seeded weights of an IP-Adapter for this UNet, under the original format's names."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * std).contiguous()

    width = unet.config.cross_attention_dim  # the image tokens' width: that of the text's
    weights: Tensors = {
        "image_proj.proj.weight": normal(TOKENS * width, EMBEDDING, std=EMBEDDING ** -0.5),
        "image_proj.proj.bias": torch.zeros(TOKENS * width),
        "image_proj.norm.weight": torch.ones(width),
        "image_proj.norm.bias": torch.zeros(width),
    }
    # The numbers diffusers reads (its _convert_ip_adapter_attn_to_diffusers): the cross-attention layers
    # in the UNet's order, 1, 3, 5...: the original counted the self-attention layers between them.
    crossing = [name for name in unet.attn_processors if name.endswith("attn2.processor")]
    for number, name in zip(range(1, 2 * len(crossing), 2), crossing, strict=True):
        attention = unet.get_submodule(name.removesuffix(".processor"))
        hidden, width = attention.to_k.out_features, attention.to_k.in_features
        weights[f"ip_adapter.{number}.to_k_ip.weight"] = normal(hidden, width, std=width ** -0.5)
        weights[f"ip_adapter.{number}.to_v_ip.weight"] = normal(hidden, width, std=GAIN)
    return weights
