"""Model families: what a job may ask of the model a worker holds (samplers, sizes, defaults).

The worker tells its family from the pipeline it loaded and says so in its heartbeat; the API reads
it there to refuse a sampler the model cannot use and to fill in the defaults a request leaves out.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict, Field

Family = Literal["sd", "sdxl", "flux"]
FAMILIES: tuple[Family, ...] = get_args(Family)

# The samplers a job may name (``scheduler``), as A1111 and ComfyUI name them. The UNet families
# (SD 1.x/2.x, SDXL) take diffusers' discrete schedulers; a flow-matching model such as Flux takes
# its own Euler (worker/samplers.py builds each from the loaded scheduler's config).
Scheduler = Literal["ddim", "euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "unipc", "flow_euler"]
SCHEDULERS: tuple[Scheduler, ...] = get_args(Scheduler)
UNET_SCHEDULERS: tuple[Scheduler, ...] = ("ddim", "euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "unipc")

# The diffusers pipeline class of each family's text-to-image checkpoints.
PIPELINE_CLASSES: dict[str, Family] = {
    "StableDiffusionPipeline": "sd",
    "StableDiffusionXLPipeline": "sdxl",
    "FluxPipeline": "flux",
}
# The tiny random pipelines built locally (worker/tiny_model.py), by SLOTQ_MODEL.
TINY_MODELS: dict[str, Family] = {"tiny": "sd", "tiny-sdxl": "sdxl", "tiny-flux": "flux"}


class ModelDefaults(BaseModel):
    """What a request that leaves these out gets: the values the family is made for."""

    model_config = ConfigDict(frozen=True)

    steps: int
    guidance_scale: float
    width: int
    height: int


class ModelInfo(BaseModel):
    """One model the service can run, as ``GET /v1/models`` lists it."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="SLOTQ_MODEL of the workers that hold it")
    family: Family
    schedulers: list[Scheduler] = Field(description="the samplers a job on it may name")
    defaults: ModelDefaults
    side_multiple: int = Field(description="width and height must be multiples of this")
    workers: int = Field(0, description="live workers holding it")
    loras: list[str] = Field(default_factory=list, description="the LoRA adapters a job on it may name")

    def within(self, max_side: int) -> ModelInfo:
        """The model as this service runs it: default sides no larger than SLOTQ_MAX_SIDE."""
        largest = max_side - max_side % self.side_multiple
        sides = {side: min(getattr(self.defaults, side), largest) for side in ("width", "height")}
        return self.model_copy(update={"defaults": self.defaults.model_copy(update=sides)})


_FAMILY_INFO: dict[Family, tuple[tuple[Scheduler, ...], ModelDefaults, int]] = {
    # SD 1.x/2.x: 512² at CFG 7.5; SDXL: 1024² at a lower CFG; Flux (dev): 1024², guidance 3.5,
    # and its latents are packed 2x2, so its sides are multiples of 16.
    "sd": (UNET_SCHEDULERS, ModelDefaults(steps=30, guidance_scale=7.5, width=512, height=512), 8),
    "sdxl": (UNET_SCHEDULERS, ModelDefaults(steps=30, guidance_scale=5.0, width=1024, height=1024), 8),
    "flux": (("flow_euler",), ModelDefaults(steps=28, guidance_scale=3.5, width=1024, height=1024), 16),
}


def model_info(name: str, family: Family, workers: int = 0, loras: list[str] | None = None) -> ModelInfo:
    """What the service publishes of a model of this family."""
    schedulers, defaults, multiple = _FAMILY_INFO[family]
    return ModelInfo(name=name, family=family, schedulers=list(schedulers), defaults=defaults,
                     side_multiple=multiple, workers=workers, loras=loras or [])
