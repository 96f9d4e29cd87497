"""Loading the diffusers pipeline once and running requests through it.

Image-to-image and inpainting run on pipelines made with diffusers' ``from_pipe`` from the loaded
one: they share its modules, so the weights are on the device once whatever a job does.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import torch
from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting, DiffusionPipeline
from diffusers.image_processor import VaeImageProcessor
from diffusers.utils import logging as diffusers_logging
from PIL import Image

from shared.contract.adapters import available_adapters
from shared.contract.errors import JobFailedError
from shared.contract.images import ImageRef
from shared.contract.jobs import ControlRequest, JobKind, JobRequest, steps_run
from shared.contract.memory import MemoryOptions
from shared.contract.models import (
    PIPELINE_CLASSES,
    TINY_MODELS,
    TINY_VIDEO_MODELS,
    Family,
    ModelInfo,
    model_info,
)
from shared.contract.settings import Settings
from worker import memory
from worker.adapters import Adapters
from worker.caching import fast_tier
from worker.capacity import Capacity
from worker.checkpoints import is_single_file, load_folder_model
from worker.compile import AdapterSlots, inductor_cache, prepare
from worker.compile import warm_up as compile_sizes
from worker.controlnets import ControlNets, canny, control_arguments, controlled
from worker.device_time import DeviceTime
from worker.ip_adapters import IpAdapters, ip_adapter_arguments, share_image_encoder
from worker.messages import Clip
from worker.previews import Previewer, load_decoder
from worker.prompts import weighted_arguments
from worker.resuming import Resumption, resumed_call
from worker.samplers import Samplers
from worker.threads import CALIBRATION_STEPS, ThreadChoice, work_of
from worker.threads import TORCH_DEFAULT_THREADS as TORCH_DEFAULT_THREADS  # re-exported: bench reads it here
from worker.tiny.model import ensure_tiny_model
from worker.tiny.video import ensure_tiny_video_model
from worker.video import to_uint8

log = logging.getLogger(__name__)

# After each denoising step: (step, total, latents), the latents as the sampler holds them (None
# before the first step).
StepCallback = Callable[[int, int, "torch.Tensor | None"], None]
# After each step, to save a step checkpoint: (step, latents, the call's generators, its sampler).
Keep = Callable[[int, torch.Tensor, list[torch.Generator], Any], None]
Inputs = Mapping[str, Image.Image]  # a request's decoded input images: "image" (RGB), "mask" (L)
Made = list[Image.Image] | Clip  # what one request makes: its images, or its clip
VARIANTS = {"image": AutoPipelineForImage2Image, "inpaint": AutoPipelineForInpainting}
# What the first pass of a hires job returns: latents to upscale, or images (tensors in [0, 1]).
_FIRST_PASS = {"latent": "latent", "lanczos": "pil"}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(setting: str) -> torch.device:
    """``auto`` means the first CUDA device when there is one, else the CPU."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """``auto`` means half precision on CUDA and full precision elsewhere."""
    if setting == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return DTYPES[setting]


@dataclass
class ImagePipeline:
    """A loaded text-to-image pipeline on its device. Not thread-safe: one call at a time."""

    pipe: DiffusionPipeline
    device: torch.device
    samplers: Samplers
    info: ModelInfo
    adapters: Adapters
    previewer: Previewer
    variants: dict[JobKind, DiffusionPipeline] = field(default_factory=dict)
    memory: MemoryOptions = field(default_factory=MemoryOptions)  # how its weights are held
    capacity: Capacity = field(default_factory=Capacity)  # how large an execution it can run
    threads: ThreadChoice = field(default_factory=lambda: ThreadChoice(0, 0))  # torch's CPU threads
    controlnets: ControlNets = field(default_factory=ControlNets)  # those loaded for this model
    ip_adapters: IpAdapters = field(default_factory=lambda: IpAdapters(None, "", 1))
    last_affinity: str = ""  # the affinity key of the last execution (JobRequest.affinity_key)
    # When each GPU section (denoising and decoding) ran: what the duty cycle is computed from.
    device_time: DeviceTime = field(default_factory=DeviceTime)

    def generate(self, request: JobRequest, on_step: StepCallback | None = None, inputs: Inputs | None = None
                 ) -> Made:
        """Run one request; ``on_step(step, total, latents)`` runs after each denoising step and may raise.
        Raises ``JobFailedError`` (``nan_output``) where the model's output is not a number."""
        (made,) = self.generate_batch([request], on_step, [inputs or {}])
        if isinstance(made, JobFailedError):
            raise made
        return made

    def generate_batch(self, requests: list[JobRequest], on_step: StepCallback | None = None,
                       inputs: Sequence[Inputs] = (), resume: Resumption | None = None,
                       checkpoint: Keep | None = None) -> list[Made | JobFailedError]:
        """Run requests of one batch key (kind, size, steps, strength, guidance, sampler, adapters,
        controls, hires pass, images) as one execution; the images of each, or for a request whose
        images hold NaN the failure that ends it (``nan_output``). Each image keeps its own generator, so
        it is the one it would be alone. ``inputs`` holds each request's input images, in order: its
        start image and mask, its controls' images (``control0``...). A video model's request makes a
        clip (its frames, as diffusers returns them, and its rate). A call of one request may ``resume``
        from a step checkpoint (a hires job's in either pass); ``checkpoint(step, latents, generators,
        sampler)`` runs before ``on_step`` at each step (worker/resuming.py)."""
        first = requests[0]
        assert all(r.batch_key == first.batch_key and r.seed is not None for r in requests), requests
        inputs = list(inputs) or [{} for _ in requests]
        # One CPU generator per image, in diffusers' order (each prompt's images together): image i
        # of a job is reproducible from its seed + i, on any device and in any batch.
        generators = [torch.Generator("cpu").manual_seed(r.seed + index)  # type: ignore[operator]
                      for r in requests for index in range(r.num_images)]
        if checkpoint is not None:
            on_step = _keeping(on_step, checkpoint, generators, self.samplers.get(first.scheduler))
        self.adapters.use(self.pipe, first.loras)  # into the modules its twins share
        if first.ip_adapter is None:
            self.ip_adapters.use(self.pipe, None, 0.0)
        else:
            self.ip_adapters.use(self.pipe, first.ip_adapter.name, first.ip_adapter.scale)
        self.last_affinity = first.affinity_key
        self.threads.use(work_of(requests))
        pipe = self._pipeline_for(first.kind, first.controlnets)
        arguments = self._arguments(pipe, requests, inputs, first.kind, (first.width, first.height))
        if self.device.type == "cuda":  # this execution's peak, for the capacity admission reads
            torch.cuda.reset_peak_memory_stats(self.device)
        assert resume is None or len(requests) == 1, "only a call of one job resumes"
        first_pass, second_pass = self._passes_resumed(first, resume)
        with self.section(), torch.inference_mode():
            output: Any = None  # a hires job resumed in its second pass skips its first
            if second_pass is None:
                with self._tier(pipe, first), self._resuming(pipe, first, generators, first_pass):
                    output = self._denoise(pipe, first, arguments, generators, on_step, 0,
                                           "np" if first.hires is None else _FIRST_PASS[first.hires.upscaler])
            if first.hires is not None:
                output = self._hires_pass(requests, inputs, output, generators, on_step, second_pass)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the section ends when the device is done
                width, height = first.output_size(self.info.side_multiple)
                self.capacity.observe(width * height * first.pictures * len(requests),
                                      torch.cuda.max_memory_allocated(self.device))
        if first.is_video:  # (videos, frames, height, width, 3): one clip a request
            return [clip_of(frames, first.fps or 1) for frames in output.frames]
        pixels, per_job = output.images, first.num_images
        made: list[Made | JobFailedError] = [images_of(pixels[index * per_job:(index + 1) * per_job])
                                             for index in range(len(requests))]
        if first.kind == "inpaint":  # every pixel was decoded from latents: the kept ones too, altered
            made = [_kept_outside_mask(images, each) for images, each in zip(made, inputs, strict=True)]
        return made

    @staticmethod
    def _passes_resumed(request: JobRequest, resume: Resumption | None
                        ) -> tuple[Resumption | None, Resumption | None]:
        """Where a resumed job's passes resume: its one pass, or a hires job's first or second (its steps
        counted from the second's start), the other ``None``."""
        if resume is None or request.hires is None or resume.step <= request.first_steps_run:
            return resume, None
        return None, dataclasses.replace(resume, step=resume.step - request.first_steps_run)

    def _resuming(self, pipe: DiffusionPipeline, request: JobRequest, generators: list[torch.Generator],
                  resume: Resumption | None) -> AbstractContextManager[None]:
        """For a pass that resumes, its call after ``resume.step`` of its steps (worker/resuming.py)."""
        if resume is None:
            return nullcontext()
        return resumed_call(pipe, self.samplers.get(request.scheduler), resume, generators, self.device)

    def section(self) -> AbstractContextManager[None]:
        """A GPU section: its time counts in the duty cycle, a canceled or failed one's too."""
        return self.device_time.section()

    def for_stepping(self) -> DiffusionPipeline:
        """The text-to-image pipeline, bare (no LoRA, no IP-Adapter), for the step-level loop
        (worker/joining.py), which runs only jobs without them."""
        self.adapters.use(self.pipe, [])
        self.ip_adapters.use(self.pipe, None, 0.0)
        self.last_affinity = ""
        return self.pipe

    def _denoise(self, pipe: DiffusionPipeline, first: JobRequest, arguments: dict[str, object],
                 generators: list[torch.Generator], on_step: StepCallback | None, done: int,
                 output_type: str) -> Any:
        """One pass of the pipeline; ``on_step`` counts its steps after the ``done`` of earlier passes."""
        def step_end(pipe: DiffusionPipeline, step: int, timestep: object, kwargs: dict) -> dict:
            if on_step is not None:
                on_step(done + step + 1, first.steps_run, kwargs.get("latents"))
            return kwargs  # diffusers expects the callback's tensors back

        scheduler = self.samplers.get(first.scheduler)
        if pipe.scheduler is not scheduler:  # setting a module rewrites the pipeline's config
            pipe.scheduler = scheduler
        return pipe(**arguments, generator=generators, output_type=output_type, callback_on_step_end=step_end)

    def _hires_pass(self, requests: list[JobRequest], inputs: Sequence[Inputs], first_pass: Any,
                    generators: list[torch.Generator], on_step: StepCallback | None,
                    resume: Resumption | None = None) -> Any:
        """The second pass of a hires batch: the first pass's latents or images upscaled to the larger
        size, then image-to-image there (with the batch's controls), its steps counted after the first's.
        Resumed, it has no first pass: black images stand in for it, the latents they make replaced."""
        first = requests[0]
        hires, size = first.hires, first.output_size(self.info.side_multiple)
        assert hires is not None
        pipe = self._pipeline_for("image", first.controlnets)
        arguments = self._arguments(pipe, requests, inputs, "image", size)
        arguments["image"] = ([Image.new("RGB", size)] * first.num_images if first_pass is None else
                              upscaled(first_pass.images, size, hires.upscaler, self.pipe.vae_scale_factor))
        arguments["num_inference_steps"] = steps = hires.steps or first.steps
        arguments["strength"] = pipeline_strength(self.info.family, steps, hires.denoise)
        with self._tier(pipe, first), self._resuming(pipe, first, generators, resume):
            return self._denoise(pipe, first, arguments, generators, on_step, first.first_steps_run, "np")

    def _tier(self, pipe: DiffusionPipeline, request: JobRequest) -> AbstractContextManager[None]:
        """The fast tier's step caching for a request that runs in it (its speed is the tier its worker
        chose); nothing for the normal tier."""
        if request.speed != "fast":
            return nullcontext()
        return fast_tier(pipe, self.info.family, tiny=self.info.checkpoint in TINY_MODELS)

    def _pipeline_for(self, kind: JobKind, controls: Sequence[ControlRequest] = ()) -> DiffusionPipeline:
        """The loaded pipeline, or its image-to-image or inpainting twin over the same modules; with
        controls, the ControlNet pipeline of the kind over them (made per call: it holds no ControlNet)."""
        if controls:
            return controlled(self.pipe, kind, [self.controlnets.get(control.name) for control in controls])
        if kind == "text" or self.info.spec.starts_from_image:  # an image-to-video model's own call
            return self.pipe
        if kind not in self.variants:
            twin = self.info.spec.image_to_video_class  # a video family's start-image pipeline
            maker = getattr(diffusers, twin) if twin is not None else VARIANTS[kind]
            variant = maker.from_pipe(self.pipe)
            variant.set_progress_bar_config(disable=True)
            self.variants[kind] = variant
        # from_pipe copied the components of its moment: an IP-Adapter's image encoder may be newer.
        share_image_encoder(self.pipe, self.variants[kind])
        return self.variants[kind]

    def _arguments(self, pipe: DiffusionPipeline, requests: list[JobRequest], inputs: Sequence[Inputs],
                   kind: JobKind, size: tuple[int, int]) -> dict[str, object]:
        """The call's arguments that this pipeline takes, from requests of one batch key, for a pass of
        this kind at this size."""
        first = requests[0]
        negatives = [r.negative_prompt or "" for r in requests]  # "" is what diffusers uses for none
        arguments: dict[str, object] = {
            "prompt": [r.prompt for r in requests],
            "negative_prompt": negatives if any(negatives) else None,
            # Always the pass's size: Flux's image-to-image would otherwise make 1024x1024.
            "width": size[0],
            "height": size[1],
            "num_inference_steps": first.steps,
            "guidance_scale": first.guidance_scale,
            "num_images_per_prompt": first.num_images,
            "num_frames": first.frames,  # a clip's: a video pipeline takes these two
            "frame_rate": first.fps,
        }
        if kind != "text":
            starts = [each.get("image") for each in inputs]
            # Wan's image-to-video call takes one image: a batch of its clips shares it (their batch key)
            arguments["image"] = starts[0] if self.info.spec.starts_from_image else starts
            # (an image-to-video pipeline takes no strength: dropped below with what it does not take)
            arguments["strength"] = pipeline_strength(self.info.family, first.steps, first.strength)
        if kind == "inpaint":
            arguments["mask_image"] = [each["mask"] for each in inputs]
        if first.controlnets:
            images = [control_images(first.controlnets, each) for each in inputs]
            arguments |= control_arguments(kind, first.controlnets, images, *size)
        if first.ip_adapter is not None:  # each request's own reference image, masked apart in a batch
            arguments |= ip_adapter_arguments([each["ip_adapter"] for each in inputs], width=size[0],
                                              height=size[1], per_request=first.num_images,
                                              guided=first.guidance_scale > 1, device=self.device)
        accepted = _parameters(type(pipe))
        if arguments["negative_prompt"] is not None and "negative_prompt" not in accepted:
            raise ValueError(f"a {self.info.family} model takes no negative_prompt")
        if first.prompt_syntax == "weighted":  # the embeddings instead of the words (worker/prompts.py)
            del arguments["prompt"], arguments["negative_prompt"]
            arguments |= weighted_arguments(pipe, self.info.family, [r.prompt for r in requests],
                                            negatives if any(negatives) else None, first.num_images)
            arguments["num_images_per_prompt"] = 1  # a row an image already
        return {name: value for name, value in arguments.items() if name in accepted}

    @property
    def holding(self) -> tuple[str, tuple[str, ...]]:
        """What the claim's affinity prefers (shared/store/lua/lib/line.lua): the affinity key of the
        last execution, and the resident adapters, ControlNets (``@name``) and IP-Adapters (``&name``)."""
        _, adapters = self.adapters.holding
        return self.last_affinity, (*adapters, *(f"@{name}" for name in self.controlnets.holding),
                                    *(f"&{name}" for name in self.ip_adapters.holding))

    def release_memory(self) -> None:
        """Give cached device memory back after a failure such as out-of-memory."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


NAN_OUTPUT = ("The model's output was not a number (NaN): it overflowed, as half precision (float16) can "
              "with a strong LoRA or some checkpoints' VAEs. A lower LoRA scale may pass; the service's "
              "operator can run the model in bfloat16 or float32 (SLOTQ_DTYPE).")


def images_of(pixels: np.ndarray) -> list[Image.Image] | JobFailedError:
    """One request's images from the pipeline's floats in [0, 1], or its failure where any is NaN:
    converted as they are, NaN would be a black image that looks like a success."""
    if np.isnan(pixels).any():
        return JobFailedError("nan_output", NAN_OUTPUT)
    return VaeImageProcessor.numpy_to_pil(pixels)


def _keeping(on_step: StepCallback | None, keep: Keep, generators: list[torch.Generator],
             sampler: Any) -> StepCallback:
    """``keep`` with the step's latents, the call's generators and its sampler, then ``on_step``: a stop
    that ``on_step`` raises (a drain) comes after the step's state is kept."""
    def step_done(step: int, total: int, latents: torch.Tensor | None) -> None:
        if latents is not None:
            keep(step, latents, generators, sampler)
        if on_step is not None:
            on_step(step, total, latents)

    return step_done


