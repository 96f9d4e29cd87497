"""Full-size timings without downloads: SD 1.5, SDXL and Flux.1-dev built from their published configs.

    python -m bench.fullsize [--device auto] [--dtype auto] [--families sd,sdxl,flux] [--repeat 3]
                             [--ways eager,fast,batch,full,regional] [--batch-families sd] [--tiny]
                             [--json FILE]

Each family's pipeline is built from the configurations its model repository publishes (written
below as dicts: the denoiser, the VAE, the text encoders, the scheduler) with random weights, made
in the chosen dtype directly on the device: nothing is downloaded and no checkpoint is read, and a
step computes what the real model's does. The tokenizers are worker/tiny/model.py's, made here; their
ids stay below the full vocabularies, and prompts are padded to the real lengths (77 tokens for CLIP,
512 for T5), so the text encoders do their full work too.

Each family runs one job at its usual size and steps (SD 1.5 512x512, 50 steps; SDXL 1024x1024, 30;
Flux 1024x1024, 28), timed two ways in turn, each way's warm-up call excluded, the median of
``--repeat`` calls, the device synchronized before and after each:

- **bare**: ``pipe(...)`` called directly, as a diffusers user would;
- **worker**: ``ImagePipeline.generate_batch`` around the same pipe, as worker/pipeline.py builds it
  (its generators, step callback, NaN check and conversion to PIL images included);

each **eager**; **compiled** by worker/compile.py (``full`` and ``regional``, each on a freshly built
pipe); in the **fast tier** (worker/caching.py's step caching); and as a **batch of 4** images for
the families in ``--batch-families`` (by default SD 1.5 alone: its 512x512 image is the smallest
execution of the three, where a batch has the most room to pay; a batch of four 1024x1024 SDXL or
Flux images would take most of a lease).
A row that cannot run (out of memory, a module not there yet, an error) says why and the run goes on.

The published figures (``ANCHORS``) are printed under each family's rows, with ours ÷ theirs where
the device is the same kind of card. ``--tiny`` is the suite's smoke test on the CPU: small configs of
the same shapes, 64x64, 2 steps, no compiling unless ``--ways`` names it; its figures mean little.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import diffusers
import torch
import transformers
from diffusers import (
    AutoencoderKL,
    DiffusionPipeline,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    PNDMScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from bench.stats import median
from shared.contract.jobs import JobRequest
from shared.contract.memory import MemoryOptions
from shared.contract.models import TINY_MODELS, Family, model_info
from worker import memory
from worker.adapters import Adapters
from worker.pipeline import DTYPES, ImagePipeline, resolve_device
from worker.previews import Previewer
from worker.samplers import Samplers

# The tiny models' tokenizers, built locally: a byte-level CLIP vocabulary and a character-level T5 one.
from worker.tiny.model import build_t5_tokenizer, build_tokenizer

# --- the published figures, printed beside ours -----------------------------------------------


@dataclass(frozen=True)
class Anchor:
    """A published time for one image of a family's usual job on one card: eager and tuned, each as run."""

    card: str
    eager_s: float
    eager: str
    tuned_s: float
    tuned: str
    source: str


ANCHORS: dict[str, tuple[Anchor, ...]] = {
    "sd": (Anchor("H100 PCIe", 1.44, "", 1.11, "compiled", "alexeigor/sd-benchmarks"),),
    "sdxl": (Anchor("H100", 2.50, "", 1.47, "TensorRT", "stabilityai/stable-diffusion-xl-1.0-tensorrt"),
             Anchor("A100", 3.31, "bf16 + SDPA", 2.54, "torch.compile, channels_last",
                    "diffusers' \"accelerate inference\" tutorial")),
    "flux": (Anchor("H100", 6.7, "bf16", 4.5, "compiled; about 2.7 s fully tuned",
                    "PyTorch's compile devlog; huggingface/flux-fast"),),
}

