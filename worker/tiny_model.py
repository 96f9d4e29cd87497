"""Tiny, randomly initialised Stable Diffusion pipeline for tests and offline demos.

The pipeline is written in diffusers' on-disk format, so the worker loads it with the
same ``DiffusionPipeline.from_pretrained`` call it uses for a real checkpoint.  Nothing
is downloaded: the tokenizer vocabulary is generated here and all weights are random
but seeded, so every build on a given machine produces identical files.
"""

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    StableDiffusionPipeline,
    UNet2DConditionModel,
)
from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

logger = logging.getLogger(__name__)

# Bump when the architecture changes so stale caches are never reused.
TINY_MODEL_NAME = "tiny-sd-v1"

_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"
_MAX_TOKENS = 77
_TEXT_HIDDEN = 32


def _build_tokenizer(folder: Path) -> CLIPTokenizer:
    """Write a byte-level vocab with no merges and load a CLIP tokenizer from it."""
    # CLIP pre-tokenizes to these 256 byte stand-ins; with every one present both mid-word
    # and word-final ("</w>"), any text tokenizes without <unk> and no merges are needed.
    chars = sorted(ByteLevel.alphabet())
    tokens = [*chars, *(c + "</w>" for c in chars), _BOS, _EOS]
    folder.mkdir()
    vocab = {tok: i for i, tok in enumerate(tokens)}
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), "utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", "utf-8")
    return CLIPTokenizer.from_pretrained(folder, model_max_length=_MAX_TOKENS)


def _build_text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModel:
    """Return a 2-layer CLIP text encoder sized to the tokenizer."""
    torch.manual_seed(0)
    config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_MAX_TOKENS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config).eval()


def _build_unet() -> UNet2DConditionModel:
    """Return a two-level UNet whose attention only runs at half latent resolution."""
    torch.manual_seed(0)
    # Self-attention is quadratic in latent pixels (16k tokens at 1024x1024), so the
    # full-resolution level has none, and few wide heads run far faster on CPU than many
    # narrow ones. diffusers reads attention_head_dim as the head *count* here.
    return UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=_TEXT_HIDDEN,
        attention_head_dim=2,
        norm_num_groups=8,
    ).eval()


def _build_vae() -> AutoencoderKL:
    """Return a VAE with four levels, so it scales by 8 like the real SD VAE."""
    torch.manual_seed(0)
    return AutoencoderKL(
        # Four channels everywhere: the top level runs at full image resolution.
        block_out_channels=(4, 4, 4, 4),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=64,
        # Mid-block attention runs over every latent pixel; far too slow at 1024x1024.
        mid_block_add_attention=False,
    ).eval()


def _build_scheduler() -> DDIMScheduler:
    """Return a DDIM scheduler with SD's noise schedule (deterministic at eta=0)."""
    # DDIM runs exactly one UNet pass per step (PNDM adds one), and unlike Euler/DPM it
    # raises no numpy DeprecationWarning in set_timesteps. "trailing" starts at t=999 so
    # 1-4 step runs still denoise; steps_offset/clip_sample avoid FutureWarnings on init.
    return DDIMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        timestep_spacing="trailing",
        steps_offset=1,
        clip_sample=False,
        set_alpha_to_one=False,
    )


def _build_pipeline(folder: Path) -> None:
    """Build the tiny pipeline and save it under folder."""
    folder.mkdir()
    tokenizer = _build_tokenizer(folder / "tokenizer")
    pipe = StableDiffusionPipeline(
        vae=_build_vae(),
        text_encoder=_build_text_encoder(tokenizer),
        tokenizer=tokenizer,
        unet=_build_unet(),
        scheduler=_build_scheduler(),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def ensure_tiny_model(cache_dir: Path) -> Path:
    """Write the tiny random text-to-image pipeline under cache_dir once; return its folder."""
    final = Path(cache_dir) / TINY_MODEL_NAME
    if (final / "model_index.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private sibling so readers only ever see a complete folder (rename is atomic
    # within one filesystem) and concurrent builders never write into each other's files.
    tmp = final.with_name(f".{TINY_MODEL_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex}")
    try:
        _build_pipeline(tmp)
        try:
            os.rename(tmp, final)
            logger.info("built tiny model at %s", final)
        except OSError:
            # Another process won the race; its folder is complete, so use it.
            if not (final / "model_index.json").is_file():
                raise
            logger.debug("tiny model already built at %s by another process", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
