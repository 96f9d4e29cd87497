"""Tiny, randomly initialised video pipelines for tests and offline demos.

Three models, each small enough to make a 9-frame 64x64 clip in well under a second on a CPU:
Wan 2.1 (``tiny-wan``), Wan 2.1 image-to-video (``tiny-wan-i2v``) and LTX-Video (``tiny-ltx``).
Like the image models in worker/tiny/model.py, each is written in diffusers' on-disk format, so it
loads with the same ``DiffusionPipeline.from_pretrained`` call as a real checkpoint. Nothing is
downloaded: the tokenizer is worker/tiny/model.py's generated T5 one and all weights are random but
seeded, so every build on a given machine produces identical files. Each VAE compresses like the
real one (Wan: 8x in space and 4x in time, LTX: 32x and 8x), so a clip takes the sizes the real
model takes: Wan 4k+1 frames with sides a multiple of 16, LTX 8k+1 frames with sides a multiple of 32.
"""

from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import (
    AutoencoderKLLTXVideo,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    LTXPipeline,
    LTXVideoTransformer3DModel,
    WanImageToVideoPipeline,
    WanPipeline,
    WanTransformer3DModel,
)
from transformers import (
    CLIPImageProcessor,
    CLIPVisionConfig,
    CLIPVisionModel,
    UMT5Config,
    UMT5EncoderModel,
)

from worker.tiny.files import write_once
from worker.tiny.model import T5_HIDDEN, build_t5_encoder, build_t5_tokenizer, is_pipeline

# Model name -> folder under the cache. Bump a folder's version when its architecture changes,
# so stale caches are never reused.
TINY_VIDEO_MODELS: dict[str, str] = {
    "tiny-wan": "tiny-wan-v2",
    "tiny-wan-i2v": "tiny-wan-i2v-v2",
    "tiny-ltx": "tiny-ltx-v1",
}

_LATENT_CHANNELS_WAN = 16  # AutoencoderKLWan's z_dim, as in Wan 2.1
_LATENT_CHANNELS_LTX = 8
# Wan 2.1's image-to-video encoder is CLIP ViT-H (1280 wide, 224 px); this one is 32 wide and 32 px.
_WAN_IMAGE_ENCODER = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, image_size=32, patch_size=4)


# --- denoisers -------------------------------------------------------------------------------


def _build_wan_transformer(image_dim: int | None = None) -> WanTransformer3DModel:
    """Return a 2-block Wan transformer, sized as in diffusers' own Wan pipeline tests. With
    ``image_dim``, Wan 2.1's image-to-video one: it also reads the start image's latents, their mask
    (one channel a frame of the VAE's 4) and the image encoder's embeddings, with attention weights of
    their own."""
    torch.manual_seed(0)
    image_channels = _LATENT_CHANNELS_WAN + 4 if image_dim else 0
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),  # with the VAE's 8x, sides are multiples of 16
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=_LATENT_CHANNELS_WAN + image_channels,
        out_channels=_LATENT_CHANNELS_WAN,
        image_dim=image_dim,
        # Wan 2.1's image-to-video blocks attend to the image's tokens with keys and values of their own
        # (k_img, v_img in its files), as wide as the attention.
        added_kv_proj_dim=2 * 12 if image_dim else None,
        text_dim=T5_HIDDEN,
        freq_dim=256,
        ffn_dim=32,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=1024,  # as Wan 2.1's: clips of up to 257 frames, sides of up to 1024
    ).eval()


def _build_ltx_transformer() -> LTXVideoTransformer3DModel:
    """Return a 1-block LTX-Video transformer, sized as in diffusers' own LTX pipeline tests."""
    torch.manual_seed(0)
    return LTXVideoTransformer3DModel(
        in_channels=_LATENT_CHANNELS_LTX,
        out_channels=_LATENT_CHANNELS_LTX,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=4,
        attention_head_dim=8,
        cross_attention_dim=32,
        num_layers=1,
        caption_channels=T5_HIDDEN,
    ).eval()


# --- VAEs and schedulers ---------------------------------------------------------------------


