"""What image inputs cost, from the door to the worker's memory, each against a text job in the same run.

    python -m bench.images [--size 512] [--checks 300] [--posts 200] [--runs 10] [--steps 4]

Four views, each with its text-only baseline row first:

- **checking**, the API's side without Redis: ``validate_submission`` per call on a text-only body,
  and on bodies with a PNG start image, a JPEG one, and a PNG start image with a PNG mask (Pillow
  reads each header, then decodes each whole, at the door).
- **admitting**, through Flask's WSGI test client on a private ``redis-server``: ``POST /v1/jobs``
  admitted, the inputs' bytes stored beside the job by the admission script. Nothing takes the
  jobs; the database is flushed between rows and every ``CHUNK`` requests (untimed), so that Redis
  holds a bounded amount.
- **the worker's work, in-process**: decoding the stored inputs (``shared.contract.images.decode``)
  against encoding the output PNG (``worker.messages.encode_png``), which every job pays; and the
  GPU section (denoise and decode, as ``ImagePipeline`` records it) of text-to-image,
  image-to-image at strength 1.0 (so the same denoising steps) and inpainting, taking turns.
- **the worker's memory**: VmRSS of a real ``slotq worker`` (its own Redis, one ``slotq api``, the
  tiny model) when ready, after its first text job, its first image-to-image job, its first
  inpainting job and one more job of each kind, all at the same size. ``from_pipe`` shares the
  loaded modules, so an image job must add no second copy of the weights: their size is printed
  beside the figures, and the in-process view counts the distinct tensors across the pipelines.
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw
from redis import Redis

from api.app import create_app
from bench.end_to_end import Body, bench_settings, follow, serving
from bench.memory import finishing_process, memory
from bench.stats import percentiles, timed
from shared.contract import images
from shared.contract.jobs import JobKind, JobRequest, validate_submission
from shared.contract.settings import Settings
from slotq.harness import Service
from slotq.localredis import running_redis

CHUNK = 50  # admitted requests between two (untimed) flushes: about 50 MB of inputs at 512x512
MIB = 2**20


@dataclass(frozen=True)
class Inputs:
    """The same start image as PNG and JPEG, and a mask, as bytes and as the data: URLs clients send."""

    size: int
    png: bytes
    jpeg: bytes
    mask: bytes

    @classmethod
    def of(cls, size: int) -> Inputs:
        return cls(size, encoded(start_image(size), "PNG"), encoded(start_image(size), "JPEG"),
                   encoded(box_mask(size), "PNG"))

    def url(self, name: str) -> str:
        media_type = "jpeg" if name == "jpeg" else "png"
        return f"data:image/{media_type};base64,{base64.b64encode(getattr(self, name)).decode()}"


def start_image(size: int, seed: int = 0) -> Image.Image:
    """A start image with structure (noise over a gradient), as tests/conftest.py makes it."""
    import numpy as np

    rng = np.random.default_rng(seed)
    gradient = np.linspace(0, 255, size, dtype=np.float32)[None, :, None].repeat(size, 0).repeat(3, 2)
    pixels = np.clip(gradient + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def box_mask(size: int) -> Image.Image:
    """A mask that repaints the middle of the image (white) and keeps the rest (black)."""
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle((size // 4, size // 4, 3 * size // 4 - 1, 3 * size // 4 - 1), fill=255)
    return mask


def encoded(image: Image.Image, format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format)
    return buffer.getvalue()


def bodies(inputs: Inputs, steps: int) -> dict[str, Body]:
    """The JSON bodies of a text job, and of image jobs at strength 1.0 (the same denoising steps)."""
    text = {"prompt": "bench", "steps": steps, "seed": 1}
    image = {**text, "strength": 1.0}
    return {"text": {**text, "width": inputs.size, "height": inputs.size},
            "png": {**image, "image": inputs.url("png")},
            "jpeg": {**image, "image": inputs.url("jpeg")},
            "inpaint": {**image, "image": inputs.url("png"), "mask": inputs.url("mask")}}


def row(name: str, times: list[float], baseline: list[float], scale: float, *extra: str) -> str:
    """A row: p50 and p95 in ``scale`` units, the p50 against the baseline's, then ``extra``."""
    (p50, p95, _), (base, _, _) = percentiles(times), percentiles(baseline)
    return (f"{name:36}{scale * p50:>10.1f}{scale * p95:>10.1f}{p50 / base:>9.2f}x"
            + "".join(f"{value:>10}" for value in extra))


def url_kib(body: Body) -> str:
    size = sum(len(body[name]) for name in images.INPUT_NAMES if name in body)
    return f"{size / 1024:.0f}" if size else "-"


ROWS = {"text": "text only (baseline)", "png": "PNG start image", "jpeg": "JPEG start image",
        "inpaint": "PNG start image + PNG mask"}


