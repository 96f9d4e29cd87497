"""The one pipeline every peer that is not slotq serves: the tiny SD model, loaded once with
diffusers' own call (as slotq's worker loads it), run with diffusers' own call on a group of jobs of
one shape, each image from its own seed; the PNG bytes its client receives.

The peers' processes import this module, so it imports torch and diffusers only inside its functions.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROMPT = "a lighthouse at dusk"


def load(cache_dir: Path, threads: int) -> Any:
    """The tiny SD pipeline on the CPU, with ``threads`` torch threads (every peer the same)."""
    import torch
    from diffusers import DiffusionPipeline

    from worker.tiny.model import ensure_tiny_model

    torch.set_num_threads(threads)
    pipe = DiffusionPipeline.from_pretrained(ensure_tiny_model(cache_dir), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def render(pipe: Any, side: int, steps: int, seeds: Sequence[int]) -> list[bytes]:
    """One diffusers call for jobs of one shape, a generator per image; a PNG per job."""
    import torch

    generators = [torch.Generator("cpu").manual_seed(seed) for seed in seeds]
    with torch.inference_mode():
        images = pipe([PROMPT] * len(seeds), width=side, height=side, num_inference_steps=steps,
                      generator=generators).images
    pngs = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        pngs.append(buffer.getvalue())
    return pngs