# --- the published configurations (each repository's config.json), and tiny ones of the same shape ---

# stable-diffusion-v1-5/stable-diffusion-v1-5, unet/config.json
SD15_UNET: dict[str, Any] = {
    "sample_size": 64, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": (320, 640, 1280, 1280),
    "down_block_types": ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    "up_block_types": ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    "cross_attention_dim": 768, "attention_head_dim": 8, "norm_num_groups": 32, "norm_eps": 1e-5,
    "act_fn": "silu", "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0,
    "center_input_sample": False, "mid_block_scale_factor": 1,
}
# its vae/config.json (SDXL's and Flux's VAEs are this one with the options below)
SD15_VAE: dict[str, Any] = {
    "in_channels": 3, "out_channels": 3, "latent_channels": 4, "layers_per_block": 2,
    "block_out_channels": (128, 256, 512, 512), "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4, "norm_num_groups": 32, "act_fn": "silu", "sample_size": 512,
}
# openai/clip-vit-large-patch14's text model: SD 1.5's text_encoder, SDXL's and Flux's first one
CLIP_L: dict[str, Any] = {
    "vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
    "projection_dim": 768, "layer_norm_eps": 1e-5,
}
SD15_SCHEDULER: dict[str, Any] = {  # scheduler/scheduler_config.json (PNDM)
    "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
    "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
}
# stabilityai/stable-diffusion-xl-base-1.0, unet/config.json
SDXL_UNET: dict[str, Any] = {
    "sample_size": 128, "in_channels": 4, "out_channels": 4, "layers_per_block": 2,
    "block_out_channels": (320, 640, 1280),
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    "transformer_layers_per_block": (1, 2, 10), "attention_head_dim": (5, 10, 20),
    "cross_attention_dim": 2048, "use_linear_projection": True, "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256, "projection_class_embeddings_input_dim": 2816,
    "norm_num_groups": 32, "norm_eps": 1e-5, "act_fn": "silu", "flip_sin_to_cos": True, "freq_shift": 0,
}
SDXL_VAE: dict[str, Any] = SD15_VAE | {"sample_size": 1024, "scaling_factor": 0.13025, "force_upcast": True}
# laion's OpenCLIP ViT-bigG text model: SDXL's text_encoder_2/config.json
CLIP_G: dict[str, Any] = {
    "vocab_size": 49408, "hidden_size": 1280, "intermediate_size": 5120, "num_hidden_layers": 32,
    "num_attention_heads": 20, "max_position_embeddings": 77, "hidden_act": "gelu",
    "projection_dim": 1280, "layer_norm_eps": 1e-5,
}
SDXL_SCHEDULER: dict[str, Any] = {  # scheduler/scheduler_config.json (Euler)
    "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
    "interpolation_type": "linear", "prediction_type": "epsilon", "steps_offset": 1,
    "timestep_spacing": "leading", "use_karras_sigmas": False,
}
# black-forest-labs/FLUX.1-dev, transformer/config.json
FLUX_TRANSFORMER: dict[str, Any] = {
    "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
    "guidance_embeds": True, "axes_dims_rope": (16, 56, 56),
}
FLUX_VAE: dict[str, Any] = SD15_VAE | {
    "latent_channels": 16, "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
    "use_quant_conv": False, "use_post_quant_conv": False, "force_upcast": True,
}
# google/t5-v1_1-xxl's encoder: FLUX.1-dev's text_encoder_2/config.json
T5_XXL: dict[str, Any] = {
    "vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24, "num_heads": 64,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu", "layer_norm_epsilon": 1e-6, "tie_word_embeddings": False,
}
FLUX_SCHEDULER: dict[str, Any] = {  # scheduler/scheduler_config.json (flow matching)
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
    "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096,
}