def _build_wan_vae(gain: float = 1.0) -> AutoencoderKLWan:
    """Return a 3-channel Wan VAE that scales like Wan 2.1's: 8x in space, 4x in time. A ``gain``
    multiplies its encoder's and decoder's last layers: random, they make nearly flat latents and
    frames, in which a start image would change a clip by a fraction of a pixel level."""
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=_LATENT_CHANNELS_WAN,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
    ).eval()
    with torch.no_grad():
        for layer in (vae.encoder.conv_out, vae.decoder.conv_out):
            layer.weight.mul_(gain)
            layer.bias.mul_(gain)
    return vae


def _build_ltx_vae() -> AutoencoderKLLTXVideo:
    """Return an 8-channel LTX VAE that scales like LTX-Video's: 32x in space, 8x in time."""
    torch.manual_seed(0)
    # diffusers' LTX tests use these sizes with patch_size=1 and two scaling levels (4x, 4x);
    # LTX-Video's patch_size=4 and three levels make it 4 * 2**3 = 32x in space, 2**3 = 8x in time.
    return AutoencoderKLLTXVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=_LATENT_CHANNELS_LTX,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True, False),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1),
        timestep_conditioning=False,
        patch_size=4,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    ).eval()


def _build_wan_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Return a flow-matching Euler scheduler with Wan 2.1's 480p shift."""
    # Wan's own checkpoints ship UniPC in flow mode (a multistep solver); Euler is the type
    # WanPipeline declares, what diffusers' Wan tests use, and runs exactly one transformer pass
    # per step with no solver history, so 1-2 step test runs denoise predictably. shift=3.0 is
    # Wan 2.1's flow_shift for 480p (5.0 is for 720p); the tiny clips are smaller still.
    return FlowMatchEulerDiscreteScheduler(shift=3.0)


def _build_ltx_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Return LTX-Video's flow-matching scheduler, whose shift grows with the clip's latent size."""
    return FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )


# --- pipelines -------------------------------------------------------------------------------


def _build_wan(folder: Path) -> None:
    """Build the tiny Wan 2.1 text-to-video pipeline and save it in the empty folder."""
    tokenizer = build_t5_tokenizer()
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=build_t5_encoder(tokenizer, UMT5EncoderModel, UMT5Config),
        vae=_build_wan_vae(),
        scheduler=_build_wan_scheduler(),
        transformer=_build_wan_transformer(),
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def _build_wan_i2v(folder: Path) -> None:
    """Build the tiny Wan 2.1 image-to-video pipeline (its CLIP image encoder too) and save it in the
    empty folder."""
    tokenizer = build_t5_tokenizer()
    torch.manual_seed(0)
    encoder = CLIPVisionModel(_WAN_IMAGE_ENCODER).eval()
    pipe = WanImageToVideoPipeline(
        tokenizer=tokenizer,
        text_encoder=build_t5_encoder(tokenizer, UMT5EncoderModel, UMT5Config),
        vae=_build_wan_vae(gain=10.0),  # a start image then moves its clip by about 3 levels of 255
        scheduler=_build_wan_scheduler(),
        image_encoder=encoder,
        image_processor=CLIPImageProcessor(crop_size=_WAN_IMAGE_ENCODER.image_size,
                                           size=_WAN_IMAGE_ENCODER.image_size),
        transformer=_build_wan_transformer(image_dim=_WAN_IMAGE_ENCODER.hidden_size),
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def _build_ltx(folder: Path) -> None:
    """Build the tiny LTX-Video text-to-video pipeline and save it in the empty folder."""
    tokenizer = build_t5_tokenizer()
    pipe = LTXPipeline(
        scheduler=_build_ltx_scheduler(),
        vae=_build_ltx_vae(),
        text_encoder=build_t5_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=_build_ltx_transformer(),
    )
    pipe.save_pretrained(folder, safe_serialization=True)


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "tiny-wan": _build_wan,
    "tiny-wan-i2v": _build_wan_i2v,
    "tiny-ltx": _build_ltx,
}


def ensure_tiny_video_model(cache_dir: Path, name: str) -> Path:
    """Write the named tiny random video pipeline (a key of TINY_VIDEO_MODELS) under cache_dir once;
    return its folder."""
    if name not in TINY_VIDEO_MODELS:
        raise ValueError(f"unknown tiny video model {name!r}; known: {', '.join(TINY_VIDEO_MODELS)}")
    return write_once(Path(cache_dir) / TINY_VIDEO_MODELS[name], _BUILDERS[name], is_pipeline)
