"""Model families: what a job may ask of the model a worker holds (samplers, sizes, defaults).

The worker tells its family from the pipeline it loaded and says so in its heartbeat; the API reads
it there to refuse a sampler the model cannot use and to fill in the defaults a request leaves out.
Everything that differs by family is one ``FamilySpec`` in ``FAMILY_SPECS``, which every decision
reads: a new family is its record there plus its own implementation in the worker.
"""

from __future__ import annotations

from functools import cached_property
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.contract.errors import InvalidRequestError

Family = Literal["sd", "sdxl", "flux", "wan", "wan_i2v", "ltx"]
FAMILIES: tuple[Family, ...] = get_args(Family)

# The samplers a job may name (``scheduler``), as A1111 and ComfyUI name them, each written once. The
# UNet families (SD 1.x/2.x, SDXL) take diffusers' discrete schedulers; a flow-matching model such as
# Flux takes its own Euler (worker/samplers.py builds each from the loaded scheduler's config).
UNetScheduler = Literal["ddim", "euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "unipc"]
FlowScheduler = Literal["flow_euler"]
Scheduler = Literal[UNetScheduler, FlowScheduler]
SCHEDULERS: tuple[Scheduler, ...] = get_args(Scheduler)
UNET_SCHEDULERS: tuple[Scheduler, ...] = get_args(UNetScheduler)
FLOW_SCHEDULERS: tuple[Scheduler, ...] = get_args(FlowScheduler)

# The model that predicts each step's noise: what the worker's step loop and step caching run.
Denoiser = Literal["unet", "transformer"]
# What a family's single-file checkpoint holds: a whole pipeline (A1111's layout), or its transformer
# alone, the other components coming from its configuration source (BFL's layout).
SingleFile = Literal["pipeline", "transformer"]
# Its text encoders, which decide how a prompt becomes conditioning: one CLIP (SD), two CLIPs with
# the second's pooled output and size conditioning (SDXL), T5 with CLIP's pooled output (Flux), T5
# alone (Wan's UMT5, LTX-Video's T5).
TextEncoders = Literal["clip", "clip_pair", "t5_clip", "t5"]
# The latent space of its VAE, as ComfyUI's latent_formats name them (a preview's colours).
LatentFormat = Literal["sd15", "sdxl", "flux", "wan21", "ltxv"]
# What it makes: images, or a clip of frames (an MP4).
Media = Literal["image", "video"]
# What a family may be unable to take, as FamilySpec's fields name it.
Ability = Literal["takes_controlnet", "takes_ip_adapter", "takes_latent_upscale", "takes_inpainting",
                  "takes_image", "takes_hires", "takes_weighted_prompts"]

# A model's name, as SLOTQ_MODEL_NAME and SLOTQ_MODEL_NAMES give it and a job's `model` names it.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
DEFAULT_MODEL_NAME = "default"


class ModelDefaults(BaseModel):
    """What a request that leaves these out gets: the values the family is made for."""

    model_config = ConfigDict(frozen=True)

    steps: int
    guidance_scale: float
    width: int
    height: int
    frames: int | None = Field(None, description="a video family's: the clip's frames")
    fps: int | None = Field(None, description="a video family's: its frames a second")

    @cached_property
    def fields(self) -> dict[str, int | float]:
        """The defaults as a request's fields (dumped once: admission merges them into each body)."""
        return self.model_dump(exclude_none=True)


class FamilySpec(BaseModel):
    """One model family: every decision that differs by family reads its record, and only that."""

    model_config = ConfigDict(frozen=True)

    pipeline_class: str  # the diffusers pipeline class of its text-to-image checkpoints
    tiny_model: str  # the tiny random pipeline of its kind (worker/tiny/model.py), by SLOTQ_MODEL
    # Where its single files take their configs and tokenizers by default (SLOTQ_CHECKPOINT_CONFIGS):
    # the hub id diffusers itself uses (DIFFUSERS_DEFAULT_PIPELINE_PATHS in its single_file_utils.py).
    checkpoint_config: str
    samplers: tuple[Scheduler, ...]  # those a job on it may name
    steppable: tuple[Scheduler, ...]  # those of them the worker's step loop runs (worker/stepping.py)
    defaults: ModelDefaults
    side_multiple: int  # width and height must be multiples of this
    denoiser: Denoiser
    single_file: SingleFile
    text_encoders: TextEncoders
    latent_format: LatentFormat
    takes_controlnet: bool  # slotq's ControlNets and IP-Adapters go into a UNet
    takes_ip_adapter: bool
    takes_latent_upscale: bool  # a hires pass may upscale its latents rather than the image
    media: Media = "image"
    # A clip's frames are a multiple of this plus one: its VAE compresses time by this factor and
    # keeps the first frame apart (Wan 4, LTX-Video 8). 0 for an image family.
    frame_multiple: int = 0
    # The pipeline class that starts a clip from an image over the same modules (diffusers'
    # ``from_pipe``); None where the family's text-to-video checkpoints cannot (Wan's image-to-video
    # is a checkpoint of its own, with an image encoder).
    image_to_video_class: str | None = None
    # Its checkpoints make every clip from a start image (Wan 2.1's image-to-video models): a job
    # without ``image`` is refused.
    starts_from_image: bool = False
    # The fewest steps it runs: LTX-Video's scheduler stretches its schedule to a terminal shift,
    # which divides by zero over one step (diffusers' FlowMatchEulerDiscreteScheduler).
    min_steps: int = 1
    # Its jobs' timeout while SLOTQ_JOB_TIMEOUT_S is unset, where longer than that setting's default:
    # a full-size clip takes minutes to tens of minutes on one GPU.
    job_timeout_s: int | None = None
    # The fast tier's step caching: DeepCache's interval on a UNet (a full call every this many), or
    # First Block Cache's threshold on a transformer (worker/caching.py).
    cache_interval: int | None = None
    cache_threshold: float | None = None

    @model_validator(mode="after")
    def _consistent(self) -> FamilySpec:
        if not set(self.steppable) <= set(self.samplers):
            raise ValueError("a steppable sampler must be one the family takes")
        if (self.cache_interval is None) != (self.denoiser != "unet"):
            raise ValueError("a UNet has a cache_interval, and only a UNet")
        if self.cache_threshold is not None and self.denoiser != "transformer":
            raise ValueError("only a transformer has a cache_threshold")
        if (self.media == "video") != (self.frame_multiple > 0) or (self.media == "video") != (
                self.defaults.frames is not None and self.defaults.fps is not None):
            raise ValueError("a video family, and only one, has a frame_multiple and default frames and fps")
        if self.defaults.frames is not None and (self.defaults.frames - 1) % self.frame_multiple:
            raise ValueError("the default frames must be a multiple of frame_multiple plus one")
        return self

    @property
    def is_video(self) -> bool:
        """Whether it makes clips."""
        return self.media == "video"

    @property
    def takes_inpainting(self) -> bool:
        """A mask repaints an image: the image families'."""
        return not self.is_video

    @property
    def takes_hires(self) -> bool:
        """A second, larger pass: the image families'."""
        return not self.is_video

    @property
    def takes_image(self) -> bool:
        """A start image: every image family's, and a video family's that starts from one or has an
        image-to-video twin."""
        return not self.is_video or self.image_to_video_class is not None or self.starts_from_image

    @property
    def takes_weighted_prompts(self) -> bool:
        """compel weights CLIP's embeddings (worker/prompts.py): a T5 alone it cannot."""
        return self.text_encoders != "t5"

    @property
    def takes_fast_tier(self) -> bool:
        """The fast tier's step caching needs its denoiser's setting."""
        return self.cache_interval is not None or self.cache_threshold is not None


class ModelInfo(BaseModel):
    """One model the service can run, as ``GET /v1/models`` lists it."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="the name a job's `model` gives (SLOTQ_MODEL_NAMES)")
    family: Family
    media: Media = Field("image", description="what its jobs make: `image`s, or a `video` (an MP4 with "
                                              "a poster image)")
    frame_multiple: int | None = Field(None, description="a video model's: a clip's `frames` are a "
                                                         "multiple of this plus one")
    checkpoint: str | None = Field(None, description="SLOTQ_MODEL of the live workers that serve it")
    size: int | None = Field(None, description="the bytes of its file or diffusers folder in "
                                               "SLOTQ_MODELS_DIR; null for a model from elsewhere")
    schedulers: list[Scheduler] = Field(description="the samplers a job on it may name")
    defaults: ModelDefaults
    side_multiple: int = Field(description="width and height must be multiples of this")
    workers: int = Field(0, description="live workers serving it")
    worker_names: list[str] = Field(default_factory=list, description="their names")
    held_by: list[str] = Field(default_factory=list, description="those of them that have it on their "
                                                                 "device now (a worker serving several "
                                                                 "models switches between them)")
    capacity_pixels: int | None = Field(None, description="the most pixels x images one job may make on "
                                                          "the live workers, as they report it; null "
                                                          "where one reports no bound (no live worker, "
                                                          "a CPU worker)")
    loras: list[str] = Field(default_factory=list, description="the LoRA adapters a job on it may name")
    controlnets: list[str] = Field(default_factory=list, description="the ControlNets a job on it may name "
                                                                     "(SLOTQ_CONTROLNET_DIR)")
    ip_adapters: list[str] = Field(default_factory=list, description="the IP-Adapters a job on it may name "
                                                                     "(SLOTQ_IP_ADAPTER_DIR)")

    @property
    def spec(self) -> FamilySpec:
        """Its family's record."""
        return FAMILY_SPECS[self.family]

    def within(self, max_side: int, max_frames: int | None = None) -> ModelInfo:
        """The model as this service runs it: default sides no larger than SLOTQ_MAX_SIDE, a default clip
        no longer than SLOTQ_MAX_FRAMES."""
        largest = max_side - max_side % self.side_multiple
        frames, multiple = self.defaults.frames, self.frame_multiple
        longest = frames if frames is None or multiple is None or max_frames is None else min(
            frames, (max_frames - 1) // multiple * multiple + 1)
        if max(self.defaults.width, self.defaults.height) <= largest and longest == frames:
            return self  # as it is (admission asks for each job)
        sides: dict[str, int | None] = {side: min(getattr(self.defaults, side), largest)
                                        for side in ("width", "height")}
        sides["frames"] = longest
        # A new instance, not model_copy: a copy would carry the cached ``fields`` of the family's shared
        # defaults, dumped before the sides changed.
        defaults = ModelDefaults(**(self.defaults.model_dump() | sides))
        return self.model_copy(update={"defaults": defaults})


FAMILY_SPECS: dict[Family, FamilySpec] = {
    # SD 1.x/2.x: 512² at CFG 7.5. DeepCache's interval is 3, that of its own example: each larger
    # one runs faster and strays further from the full image, and random weights rank no quality
    # (the measured speeds and differences: docs/speed.md).
    "sd": FamilySpec(
        pipeline_class="StableDiffusionPipeline", tiny_model="tiny",
        checkpoint_config="stable-diffusion-v1-5/stable-diffusion-v1-5",
        samplers=UNET_SCHEDULERS, steppable=UNET_SCHEDULERS,
        defaults=ModelDefaults(steps=30, guidance_scale=7.5, width=512, height=512), side_multiple=8,
        denoiser="unet", single_file="pipeline", text_encoders="clip", latent_format="sd15",
        takes_controlnet=True, takes_ip_adapter=True, takes_latent_upscale=True, cache_interval=3),
    # SDXL: 1024² at a lower CFG.
    "sdxl": FamilySpec(
        pipeline_class="StableDiffusionXLPipeline", tiny_model="tiny-sdxl",
        checkpoint_config="stabilityai/stable-diffusion-xl-base-1.0",
        samplers=UNET_SCHEDULERS, steppable=UNET_SCHEDULERS,
        defaults=ModelDefaults(steps=30, guidance_scale=5.0, width=1024, height=1024), side_multiple=8,
        denoiser="unet", single_file="pipeline", text_encoders="clip_pair", latent_format="sdxl",
        takes_controlnet=True, takes_ip_adapter=True, takes_latent_upscale=True, cache_interval=3),
    # Flux (dev): 1024², guidance 3.5; its latents are packed 2x2, so its sides are multiples of 16 and
    # a hires pass resizes the image. Its ControlNets and IP-Adapters are other architectures than
    # slotq's. The cache threshold is ParaAttention's default for FLUX.1-dev, whose published speed-up
    # and quality are in docs/speed.md; a higher one skips more steps.
    "flux": FamilySpec(
        pipeline_class="FluxPipeline", tiny_model="tiny-flux",
        checkpoint_config="black-forest-labs/FLUX.1-dev",
        samplers=FLOW_SCHEDULERS, steppable=FLOW_SCHEDULERS,
        defaults=ModelDefaults(steps=28, guidance_scale=3.5, width=1024, height=1024), side_multiple=16,
        denoiser="transformer", single_file="transformer", text_encoders="t5_clip", latent_format="flux",
        takes_controlnet=False, takes_ip_adapter=False, takes_latent_upscale=False, cache_threshold=0.08),
    # Wan 2.1 text-to-video (the 1.3B model's 480p: 832x480, 81 frames at 16 fps, 50 steps at CFG 5).
    # Its VAE compresses 8x in space and 4x in time, its transformer patches 2x2: sides of 16.
    "wan": FamilySpec(
        pipeline_class="WanPipeline", tiny_model="tiny-wan",
        checkpoint_config="Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
        samplers=FLOW_SCHEDULERS, steppable=(),
        defaults=ModelDefaults(steps=50, guidance_scale=5.0, width=832, height=480, frames=81, fps=16),
        side_multiple=16, denoiser="transformer", single_file="transformer", text_encoders="t5",
        latent_format="wan21", takes_controlnet=False, takes_ip_adapter=False, takes_latent_upscale=False,
        media="video", frame_multiple=4, job_timeout_s=3600),
    # Wan 2.1 image-to-video (the 14B 480p model: its sizes and frames, 40 steps at CFG 5): the Wan
    # transformer also reads the start image's latents and its CLIP image encoder's embeddings.
    "wan_i2v": FamilySpec(
        pipeline_class="WanImageToVideoPipeline", tiny_model="tiny-wan-i2v",
        checkpoint_config="Wan-AI/Wan2.1-I2V-14B-480P-Diffusers",
        samplers=FLOW_SCHEDULERS, steppable=(),
        defaults=ModelDefaults(steps=40, guidance_scale=5.0, width=832, height=480, frames=81, fps=16),
        side_multiple=16, denoiser="transformer", single_file="transformer", text_encoders="t5",
        latent_format="wan21", takes_controlnet=False, takes_ip_adapter=False, takes_latent_upscale=False,
        media="video", frame_multiple=4, starts_from_image=True, job_timeout_s=3600),
    # LTX-Video (0.9: 704x480, 161 frames at 25 fps, 50 steps at CFG 3); its VAE compresses 32x in
    # space and 8x in time. Its image-to-video pipeline runs over the text-to-video one's modules.
    "ltx": FamilySpec(
        pipeline_class="LTXPipeline", tiny_model="tiny-ltx", checkpoint_config="Lightricks/LTX-Video",
        samplers=FLOW_SCHEDULERS, steppable=(),
        defaults=ModelDefaults(steps=50, guidance_scale=3.0, width=704, height=480, frames=161, fps=25),
        side_multiple=32, denoiser="transformer", single_file="transformer", text_encoders="t5",
        latent_format="ltxv", takes_controlnet=False, takes_ip_adapter=False, takes_latent_upscale=False,
        media="video", frame_multiple=8, image_to_video_class="LTXImageToVideoPipeline", min_steps=2,
        job_timeout_s=3600),
}
# The diffusers pipeline class of each family's text-to-image checkpoints.
PIPELINE_CLASSES: dict[str, Family] = {spec.pipeline_class: family for family, spec in FAMILY_SPECS.items()}
# The tiny random pipelines built locally (worker/tiny/model.py, worker/tiny/video.py), by SLOTQ_MODEL.
TINY_MODELS: dict[str, Family] = {spec.tiny_model: family for family, spec in FAMILY_SPECS.items()}
# Those of them that make images, and those that make clips.
TINY_IMAGE_MODELS: dict[str, Family] = {name: family for name, family in TINY_MODELS.items()
                                        if not FAMILY_SPECS[family].is_video}
TINY_VIDEO_MODELS: dict[str, Family] = {name: family for name, family in TINY_MODELS.items()
                                        if FAMILY_SPECS[family].is_video}

# A request for what its model's family cannot take: the field refused and why, ``{family}`` the
# model's and ``{able}`` those that can.
_REFUSALS: dict[Ability, tuple[list[str | int], str]] = {
    "takes_controlnet": (["controlnets"], "a {family} model takes no ControlNet here: slotq's ControlNets "
                                          "are the {able} families'"),
    "takes_ip_adapter": (["ip_adapter"], "a {family} model takes no IP-Adapter here: slotq's are the {able} "
                                         "families'"),
    "takes_latent_upscale": (["hires", "upscaler"], "a {family} model's hires pass upscales the image: "
                                                    "send `lanczos`"),
    "takes_inpainting": (["mask"], "a {family} model does not inpaint: the {able} families do"),
    "takes_image": (["image"], "this {family} model makes clips from text only (image-to-video is a "
                               "checkpoint of its own there); the {able} families start from an image"),
    "takes_hires": (["hires"], "a {family} model has no hires pass: the {able} families have"),
    "takes_weighted_prompts": (["prompt_syntax"], "a {family} model's prompts cannot be weighted here: the "
                                                  "{able} families' can"),
}


def family_spec(family: Family) -> FamilySpec:
    """The record of a family."""
    return FAMILY_SPECS[family]


def check_takes(family: Family, ability: Ability) -> None:
    """Refuse (``InvalidRequestError``, at the field that asks) what this family cannot take."""
    if getattr(FAMILY_SPECS[family], ability):
        return
    loc, message = _REFUSALS[ability]
    able = ", ".join(name for name, spec in FAMILY_SPECS.items() if getattr(spec, ability))
    raise InvalidRequestError(details=[{"loc": loc, "msg": message.format(family=family, able=able)}])


def model_info(name: str, family: Family, loras: list[str] | None = None, checkpoint: str | None = None,
               worker_names: list[str] | None = None, held_by: list[str] | None = None,
               capacity_pixels: int | None = None) -> ModelInfo:
    """What the service publishes of a model of this family, served by these live workers."""
    spec = FAMILY_SPECS[family]
    return ModelInfo(name=name, family=family, media=spec.media, frame_multiple=spec.frame_multiple or None,
                     checkpoint=checkpoint, schedulers=list(spec.samplers),
                     defaults=spec.defaults, side_multiple=spec.side_multiple,
                     workers=len(worker_names or []), worker_names=worker_names or [], loras=loras or [],
                     held_by=held_by or [], capacity_pixels=capacity_pixels)
