"""Tiny, randomly initialised diffusion pipelines for tests and offline demos.

Three families, each small enough to run a 256x256 image in well under a second on a CPU:
Stable Diffusion 1.x (``tiny``), SDXL (``tiny-sdxl``) and FLUX.1-dev (``tiny-flux``). Each is
written in diffusers' on-disk format, so the worker loads it with the same
``DiffusionPipeline.from_pretrained`` call it uses for a real checkpoint.  Nothing is
downloaded: the tokenizer vocabularies are generated here and all weights are random but
seeded, so every build on a given machine produces identical files.
"""

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import Unigram
from tokenizers.pre_tokenizers import ByteLevel

# T5TokenizerFast: transformers 5 resolves the name to (tokenizers-backed) T5Tokenizer at runtime only.
from transformers import (  # type: ignore[attr-defined]
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5TokenizerFast,
)

from worker.tiny.files import write_once

# Model name -> folder under the cache. Bump a folder's version when its architecture changes,
# so stale caches are never reused.
TINY_MODELS: dict[str, str] = {
    "tiny": "tiny-sd-v1",
    "tiny-sdxl": "tiny-sdxl-v2",
    "tiny-flux": "tiny-flux-v1",
}

_BOS, _EOS = "<|startoftext|>", "<|endoftext|>"
_MAX_TOKENS = 77
_TEXT_HIDDEN = 32
# SDXL's second encoder is wider than its first, as in SDXL (1280 and 768): diffusers' single-file
# loader tells the two apart by width (worker/tiny/checkpoints.py).
_TEXT_HIDDEN_2 = 48
_T5_MAX_TOKENS = 512  # FluxPipeline's default max_sequence_length
T5_HIDDEN = 32
_TIME_EMBED = 8  # SDXL's addition_time_embed_dim


# --- text encoders ---------------------------------------------------------------------------


def build_tokenizer(folder: Path) -> CLIPTokenizer:
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


def _clip_config(tokenizer: CLIPTokenizer, hidden: int = _TEXT_HIDDEN, **extra: Any) -> CLIPTextConfig:
    """Return a 2-layer CLIP text config sized to the tokenizer."""
    return CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_MAX_TOKENS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **extra,
    )


def _build_text_encoder(tokenizer: CLIPTokenizer) -> CLIPTextModel:
    """Return a 2-layer CLIP text encoder sized to the tokenizer."""
    torch.manual_seed(0)
    return CLIPTextModel(_clip_config(tokenizer)).eval()


def _build_text_encoder_2(tokenizer: CLIPTokenizer) -> CLIPTextModelWithProjection:
    """Return SDXL's second CLIP encoder, whose projected pooled output also conditions the UNet."""
    torch.manual_seed(1)
    config = _clip_config(tokenizer, _TEXT_HIDDEN_2, projection_dim=_TEXT_HIDDEN_2)
    return CLIPTextModelWithProjection(config).eval()


def build_t5_tokenizer() -> T5TokenizerFast:
    """Return a character-level Unigram T5 tokenizer: <pad>=0, </s>=1, <unk>=2, then printable ASCII."""
    # Like SentencePiece, words start with "▁"; with every printable character a piece, ASCII
    # text never hits <unk>. Equal scores make Unigram pick the fewest pieces.
    pieces = ["<pad>", "</s>", "<unk>", "▁", *(chr(c) for c in range(33, 127))]
    backend = Tokenizer(Unigram([(piece, -1.0) for piece in pieces], unk_id=2, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
    ])
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    return T5TokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,  # no <extra_id_N> sentinels: an encoder-only T5 never uses them
        model_max_length=_T5_MAX_TOKENS,
    )