# The tiny configs: each published one with these changes, small enough for a CPU at 64x64. The widths
# that connect two models follow the encoders': SDXL's UNet reads both CLIPs' states (32 + 48) and
# six time embeddings of 8 plus the bigger CLIP's projection; Flux's transformer reads T5's states
# and the first CLIP's pooled output.
TINY: dict[str, dict[str, Any]] = {
    "sd_unet": {"block_out_channels": (32, 64), "layers_per_block": 1, "norm_num_groups": 8,
                "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
                "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"), "cross_attention_dim": 32,
                "attention_head_dim": 4, "sample_size": 8},
    "vae": {"block_out_channels": (8, 8, 8, 8), "layers_per_block": 1, "norm_num_groups": 4},
    "clip_l": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
               "projection_dim": 32},
    "sdxl_unet": {"block_out_channels": (32, 64), "layers_per_block": 1, "norm_num_groups": 8,
                  "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
                  "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"), "attention_head_dim": (2, 4),
                  "transformer_layers_per_block": (1, 2), "cross_attention_dim": 32 + 48,
                  "addition_time_embed_dim": 8,
                  "projection_class_embeddings_input_dim": 6 * 8 + 48, "sample_size": 8},
    "clip_g": {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
               "projection_dim": 48},
    "flux_transformer": {"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                         "num_attention_heads": 2, "joint_attention_dim": 32, "pooled_projection_dim": 32,
                         "axes_dims_rope": (4, 6, 6)},
    "t5": {"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2, "num_heads": 4,
           "relative_attention_num_buckets": 8},
}

PROMPT = "a lighthouse on a cliff at dusk, oil painting, dramatic light"
TINY_SIDE, TINY_STEPS = 64, 2
BATCH = 4
WAYS = {"eager": "eager", "fast": "fast tier", "batch": f"batch of {BATCH}, eager", "full": "compiled, full",
        "regional": "compiled, regional"}
COMPILED = ("full", "regional")
Tier = Callable[[], AbstractContextManager[object]]  # a context to enter around each call (or none)


# --- building ---------------------------------------------------------------------------------


@contextmanager
def made_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """Every tensor made inside on ``device``, every floating one in ``dtype``: the modules' own
    initialisation runs on the device that will run them, and a 12 B transformer never passes through
    host memory or full precision. (The meta device and ``to_empty`` would skip initialising, but leave
    buffers such as CLIP's position ids unset, and drawing the random weights is most of the cost.)"""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def config(published: dict[str, Any], tiny_part: str, tiny: bool) -> dict[str, Any]:
    return published | TINY[tiny_part] if tiny else published


def clip_config(published: dict[str, Any], tiny_part: str, tiny: bool, tokenizer: Any) -> CLIPTextConfig:
    """A CLIP text config whose special tokens are the local tokenizer's (its pooled output is read at
    the end-of-text token)."""
    return CLIPTextConfig(**config(published, tiny_part, tiny), bos_token_id=tokenizer.bos_token_id,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def clip_tokenizer() -> Any:
    """worker/tiny/model.py's CLIP tokenizer (written to a folder, read back, the folder dropped)."""
    with tempfile.TemporaryDirectory(prefix="slotq-fullsize-") as folder:
        return build_tokenizer(Path(folder) / "tokenizer")


def build_sd(tiny: bool, device: torch.device, dtype: torch.dtype) -> DiffusionPipeline:
    tokenizer = clip_tokenizer()
    with made_on(device, dtype):
        vae = AutoencoderKL(**config(SD15_VAE, "vae", tiny))
        text_encoder = CLIPTextModel(clip_config(CLIP_L, "clip_l", tiny, tokenizer))
        unet = UNet2DConditionModel(**config(SD15_UNET, "sd_unet", tiny))
    return StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                                   scheduler=PNDMScheduler(**SD15_SCHEDULER), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)