def checking(settings: Settings, inputs: Inputs, steps: int, checks: int) -> list[str]:
    """``validate_submission`` per call, text-only against each kind of input; the table."""
    batch = bodies(inputs, steps)

    def check(body: Body) -> Callable[[], object]:
        return lambda: validate_submission(body, max_side=settings.max_side, max_steps=settings.max_steps,
                                           max_image_bytes=settings.max_image_bytes)

    times = {kind: timed(check(body), checks) for kind, body in batch.items()}
    lines = [f"checking at the door: validate_submission, {inputs.size}x{inputs.size} inputs, {checks} calls "
             "each, in-process, no Redis",
             f"{'':36}{'p50 us':>10}{'p95 us':>10}{'x text':>10}{'URL KiB':>10}"]
    return lines + [row(ROWS[kind], times[kind], times["text"], 1e6, url_kib(batch[kind])) for kind in times]


def admitting(url: str, scratch: Path, inputs: Inputs, steps: int, posts: int) -> list[str]:
    """POST /v1/jobs admitted through the WSGI test client on a real Redis, by body; the table."""
    settings = Settings(redis_url=url, queue_name="images", queue_capacity=100_000, cache_dir=scratch)
    client = create_app(settings).test_client()
    connection = Redis.from_url(url)
    names = {"text": "POST text job (baseline)", "png": "POST with PNG start image",
             "inpaint": "POST with PNG image + mask"}

    def measure(body: Body) -> list[float]:
        data, times = json.dumps(body), []
        for index in range(posts + 1):  # the first is untimed
            if index % CHUNK == 0:
                connection.flushdb()
            started = time.perf_counter()
            response = client.post("/v1/jobs", data=data, content_type="application/json")
            times.append(time.perf_counter() - started)
            assert response.status_code == 202, response.get_json()
        connection.flushdb()
        return times[1:]

    batch = bodies(inputs, steps)
    times = {kind: measure(batch[kind]) for kind in names}
    lines = [f"admitting: POST /v1/jobs admitted (202), {inputs.size}x{inputs.size} inputs, {posts} requests "
             "each, WSGI test client, one Redis on loopback, nothing takes the jobs",
             f"{'':36}{'p50 ms':>10}{'p95 ms':>10}{'x text':>10}{'body KiB':>10}"]
    return lines + [row(names[kind], times[kind], times["text"], 1e3,
                        f"{len(json.dumps(batch[kind])) / 1024:.0f}") for kind in times]


@dataclass(frozen=True)
class WorkerSide:
    """What the in-process worker side measured: its two tables, its device and the weights' size."""

    lines: list[str]
    device: str
    weights: int  # bytes of the loaded pipeline's tensors


def weight_bytes(*pipes: Any) -> int:
    """The bytes of the distinct tensors the pipelines' modules hold: a shared tensor counts once."""
    import torch

    seen: dict[int, int] = {}
    for pipe in pipes:
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                for tensor in itertools.chain(component.parameters(), component.buffers()):
                    seen[tensor.data_ptr()] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def worker_side(settings: Settings, inputs: Inputs, steps: int, runs: int) -> WorkerSide:
    """Decoding and encoding per image, and the GPU section by kind, on the tiny model; the tables."""
    from worker.messages import encode_png
    from worker.pipeline import load_pipeline

    pipeline = load_pipeline(settings)
    pixels = settings.max_side ** 2
    requests = {kind: validate_submission(body, max_side=settings.max_side, max_steps=settings.max_steps,
                                          max_image_bytes=settings.max_image_bytes).request
                for kind, body in bodies(inputs, steps).items() if kind != "jpeg"}
    decoded = {"image": images.decode(inputs.png, "RGB", pixels),
               "mask": images.decode(inputs.mask, "L", pixels)}
    given = {"text": {}, "png": {"image": decoded["image"]}, "inpaint": decoded}
    before = memory("self")[0]
    twins: tuple[JobKind, ...] = ("image", "inpaint")
    for twin in twins:  # what the first image jobs would make: made here, to weigh it
        pipeline._pipeline_for(twin)
    grown = memory("self")[0] - before
    sections, outputs = gpu_sections(pipeline, requests, given, runs)
    assert all(output[0].size == (inputs.size, inputs.size) for output in outputs.values()), outputs
    text: JobRequest = requests["text"]
    made, level = outputs["text"][0], settings.png_compress_level
    coding = {"encode output PNG (baseline)": timed(lambda: encode_png(made, text, level), runs),
              "decode PNG start image": timed(lambda: images.decode(inputs.png, "RGB", pixels), runs),
              "decode JPEG start image": timed(lambda: images.decode(inputs.jpeg, "RGB", pixels), runs),
              "decode PNG mask": timed(lambda: images.decode(inputs.mask, "L", pixels), runs)}
    encode = coding["encode output PNG (baseline)"]
    names = {"text": "text-to-image (baseline)", "png": "image-to-image", "inpaint": "inpainting"}
    weights = weight_bytes(pipeline.pipe)
    shared = weight_bytes(pipeline.pipe, *pipeline.variants.values())
    lines = [f"the worker's image work, in-process: one {inputs.size}x{inputs.size} image, {runs} calls each",
             f"{'':36}{'p50 ms':>10}{'p95 ms':>10}{'x encode':>10}",
             *(row(name, times, encode, 1e3) for name, times in coding.items()), "",
             f"GPU section (denoise and decode): tiny model on {pipeline.device}, "
             f"{inputs.size}x{inputs.size}, {steps} steps (strength 1.0: the same steps), {runs} turns each",
             f"{'':36}{'p50 ms':>10}{'p95 ms':>10}{'x text':>10}",
             *(row(names[kind], times, sections["text"], 1e3) for kind, times in sections.items()),
             f"weights: {weights / MIB:.2f} MiB in the loaded pipeline, {shared / MIB:.2f} MiB of distinct "
             f"tensors across it and its {len(pipeline.variants)} from_pipe twins; making the twins "
             f"moved this process's VmRSS by {grown / 1024:+.1f} MiB"]
    return WorkerSide(lines, str(pipeline.device), weights)


