"""Model families: what a job may ask of the model a worker holds (samplers, sizes, defaults).

The worker tells its family from the pipeline it loaded and says so in its heartbeat; the API reads
it there to refuse a sampler the model cannot use and to fill in the defaults a request leaves out.
"""

from __future__ import annotations

from functools import cached_property
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
# A model's name, as SLOTQ_MODEL_NAME and SLOTQ_MODEL_NAMES give it and a job's `model` names it.
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
DEFAULT_MODEL_NAME = "default"
# The tiny random pipelines built locally (worker/tiny_model.py), by SLOTQ_MODEL.
TINY_MODELS: dict[str, Family] = {"tiny": "sd", "tiny-sdxl": "sdxl", "tiny-flux": "flux"}


class ModelDefaults(BaseModel):
    """What a request that leaves these out gets: the values the family is made for."""

    model_config = ConfigDict(frozen=True)

    steps: int
    guidance_scale: float
    width: int
    height: int

    @cached_property
    def fields(self) -> dict[str, int | float]:
        """The defaults as a request's fields (dumped once: admission merges them into each body)."""
        return self.model_dump()


class ModelInfo(BaseModel):
    """One model the service can run, as ``GET /v1/models`` lists it."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(description="the name a job's `model` gives (SLOTQ_MODEL_NAMES)")
    family: Family
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

    def within(self, max_side: int) -> ModelInfo:
        """The model as this service runs it: default sides no larger than SLOTQ_MAX_SIDE."""
        largest = max_side - max_side % self.side_multiple
        if max(self.defaults.width, self.defaults.height) <= largest:
            return self  # as it is (admission asks for each job)
        sides = {side: min(getattr(self.defaults, side), largest) for side in ("width", "height")}
        # A new instance, not model_copy: a copy would carry the cached ``fields`` of the family's shared
        # defaults, dumped before the sides changed.
        defaults = ModelDefaults(**(self.defaults.model_dump() | sides))
        return self.model_copy(update={"defaults": defaults})


_FAMILY_INFO: dict[Family, tuple[tuple[Scheduler, ...], ModelDefaults, int]] = {
    # SD 1.x/2.x: 512² at CFG 7.5; SDXL: 1024² at a lower CFG; Flux (dev): 1024², guidance 3.5,
    # and its latents are packed 2x2, so its sides are multiples of 16.
    "sd": (UNET_SCHEDULERS, ModelDefaults(steps=30, guidance_scale=7.5, width=512, height=512), 8),
    "sdxl": (UNET_SCHEDULERS, ModelDefaults(steps=30, guidance_scale=5.0, width=1024, height=1024), 8),
    "flux": (("flow_euler",), ModelDefaults(steps=28, guidance_scale=3.5, width=1024, height=1024), 16),
}


def model_info(name: str, family: Family, loras: list[str] | None = None, checkpoint: str | None = None,
               worker_names: list[str] | None = None, held_by: list[str] | None = None,
               capacity_pixels: int | None = None) -> ModelInfo:
    """What the service publishes of a model of this family, served by these live workers."""
    schedulers, defaults, multiple = _FAMILY_INFO[family]
    return ModelInfo(name=name, family=family, checkpoint=checkpoint, schedulers=list(schedulers),
                     defaults=defaults, side_multiple=multiple, workers=len(worker_names or []),
                     worker_names=worker_names or [], loras=loras or [], held_by=held_by or [],
                     capacity_pixels=capacity_pixels)