def build_sdxl(tiny: bool, device: torch.device, dtype: torch.dtype) -> DiffusionPipeline:
    tokenizer, tokenizer_2 = clip_tokenizer(), clip_tokenizer()
    with made_on(device, dtype):
        vae = AutoencoderKL(**config(SDXL_VAE, "vae", tiny))
        text_encoder = CLIPTextModel(clip_config(CLIP_L, "clip_l", tiny, tokenizer))
        text_encoder_2 = CLIPTextModelWithProjection(clip_config(CLIP_G, "clip_g", tiny, tokenizer_2))
        unet = UNet2DConditionModel(**config(SDXL_UNET, "sdxl_unet", tiny))
    return StableDiffusionXLPipeline(vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2,
                                     tokenizer=tokenizer, tokenizer_2=tokenizer_2, unet=unet,
                                     scheduler=EulerDiscreteScheduler(**SDXL_SCHEDULER),
                                     add_watermarker=False)


def build_flux(tiny: bool, device: torch.device, dtype: torch.dtype) -> DiffusionPipeline:
    tokenizer, tokenizer_2 = clip_tokenizer(), build_t5_tokenizer()
    with made_on(device, dtype):
        vae = AutoencoderKL(**config(FLUX_VAE, "vae", tiny))
        text_encoder = CLIPTextModel(clip_config(CLIP_L, "clip_l", tiny, tokenizer))
        # pad 0 and end 1: the local tokenizer's, as they are the real T5's
        t5 = T5Config(**config(T5_XXL, "t5", tiny), pad_token_id=0, eos_token_id=1)
        text_encoder_2 = T5EncoderModel(t5)
        transformer = FluxTransformer2DModel(**config(FLUX_TRANSFORMER, "flux_transformer", tiny))
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER), vae=vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, text_encoder_2=text_encoder_2,
                        tokenizer_2=tokenizer_2, transformer=transformer)


@dataclass(frozen=True)
class Model:
    """A family as it is timed: its title, its usual job, and how its pipeline is built."""

    family: Family
    title: str
    side: int
    steps: int
    build: Callable[[bool, torch.device, torch.dtype], DiffusionPipeline]

    @property
    def guidance(self) -> float:
        """The family's default guidance, as the service gives it (CFG 7.5 and 5; Flux's distilled 3.5)."""
        return model_info(self.family, self.family).defaults.guidance_scale


MODELS: dict[str, Model] = {model.family: model for model in (
    Model("sd", "SD 1.5", 512, 50, build_sd),
    Model("sdxl", "SDXL", 1024, 30, build_sdxl),
    Model("flux", "Flux.1-dev", 1024, 28, build_flux),
)}


@dataclass
class Built:
    """A pipeline on its device, with what building it took."""

    pipe: DiffusionPipeline
    seconds: float
    parameters: int
    bytes: int


def build(model: Model, tiny: bool, device: torch.device, dtype: torch.dtype) -> Built:
    """The family's pipeline with random weights, in inference mode, placed as the worker places one."""
    synchronize(device)
    began = time.perf_counter()
    pipe = model.build(tiny, device, dtype)
    modules = [part for part in pipe.components.values() if isinstance(part, torch.nn.Module)]
    for module in modules:
        module.eval().requires_grad_(False)  # from_pretrained's state: T5's dropout off
    memory.place(pipe, device, MemoryOptions())
    pipe.set_progress_bar_config(disable=True)
    synchronize(device)
    weights = [tensor for module in modules for tensor in module.parameters()]
    return Built(pipe, time.perf_counter() - began, sum(t.numel() for t in weights),
                 sum(t.numel() * t.element_size() for t in weights))


def freed(device: torch.device) -> None:
    """Give the memory of dropped pipelines and compiled graphs back before the next is built."""
    gc.collect()
    torch.compiler.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# --- timing -----------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(call: Callable[[], object], device: torch.device) -> float:
    """One call's wall time, the device's queued work done before and after."""
    synchronize(device)
    began = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - began