def build_t5_encoder(tokenizer: T5TokenizerFast, model: Callable[[Any], Any] = T5EncoderModel,
                     config_class: Callable[..., Any] = T5Config) -> Any:
    """Return a 2-layer T5 v1.1-style (gated-GELU) encoder sized to the tokenizer (``model`` and its
    ``config_class``: UMT5's for Wan, whose configuration takes the same fields)."""
    torch.manual_seed(0)
    config = config_class(
        vocab_size=len(tokenizer),
        d_model=T5_HIDDEN,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model(config).eval()


# --- denoisers -------------------------------------------------------------------------------


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


def _build_sdxl_unet() -> UNet2DConditionModel:
    """Return the tiny UNet with SDXL's conditioning: both encoders' states and size/crop micro-conditions."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=32,
        in_channels=4,
        out_channels=4,
        block_out_channels=(16, 32),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=_TEXT_HIDDEN + _TEXT_HIDDEN_2,  # the two encoders' hidden states, concatenated
        attention_head_dim=2,
        norm_num_groups=8,
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=_TIME_EMBED,
        # Six size/crop numbers, each embedded, plus the second encoder's pooled projection.
        projection_class_embeddings_input_dim=6 * _TIME_EMBED + _TEXT_HIDDEN_2,
    ).eval()


def _build_flux_transformer() -> FluxTransformer2DModel:
    """Return a one double- plus one single-stream block Flux transformer with guidance embedding."""
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * 16,  # 2x2 patches of the VAE's 16 latent channels
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=T5_HIDDEN,
        pooled_projection_dim=_TEXT_HIDDEN,
        guidance_embeds=True,  # like FLUX.1-dev: guidance_scale is an input, not CFG
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    ).eval()


# --- VAEs and schedulers ---------------------------------------------------------------------


def _build_vae(latent_channels: int = 4, **options: Any) -> AutoencoderKL:
    """Return a VAE with four levels, so it scales by 8 like the real SD/SDXL/Flux VAEs."""
    torch.manual_seed(0)
    return AutoencoderKL(
        # Four channels everywhere: the top level runs at full image resolution.
        block_out_channels=(4, 4, 4, 4),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=64,
        # Mid-block attention runs over every latent pixel; far too slow at 1024x1024.
        mid_block_add_attention=False,
        **options,
    ).eval()


def _build_flux_vae() -> AutoencoderKL:
    """Return the tiny VAE with Flux's 16 latent channels, scale/shift and no quant convs."""
    return _build_vae(
        latent_channels=16,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


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


def _build_flux_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Return FLUX.1-dev's flow-matching scheduler, whose shift grows with the image's size."""
    return FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


# --- pipelines -------------------------------------------------------------------------------


def _build_sd(folder: Path) -> None:
    """Build the tiny Stable Diffusion 1.x pipeline and save it in the empty folder."""
    tokenizer = build_tokenizer(folder / "tokenizer")
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


def _build_sdxl(folder: Path) -> None:
    """Build the tiny SDXL pipeline and save it in the empty folder."""
    tokenizer, tokenizer_2 = build_tokenizer(folder / "tokenizer"), build_tokenizer(folder / "tokenizer_2")
    pipe = StableDiffusionXLPipeline(
        # force_upcast=False: SDXL's img2img/inpaint otherwise cast the VAE to float32 and back to
        # encode each start image, logging two warnings; the tiny VAE has no float16 overflow.
        vae=_build_vae(scaling_factor=0.13025, force_upcast=False),
        text_encoder=_build_text_encoder(tokenizer),
        text_encoder_2=_build_text_encoder_2(tokenizer_2),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        unet=_build_sdxl_unet(),
        scheduler=_build_scheduler(),
        add_watermarker=False,
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def _build_flux(folder: Path) -> None:
    """Build the tiny FLUX.1-dev-style pipeline and save it in the empty folder."""
    tokenizer, tokenizer_2 = build_tokenizer(folder / "tokenizer"), build_t5_tokenizer()
    pipe = FluxPipeline(
        scheduler=_build_flux_scheduler(),
        vae=_build_flux_vae(),
        text_encoder=_build_text_encoder(tokenizer),
        tokenizer=tokenizer,
        text_encoder_2=build_t5_encoder(tokenizer_2),
        tokenizer_2=tokenizer_2,
        transformer=_build_flux_transformer(),
    )
    pipe.save_pretrained(folder, safe_serialization=True)


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "tiny": _build_sd,
    "tiny-sdxl": _build_sdxl,
    "tiny-flux": _build_flux,
}


def ensure_tiny_model(cache_dir: Path, name: str = "tiny") -> Path:
    """Write the named tiny random pipeline (a key of TINY_MODELS) under cache_dir once; return its folder."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(TINY_MODELS)}")
    return write_once(Path(cache_dir) / TINY_MODELS[name], _BUILDERS[name], is_pipeline)


def is_pipeline(folder: Path) -> bool:
    """Whether the folder holds a whole pipeline (save_pretrained writes model_index.json)."""
    return (folder / "model_index.json").is_file()
