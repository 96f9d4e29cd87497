"""What ControlNets and a hires pass add to a job: its GPU section with one and two ControlNets, a
ControlNet's load from disk, the canny preprocessor, and a hires pass's second pass.

    python -m bench.control [--rounds 7] [--size 256]

In-process, the tiny model and its tiny ControlNets (worker/tiny/controlnets.py), through the worker's
own ``ImagePipeline`` and ``ControlNets``, 4 steps, each figure the median of ``rounds`` after one
untimed call, the rows of a table taking turns in each round (the machine's slow spells land on every
row) and each ratio the median of the rounds' ratios to the table's baseline:

- the GPU section (``pipeline.generate``) of a bare job (the baseline) against the same job with
  ControlNet chalk and with chalk + ember, resident, each with its control image ready;
- a ControlNet switch: a job whose ControlNet is resident (the baseline) against one whose ControlNet
  is dropped first and loaded from disk (as the LRU of SLOTQ_CONTROLNET_CACHE drops one), then
  ``ControlNets.get`` alone: a load from a diffusers folder (chalk), from a single file (chalk-file)
  and a resident lookup; and the canny preprocessor on a picture of the job's size;
- a hires job (``--size`` to twice that, the job's steps at denoise 0.5) against plain jobs at the
  small size (the baseline) and at the large one.

"From disk" is from the page cache: the tiny files were read moments before.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from bench.stats import median, paired_ratio, timed
from shared.contract.images import ImageRef
from shared.contract.jobs import ControlRequest, HiresRequest, JobRequest
from shared.contract.settings import Settings

STEPS = 4
# A job's control image stands in the request as the reference a stored job holds; its pixels are the
# pipeline's inputs (control0, control1), as the worker passes them.
REFERENCE = ImageRef(media_type="image/png", width=64, height=64, bytes=1, sha256="0" * 64)
Row = tuple[str, Callable[[], object]]


def report(rounds: int = 7, size: int = 256) -> list[str]:
    """The three tables: the GPU section with ControlNets, a ControlNet switch (and canny), a hires pass."""
    from worker.pipeline import load_pipeline
    from worker.tiny.controlnets import ensure_tiny_controlnets

    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        folder = ensure_tiny_controlnets(Path(scratch), "tiny") / "tiny"
        pipeline = load_pipeline(Settings(cache_dir=Path(scratch), device="cpu", controlnet_dir=folder))
        return [*section_lines(pipeline, size, rounds), "", *switch_lines(pipeline, size, rounds), "",
                *hires_lines(pipeline, size, rounds)]


def picture(size: int) -> Image.Image:
    """A square and a circle, light on dark: the canny preprocessor's input."""
    image = Image.new("RGB", (size, size), (20, 20, 20))
    draw = ImageDraw.Draw(image)
    draw.rectangle((size // 8, size // 8, size // 2, size // 2), fill=(230, 230, 230))
    draw.ellipse((size // 2, size // 2, size - size // 8, size - size // 8), fill=(200, 60, 60))
    return image


def job(pipeline: Any, size: int, *names: str, hires: HiresRequest | None = None) -> Callable[[], object]:
    """A call of the GPU section: a seeded job with these ControlNets, their control images ready."""
    from worker.controlnets import canny

    edges = canny(picture(size))
    request = JobRequest(prompt="bench", width=size, height=size, steps=STEPS, seed=1, hires=hires,
                         controlnets=[ControlRequest(name=name, image=REFERENCE) for name in names])
    inputs = {f"control{index}": edges for index in range(len(names))}
    return lambda: pipeline.generate(request, inputs=inputs)


def interleaved(rows: Sequence[Row], rounds: int) -> list[list[float]]:
    """Seconds of each row's ``rounds`` calls, the rows taking turns in each round, after one untimed
    call of each."""
    for _, action in rows:
        action()
    times: list[list[float]] = [[] for _ in rows]
    for _ in range(rounds):
        for (_, action), each in zip(rows, times, strict=True):
            each += timed(action, 1, warm_ups=0)
    return times


def table(title: str, rows: Sequence[Row], rounds: int, against: str, digits: int = 1) -> list[str]:
    """A table of ``rows`` timed in turns: each row's median ms and its ratio to the first row's."""
    return rendered(title, [label for label, _ in rows], interleaved(rows, rounds), against, digits)


def rendered(title: str, labels: Sequence[str], times: Sequence[list[float]], against: str, digits: int = 1
             ) -> list[str]:
    """Each row's median ms and the median of its rounds' ratios to the first row's."""
    lines = [title, f"{'':42}{'ms':>10}{against:>12}"]
    for label, each in zip(labels, times, strict=True):
        lines.append(f"{label:42}{1000 * median(each):>10.{digits}f}"
                     f"{paired_ratio(each, times[0]):>11.{max(digits, 2)}f}x")
    return lines


def section_lines(pipeline: Any, size: int, rounds: int) -> list[str]:
    """The GPU section of a bare job (the baseline) and of jobs with one and two resident ControlNets."""
    rows = [("bare job (baseline)", job(pipeline, size)),
            ("with chalk (resident)", job(pipeline, size, "chalk")),
            ("with chalk + ember (resident)", job(pipeline, size, "chalk", "ember"))]
    title = (f"GPU section: tiny model on cpu, {size}x{size}, {STEPS} steps, control images ready, "
             f"median of {rounds} interleaved rounds")
    return table(title, rows, rounds, "x bare")


def switch_lines(pipeline: Any, size: int, rounds: int) -> list[str]:
    """A job whose ControlNet is resident (the baseline) against one whose ControlNet is loaded first,
    ``ControlNets.get`` from disk and resident, and the canny preprocessor at the size."""
    from worker.controlnets import ControlNets, canny

    held = pipeline.controlnets
    nets = ControlNets(held.folder, held.model, held.capacity, held.device, held.dtype, held.unet)
    resident, loaded_first = job(pipeline, size, "chalk"), job(pipeline, size, "chalk")

    def evicted_job() -> None:  # as the LRU drops it for two others, chalk is loaded for the job
        held.resident.pop("chalk", None)
        loaded_first()

    def load(name: str) -> Callable[[], object]:
        def from_disk() -> object:
            nets.resident.pop(name, None)
            return nets.get(name)
        return from_disk

    image = picture(size)
    rows = [("job with chalk resident (baseline)", resident), ("job with chalk loaded first", evicted_job),
            ("load chalk (diffusers folder)", load("chalk")),
            ("load chalk-file (single file)", load("chalk-file")),
            ("lookup of resident chalk", lambda: held.get("chalk")),
            (f"canny preprocessor, {size}x{size}", lambda: canny(image))]
    title = (f"a ControlNet switch (ControlNets.get, SLOTQ_CONTROLNET_CACHE={held.capacity}) and canny, "
             f"{size}x{size} jobs, median of {rounds} interleaved rounds")
    return table(title, rows, rounds, "x job", digits=3)


def hires_lines(pipeline: Any, size: int, rounds: int) -> list[str]:
    """A hires job (size to twice the size) against plain jobs at both sizes; what its second pass adds."""
    hires = HiresRequest(scale=2.0)
    large = 2 * size
    rows = [(f"plain job {size}x{size} (baseline)", job(pipeline, size)),
            (f"plain job {large}x{large}", job(pipeline, large)),
            (f"hires job {size} -> {large}", job(pipeline, size, hires=hires))]
    title = (f"hires pass: {STEPS} steps at {size}x{size}, then latents upscaled to {large}x{large} and "
             f"{int(STEPS * hires.denoise)} of {STEPS} steps there (denoise {hires.denoise}), median of "
             f"{rounds} interleaved rounds")
    times = interleaved(rows, rounds)
    small, plain_large, hired = (1000 * median(each) for each in times)
    return [*rendered(title, [label for label, _ in rows], times, "x small"),
            f"the second pass adds {hired - small:.1f} ms to the job at {size}x{size} "
            f"({(hired - small) / plain_large:.2f} of a plain {large}x{large} job of {STEPS} steps)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--size", type=int, default=256, help="the jobs' side; the hires pass makes twice it")
    args = parser.parse_args()
    print("\n".join(report(args.rounds, args.size)))


if __name__ == "__main__":
    main()