@dataclass
class Row:
    """One way's figures: seconds of each timed call, bare and through the worker, and of each warm-up."""

    way: str
    images: int = 1
    bare_s: list[float] = field(default_factory=list)
    worker_s: list[float] = field(default_factory=list)
    warm_up_s: list[float] = field(default_factory=list)  # bare's, then the worker's (compiling lands here)
    note: str = ""  # why there are no figures

    def line(self) -> str:
        if self.note or not self.bare_s:
            return f"{WAYS[self.way]:22}{self.note}"
        bare, worker_ = median(self.bare_s), median(self.worker_s)
        warm = "/".join(f"{value:.2f}" for value in self.warm_up_s)
        return (f"{WAYS[self.way]:22}{bare:>9.3f}{worker_:>10.3f}{worker_ / bare:>15.3f}"
                f"{self.images / worker_:>16.2f}   {warm}")


HEADER = f"{'':22}{'bare s':>9}{'worker s':>10}{'worker ÷ bare':>15}{'img/s (worker)':>16}   warm-ups s"


def measure(row: Row, bare: Callable[[], object], through_worker: Callable[[], object], repeat: int,
            device: torch.device) -> None:
    """A warm-up of each, then ``repeat`` rounds of bare and worker in turn (a slow spell lands on both)."""
    row.warm_up_s = [seconds(bare, device), seconds(through_worker, device)]
    for _ in range(repeat):
        row.bare_s.append(seconds(bare, device))
        row.worker_s.append(seconds(through_worker, device))


def bare_call(pipe: DiffusionPipeline, model: Model, side: int, steps: int, images: int,
              tier: Tier) -> Callable[[], object]:
    """The pipeline called as a diffusers user would, a CPU generator an image as the worker seeds them."""
    def call() -> object:
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in range(images)]
        with tier():
            return pipe(prompt=[PROMPT] * images, height=side, width=side, num_inference_steps=steps,
                        guidance_scale=model.guidance, generator=generators)
    return call


def worker_call(section: ImagePipeline, model: Model, side: int, steps: int, images: int, fast: bool
                ) -> Callable[[], object]:
    """The worker's GPU section on a batch of ``images`` one-image jobs of one batch key, in the fast
    tier where ``fast`` (the worker enters it for such a job)."""
    requests = [JobRequest(prompt=PROMPT, width=side, height=side, steps=steps, guidance_scale=model.guidance,
                           seed=seed, speed="fast" if fast else "normal") for seed in range(images)]

    return lambda: section.generate_batch(requests)


def worker_section(pipe: DiffusionPipeline, model: Model, device: torch.device, tiny: bool) -> ImagePipeline:
    """The worker's ImagePipeline around this pipe, as load_pipeline builds it (no adapters, no preview
    decoder, torch's own thread count); a tiny one named as the worker's tiny model of its family, whose
    fast tier the worker tunes for random weights as the bare run's is."""
    tiny_name = next(name for name, family in TINY_MODELS.items() if family == model.family)
    checkpoint = tiny_name if tiny else None
    return ImagePipeline(pipe=pipe, device=device, samplers=Samplers(pipe.scheduler),
                         info=model_info(f"fullsize-{model.family}", model.family, checkpoint=checkpoint),
                         adapters=Adapters(None, 1), previewer=Previewer(model.family, pipe.vae_scale_factor))


def why_not(error: BaseException) -> str:
    """A row's reason, in a line."""
    if isinstance(error, torch.OutOfMemoryError):
        return "out of memory"
    if isinstance(error, ImportError):
        return f"n/a (not available: {error})"
    first = (str(error).strip().splitlines() or [""])[0]
    return f"failed: {type(error).__name__}: {first[:200]}"