def gpu_sections(pipeline: Any, requests: dict[str, JobRequest], given: dict[str, dict[str, Image.Image]],
                 runs: int) -> tuple[dict[str, list[float]], dict[str, list[Image.Image]]]:
    """Each kind's GPU sections (seconds) over ``runs`` turns, and its last images."""
    sections: dict[str, list[float]] = {kind: [] for kind in requests}
    outputs: dict[str, list[Image.Image]] = {}
    for run in range(runs + 1):  # in turns, so a slow spell lands on every kind; the first is untimed
        for kind, request in requests.items():
            outputs[kind] = pipeline.generate(request, inputs=given[kind])
            began, ended = pipeline.device_time.sections[-1]
            if run:
                sections[kind].append(ended - began)
    return sections, outputs


def memory_lines(scratch: Path, inputs: Inputs, steps: int, side: WorkerSide,
                 shared: Service | None = None) -> list[str]:
    """A real worker's VmRSS when ready and after its first job of each kind; the table."""
    batch = bodies(inputs, steps)
    with serving(shared, scratch, 1) as service:
        worker = service.worker.pid
        samples = [(memory(worker), memory(finishing_process(worker)))]
        for kinds in (["text"], ["png"], ["inpaint"], ["text", "png", "inpaint"]):
            for kind in kinds:
                follow(service.port, batch[kind], time.monotonic() + 600)
            samples.append((memory(worker), memory(finishing_process(worker))))
    names = ["ready (baseline)", "after 1st text job", "after 1st image-to-image job",
             "after 1st inpainting job", "after a 2nd job of each kind"]
    (ready, _), (finisher_ready, _) = samples[0]
    lines = [f"worker memory: one slotq worker (tiny model on {side.device}), its own Redis and slotq api, "
             f"one job at a time at {inputs.size}x{inputs.size}, {steps} steps; VmRSS in MiB, delta vs "
             f"ready, peak = VmHWM; weights {side.weights / MIB:.2f} MiB (a second copy would add as much)",
             f"{'':36}{'worker':>10}{'delta':>10}{'peak':>10}{'finisher':>10}{'delta':>10}"]
    for name, ((rss, hwm), (finisher, _)) in zip(names, samples, strict=True):
        lines.append(f"{name:36}{rss / 1024:>10.1f}{(rss - ready) / 1024:>+10.1f}{hwm / 1024:>10.1f}"
                     f"{finisher / 1024:>10.1f}{(finisher - finisher_ready) / 1024:>+10.1f}")
    return lines


def report(size: int = 512, checks: int = 300, posts: int = 200, runs: int = 10, steps: int = 4,
           shared: Service | None = None) -> list[str]:
    """The four views on this machine, with one Redis for the admitting view (the worker's memory on
    ``shared``, where given); the tables."""
    inputs = Inputs.of(size)
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        settings = bench_settings(Path(scratch), 1)
        lines = checking(settings, inputs, steps, checks) + [""]
        with running_redis(Path(scratch) / "redis-admit") as url:
            lines += admitting(url, Path(scratch), inputs, steps, posts) + [""]
        side = worker_side(settings, inputs, steps, runs)
        return lines + side.lines + [""] + memory_lines(Path(scratch), inputs, steps, side, shared)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=512, help="the side of every image")
    parser.add_argument("--checks", type=int, default=300, help="validate_submission calls per row")
    parser.add_argument("--posts", type=int, default=200, help="POST /v1/jobs requests per row")
    parser.add_argument("--runs", type=int, default=10, help="pipeline calls, decodes and encodes per row")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print("\n".join(report(args.size, args.checks, args.posts, args.runs, args.steps)))


if __name__ == "__main__":
    main()