def clip_of(frames: np.ndarray, fps: int) -> Clip | JobFailedError:
    """One request's clip from the pipeline's floats in [0, 1], or its failure where any is NaN."""
    if np.isnan(frames).any():
        return JobFailedError("nan_output", NAN_OUTPUT)
    return Clip(to_uint8(frames), fps)


def _kept_outside_mask(made: Made | JobFailedError, inputs: Inputs) -> Made | JobFailedError:
    """Inpainted images with the input's own pixels where the mask is black, blended where it is grey."""
    if isinstance(made, (JobFailedError, Clip)):
        return made
    return [Image.composite(image, inputs["image"], inputs["mask"]) for image in made]


def pipeline_strength(family: Family, steps: int, strength: float) -> float:
    """The strength that makes a family's image-to-image pipeline run the steps a job counts (the last
    ``int(steps * strength)``: ``JobRequest.steps_run``). Flux's pipelines begin at ``int(steps - steps *
    strength)``, a step earlier where ``steps * strength`` has a fraction: they are handed the middle of
    the strengths that run that count, as the others are handed the job's own."""
    if family != "flux" or strength >= 1:
        return strength
    return (steps_run(steps, strength) - 0.5) / steps


def upscaled(first_pass: Any, size: tuple[int, int], upscaler: str, vae_scale_factor: int
             ) -> torch.Tensor | list[Image.Image]:
    """A hires job's first pass at the larger size: its latents resized bilinearly (as AUTOMATIC1111's
    "Latent" upscaler does), or its images with Lanczos."""
    width, height = size
    if upscaler == "latent":
        sides = (height // vae_scale_factor, width // vae_scale_factor)
        return torch.nn.functional.interpolate(first_pass, size=sides, mode="bilinear", align_corners=False)
    return [image.resize((width, height), Image.Resampling.LANCZOS) for image in first_pass]


def control_images(controls: Sequence[ControlRequest], inputs: Inputs) -> list[Image.Image]:
    """One request's control images in its controls' order, each preprocessed as its control asks."""
    images = [inputs[f"control{index}"] for index in range(len(controls))]
    return [canny(image, control.low, control.high) if control.preprocess == "canny" else image
            for control, image in zip(controls, images, strict=True)]


def nan_rows(latents: torch.Tensor) -> list[bool]:
    """Which rows (images) of a batch's latents hold NaN: a NaN latent decodes to a NaN image, so
    such an image is lost from there on. One read of the device (on a GPU, it waits for the step)."""
    return torch.isnan(latents).flatten(1).any(dim=1).tolist()


def load_pipeline(settings: Settings, model: str | None = None, threads: ThreadChoice | None = None
                  ) -> ImagePipeline:
    """Load a model this worker serves (the first of them by default) onto its device and warm it up
    with a one-step image. ``threads``: a choice calibrated already, by the first model's warm-up."""
    model = model or settings.served_models[0]
    source = settings.source_of(model)
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    threads = threads or ThreadChoice.configured(settings.torch_threads, device)
    if not threads.automatic:
        threads.use(0)  # a fixed count, for the load too
    options = settings.memory_of(model)
    memory.check(options, device)  # before any weight is read: a refusal costs no load
    log.info("loading %s (%s) on %s as %s", model, source, device, dtype)
    diffusers_logging.disable_progress_bar()  # a log file is no place for progress bars
    pipe = _from_disk(settings, model, source, dtype)
    memory.place(pipe, device, options)
    pipe.set_progress_bar_config(disable=True)
    lora_dir = settings.lora_dir_of(model)
    info = model_info(model, family_of(pipe), available_adapters(lora_dir), source)
    adapters = Adapters(lora_dir, settings.lora_cache)
    if settings.compile != "off":
        inductor_cache(settings.cache_dir)  # compiled artefacts kept across restarts
        if lora_dir is not None and info.loras:  # slots filled before compiling: no adapter recompiles
            adapters.slots = AdapterSlots.ready(pipe, lora_dir)
        prepare(pipe, settings.compile, adapters=adapters.slots is not None)
    decoder = load_decoder(settings.preview_decoder, device, dtype) if settings.preview_decoder else None
    controlnets = ControlNets(settings.controlnet_dir, model, settings.controlnet_cache, device, dtype,
                              getattr(pipe, "unet", None))
    loaded = ImagePipeline(pipe=pipe, device=device, samplers=Samplers(pipe.scheduler), info=info,
                           adapters=adapters, controlnets=controlnets,
                           ip_adapters=IpAdapters(settings.ip_adapter_dir, model, settings.ip_adapter_cache),
                           previewer=Previewer(info.family, _scale_factor(pipe), decoder), memory=options)
    loaded.capacity = Capacity.of(device, settings.capacity_pixels)  # the weights loaded, no job yet
    loaded.threads = _warm_up(loaded, threads, settings)
    log.info("loaded %s on %s as %s: %s", model, device, dtype, loaded.threads)
    return loaded


def _from_disk(settings: Settings, model: str, source: str, dtype: torch.dtype) -> DiffusionPipeline:
    """A model's pipeline on the CPU: a model of SLOTQ_MODELS_DIR or a single file (with the VAE file
    its sidecar names), a tiny model, a diffusers folder or a hub id."""
    if settings.folder_model(model) is not None or is_single_file(source):
        return load_folder_model(Path(source), settings.checkpoint_configs, dtype)
    where: str | Path = source
    if source in TINY_VIDEO_MODELS:
        where = ensure_tiny_video_model(settings.cache_dir, source)
    elif source in TINY_MODELS:
        where = ensure_tiny_model(settings.cache_dir, source)
    return DiffusionPipeline.from_pretrained(where, dtype=dtype)


# A warm-up's start image, as a job's request names one (its pixels are passed in, never stored).
_WARM_UP_IMAGE = ImageRef(media_type="image/png", width=0, height=0, bytes=0, sha256="")


def _warm_up(loaded: ImagePipeline, threads: ThreadChoice, settings: Settings) -> ThreadChoice:
    """Run a one-step image (a pipeline's first call is slow); the thread choice, its threshold
    calibrated with a few more images where it is automatic. A compiled pipeline is run at
    SLOTQ_COMPILE_SIZES instead, which compiles it; with none, nothing runs before the first job (which
    compiles it)."""
    side = max(64, loaded.info.side_multiple * 4)
    info = loaded.info
    frames = info.frame_multiple + 1 if info.frame_multiple else None  # a clip's fewest
    # A model that starts every clip from an image warms up from a grey one.
    start = Image.new("RGB", (side, side), (128, 128, 128)) if info.spec.starts_from_image else None
    warm_up = JobRequest(prompt="warm-up", width=side, height=side, steps=info.spec.min_steps, seed=0,
                         frames=frames, fps=info.defaults.fps, image=_WARM_UP_IMAGE if start else None)
    inputs: Inputs = {"image": start} if start else {}
    if settings.compile != "off":
        if settings.warm_sizes:
            compile_sizes(lambda width, height, images: loaded.generate(warm_up.model_copy(
                update={"width": width, "height": height, "num_images": images}), inputs=inputs),
                settings.warm_sizes)
        return threads  # timing threads on a pipeline that may still compile would time the compiler
    loaded.generate(warm_up, inputs=inputs)
    if not threads.automatic or threads.calibration_s is not None:  # calibrated by the first model
        return threads

    def run(size: int, count: int) -> None:
        loaded.threads = ThreadChoice(count, count)  # switched as an execution switches it
        loaded.generate(warm_up.model_copy(update={"width": size, "height": size,
                                                   "steps": CALIBRATION_STEPS}), inputs=inputs)

    return threads.calibrated(run, side, 4 * side)


def _scale_factor(pipe: DiffusionPipeline) -> int:
    """How many pixels a latent is across: an image pipeline's VAE factor (a video pipeline names
    its own differently and has no previews to scale)."""
    return getattr(pipe, "vae_scale_factor", 8)


def family_of(pipe: DiffusionPipeline) -> Family:
    """The model family of a loaded text-to-image pipeline, from its class."""
    name = type(pipe).__name__
    if name not in PIPELINE_CLASSES:
        known = ", ".join(sorted(PIPELINE_CLASSES))
        raise ValueError(f"{name} is not a text-to-image pipeline of a known family ({known})")
    return PIPELINE_CLASSES[name]


_accepted: dict[type, frozenset[str]] = {}


def _parameters(kind: type) -> frozenset[str]:
    """The keyword arguments a pipeline class's ``__call__`` takes (read once a class: inspecting a
    signature is not free)."""
    if kind not in _accepted:
        _accepted[kind] = frozenset(inspect.signature(kind.__call__).parameters)
    return _accepted[kind]


_current: ImagePipeline | None = None


def set_current_pipeline(pipeline: ImagePipeline | None) -> None:
    """Make the loaded pipeline the one every job of this process uses (None: the worker let go of
    its device, worker/models.py; the next job's model is loaded first)."""
    global _current
    _current = pipeline


def loaded_pipeline() -> ImagePipeline | None:
    """The current pipeline; None while the worker has let go of its device."""
    return _current


def current_pipeline() -> ImagePipeline:
    """The pipeline the worker loaded before its loop started."""
    if _current is None:
        raise RuntimeError("no pipeline loaded: jobs run inside `slotq worker`")
    return _current