# --- the ways ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What to run: device, dtype, sizes and ways."""

    device: torch.device
    dtype: str
    tiny: bool
    repeat: int
    ways: tuple[str, ...]
    batch_families: tuple[str, ...]

    def dtype_of(self, model: Model) -> torch.dtype:
        """``auto``: float32 on the CPU; on a GPU bfloat16 for Flux (float16 overflows it), else float16."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if model.family == "flux" else torch.float16

    def job(self, model: Model) -> tuple[int, int]:
        return (TINY_SIDE, TINY_STEPS) if self.tiny else (model.side, model.steps)

    def skipped(self, way: str, model: Model) -> str:
        """Why a way is not run for this family ("" where it is)."""
        if way not in self.ways:
            return "skipped (not in --ways)"
        if way == "batch" and model.family not in self.batch_families:
            return "skipped (not in --batch-families)"
        return ""


def fast_tier_of(pipe: DiffusionPipeline, model: Model, tiny: bool) -> Tier:
    """worker/caching.py's fast tier on this pipe, to enter around a call (ImportError where it is absent)."""
    from worker.caching import fast_tier

    return lambda: fast_tier(pipe, model.family, tiny=tiny)


def eager_rows(plan: Plan, model: Model, pipe: DiffusionPipeline) -> list[Row]:
    """Eager, fast tier and batch, each bare and through the worker, on the eagerly built pipe."""
    side, steps = plan.job(model)
    section = worker_section(pipe, model, plan.device, plan.tiny)
    rows = []
    for way in ("eager", "fast", "batch"):
        row = Row(way, BATCH if way == "batch" else 1, note=plan.skipped(way, model))
        rows.append(row)
        if row.note:
            continue
        try:
            # The worker enters the tier itself for a job whose speed is fast.
            bare_tier = fast_tier_of(pipe, model, plan.tiny) if way == "fast" else nullcontext
            measure(row, bare_call(pipe, model, side, steps, row.images, bare_tier),
                    worker_call(section, model, side, steps, row.images, way == "fast"),
                    plan.repeat, plan.device)
        except Exception as error:  # noqa: BLE001 - a row that cannot run says why; the others go on
            row.bare_s, row.worker_s, row.note = [], [], why_not(error)
            freed(plan.device)
    return rows


def compiled_row(plan: Plan, model: Model, way: str) -> Row:
    """A freshly built pipe compiled by worker/compile.py (``way`` is its mode), bare and through it."""
    row = Row(way, note=plan.skipped(way, model))
    if row.note:
        return row
    try:
        from worker.compile import prepare  # type: ignore[import-not-found,unused-ignore]

        built = build(model, plan.tiny, plan.device, plan.dtype_of(model))
        try:
            prepare(built.pipe, way)
            side, steps = plan.job(model)
            measure(row, bare_call(built.pipe, model, side, steps, 1, nullcontext),
                    worker_call(worker_section(built.pipe, model, plan.device, plan.tiny), model, side, steps,
                                1, False), plan.repeat, plan.device)
        finally:
            del built
    except Exception as error:  # noqa: BLE001 - as in eager_rows
        row.bare_s, row.worker_s, row.note = [], [], why_not(error)
    freed(plan.device)
    return row


# --- the report -------------------------------------------------------------------------------


def anchor_lines(model: Model, rows: Sequence[Row], device: str) -> list[str]:
    """The published figures, with ours ÷ theirs (bare, eager; our best compiled against their tuned)
    where ours ran on the same kind of card."""
    timed = {row.way: median(row.bare_s) for row in rows if row.bare_s and row.images == 1}
    compiled = [timed[way] for way in COMPILED if way in timed]
    lines = []
    for anchor in ANCHORS[model.family]:
        eager = f" ({anchor.eager})" if anchor.eager else ""
        line = (f"published, {anchor.card}: eager {anchor.eager_s:.2f} s{eager}, "
                f"tuned {anchor.tuned_s:.2f} s ({anchor.tuned}); {anchor.source}")
        if anchor.card.split()[0] in device and "eager" in timed:
            line += f"; ours ÷ theirs: eager {timed['eager'] / anchor.eager_s:.2f}"
            if compiled:
                line += f", our best compiled ÷ their tuned {min(compiled) / anchor.tuned_s:.2f}"
        lines.append(line)
    return lines


