"""Loading the diffusers pipeline once and running one request through it."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import logging as diffusers_logging
from PIL import Image

from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings
from worker.samplers import Samplers
from worker.tiny_model import ensure_tiny_model

log = logging.getLogger(__name__)

StepCallback = Callable[[int, int], None]
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
    # When each recent GPU section (denoising and decoding) began and ended, by time.perf_counter():
    # what the duty cycle is computed from.
    sections: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=10_000))
    busy_s: float = 0.0  # the sum of every section, the warm-up's included
    running_since: float | None = None  # when the section in progress began

    def generate(self, request: JobRequest, on_step: StepCallback) -> list[Image.Image]:
        """Run one request; ``on_step(step, total)`` runs after each denoising step and may raise."""
        return self.generate_batch([request], on_step)[0]

    def generate_batch(self, requests: list[JobRequest], on_step: StepCallback) -> list[list[Image.Image]]:
        """Run requests that share size, steps, guidance, sampler and image count as one execution;
        the images of each. Each image keeps its own generator, so it is the one it would be alone."""
        first = requests[0]
        assert all(r.batch_key == first.batch_key and r.seed is not None for r in requests), requests

        def step_end(pipe: DiffusionPipeline, step: int, timestep: object, kwargs: dict) -> dict:
            on_step(step + 1, first.steps)
            return kwargs  # diffusers expects the callback's tensors back

        # One CPU generator per image, in diffusers' order (each prompt's images together): image i
        # of a job is reproducible from its seed + i, on any device and in any batch.
        generators = [torch.Generator("cpu").manual_seed(r.seed + index)  # type: ignore[operator]
                      for r in requests for index in range(r.num_images)]
        negatives = [r.negative_prompt or "" for r in requests]  # "" is what diffusers uses for none
        self.pipe.scheduler = self.samplers.get(first.scheduler)
        began = self.running_since = time.perf_counter()
        try:
            with torch.inference_mode():
                output = self.pipe(
                    prompt=[r.prompt for r in requests],
                    negative_prompt=negatives if any(negatives) else None,
                    width=first.width,
                    height=first.height,
                    num_inference_steps=first.steps,
                    guidance_scale=first.guidance_scale,
                    num_images_per_prompt=first.num_images,
                    generator=generators,
                    output_type="pil",
                    callback_on_step_end=step_end,
                )
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the section ends when the device is done
        finally:  # a canceled or failed execution held the device too
            ended = time.perf_counter()
            self.sections.append((began, ended))
            self.busy_s += ended - began
            self.running_since = None
        images, per_job = list(output.images), first.num_images
        return [images[index * per_job:(index + 1) * per_job] for index in range(len(requests))]

    def release_memory(self) -> None:
        """Give cached device memory back after a failure such as out-of-memory."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def load_pipeline(settings: Settings) -> ImagePipeline:
    """Load the configured model onto its device and warm it up with a one-step image."""
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    source: str | Path = settings.model
    if settings.model == "tiny":
        source = ensure_tiny_model(settings.cache_dir)
    log.info("loading %s on %s as %s", source, device, dtype)
    diffusers_logging.disable_progress_bar()  # a log file is no place for progress bars
    pipe = DiffusionPipeline.from_pretrained(source, dtype=dtype)
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    loaded = ImagePipeline(pipe=pipe, device=device, samplers=Samplers(pipe.scheduler))
    warm_up = JobRequest(prompt="warm-up", width=64, height=64, steps=1, seed=0)
    loaded.generate(warm_up, on_step=lambda step, total: None)
    return loaded


_current: ImagePipeline | None = None


def set_current_pipeline(pipeline: ImagePipeline) -> None:
    """Make the loaded pipeline the one every job of this process uses."""
    global _current
    _current = pipeline


def current_pipeline() -> ImagePipeline:
    """The pipeline the worker loaded before its loop started."""
    if _current is None:
        raise RuntimeError("no pipeline loaded: jobs run inside `slotq worker`")
    return _current