def family_report(plan: Plan, model: Model, say: Callable[[str], None]) -> dict[str, Any]:
    """One family's rows, said as they come, and its figures."""
    side, steps = plan.job(model)
    dtype = plan.dtype_of(model)
    say(f"\n== {model.title}{' (tiny)' if plan.tiny else ''}: {side}x{side}, {steps} steps, "
        f"{str(dtype).removeprefix('torch.')} on {device_name(plan.device)} ==")
    figures: dict[str, Any] = {"family": model.family, "side": side, "steps": steps, "dtype": str(dtype)}
    try:
        built = build(model, plan.tiny, plan.device, dtype)
    except Exception as error:  # noqa: BLE001 - a family that cannot be built says why; the others go on
        say(f"not built: {why_not(error)}")
        freed(plan.device)
        return figures | {"built": why_not(error), "rows": []}
    say(f"built in {built.seconds:.1f} s on the device: {built.parameters / 1e6:,.1f} M parameters, "
        f"{built.bytes / 2**30:.2f} GiB (random weights from the published configs)")
    figures |= {"build_s": built.seconds, "parameters": built.parameters, "bytes": built.bytes}
    say(HEADER)
    rows = eager_rows(plan, model, built.pipe)
    for row in rows:
        say(row.line())
    del built
    freed(plan.device)
    for way in COMPILED:
        rows.append(compiled_row(plan, model, way))
        say(rows[-1].line())
    for line in anchor_lines(model, rows, device_name(plan.device)):
        say(line)
    return figures | {"rows": [asdict(row) for row in rows]}


def device_name(device: torch.device) -> str:
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def report(plan: Plan, families: Sequence[str], say: Callable[[str], None] = print) -> dict[str, Any]:
    """Every family's rows in turn; the figures, as --json writes them."""
    say(f"slotq full-size timings, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC: torch {torch.__version__}, "
        f"diffusers {diffusers.__version__}, transformers {transformers.__version__}, "
        f"timed calls a way: {plan.repeat} (the median shown), after a warm-up call each"
        + ("\n--tiny: small configs of the same shapes; figures mean little" if plan.tiny else ""))
    figures = [family_report(plan, MODELS[family], say) for family in families]
    return {"device": device_name(plan.device), "tiny": plan.tiny, "repeat": plan.repeat, "families": figures,
            "anchors": {family: [asdict(anchor) for anchor in ANCHORS[family]] for family in families}}


def names(text: str, known: Sequence[str], option: str) -> tuple[str, ...]:
    chosen = tuple(name for name in text.split(",") if name)
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise SystemExit(f"{option}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    return chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fullsize", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto: CUDA where there is one, else the CPU")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="auto: float32 on the CPU; on a GPU bfloat16 for Flux, float16 else")
    parser.add_argument("--families", default=",".join(MODELS))
    parser.add_argument("--repeat", type=int, default=3, help="timed calls a way (the median is shown)")
    parser.add_argument("--ways", help=f"of {','.join(WAYS)} (default: all; with --tiny, no compiling)")
    parser.add_argument("--batch-families", default="sd", help="the families timed in a batch of 4")
    parser.add_argument("--tiny", action="store_true", help="a smoke test: tiny configs, 64x64, 2 steps")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    ways = args.ways or ",".join(way for way in WAYS if not (args.tiny and way in COMPILED))
    plan = Plan(resolve_device("cpu" if args.tiny and args.device == "auto" else args.device), args.dtype,
                args.tiny, args.repeat, names(ways, list(WAYS), "--ways"),
                names(args.batch_families, list(MODELS), "--batch-families"))
    figures = report(plan, names(args.families, list(MODELS), "--families"),
                     lambda line: print(line, flush=True))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
