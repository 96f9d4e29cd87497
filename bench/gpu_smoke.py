"""The worker end to end on a real accelerator: every tiny family and dtype, a cancel, a LoRA, an OOM.

    python -m bench.gpu_smoke [--device cuda] [--side 256] [--big-side 1024] [--json FILE]

What a GPU host should check once, since CI has no GPU. It starts its own ``redis-server`` and one
``slotq api``, then one ``slotq worker`` after another on the device, and through the HTTP API:

- **each case** (the tiny SD in float32, float16 and bfloat16, the tiny SDXL in float16, the tiny
  Flux in bfloat16): the worker loads and registers; a 64×64 and a ``--side`` job succeed with
  images that decode, have the asked size and are not flat (a NaN in half precision paints black);
  a LoRA (``ink`` at 0.5) changes the image and the same job without it gives the first image
  back; at scale 2 the job either makes an image or fails ``nan_output`` (half precision can
  overflow), never a black image called a success; how far each SD case's image lands from the
  earlier cases' of the same seed is printed (on a GPU host the SD cases begin with the same
  model in float32 on the CPU: does a seed give the same image on either device, in each dtype?);
- **a cancel mid-run** (SD, float16): a long job is canceled once it reports a step; it ends
  ``canceled`` before its last step and the worker runs the next job;
- **a real out-of-memory**: the device memory that a small and a large job (``--big-side``, four
  images) take is read from the worker's metrics; a worker whose allocator is capped between the
  two (``torch.cuda.set_per_process_memory_fraction``) fails the large job with ``out_of_memory``
  and, the same process, then runs a small one;
- **sharing the device** (worker/sharing.py): a worker with ``SLOTQ_YIELD_BELOW_MB`` set yields when
  this process takes the device's memory (its model goes to host memory, a job waits), and comes
  back once it is freed, the waiting job's model brought back from host memory; then, idle for
  ``SLOTQ_IDLE_RELEASE_S``, it lets go again.

Each check prints one line, ``ok`` or ``FAILED``; the exit code is 1 if any failed. Figures (load
time, seconds a job, memory) are printed beside them. On the CPU the out-of-memory and sharing checks
are skipped.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from bench.end_to_end import Body, call, ended, submit
from shared.contract.jobs import JobStatus
from shared.contract.settings import Settings
from slotq import harness
from slotq.localredis import free_port

START_TIMEOUT_S = 300.0
JOB_TIMEOUT_S = 300.0
CANCEL_STEPS = 1000  # long enough on any device for the cancel to land mid-run


@dataclass(frozen=True)
class Case:
    """One worker to start: the name it serves, the tiny model it loads, its dtype."""

    name: str
    model: str
    dtype: str
    family: str
    device: str | None = None  # None: the smoke's --device


CASES = (Case("sd-fp32", "tiny", "float32", "sd"), Case("sd-fp16", "tiny", "float16", "sd"),
         Case("sd-bf16", "tiny", "bfloat16", "sd"), Case("xl-fp16", "tiny-sdxl", "float16", "sdxl"),
         Case("flux-bf16", "tiny-flux", "bfloat16", "flux"))
# On a GPU host, first the same SD job on the CPU: how far each dtype on the device lands from it.
CPU_REFERENCE = Case("sd-cpu-fp32", "tiny", "float32", "sd", device="cpu")
TINY_SD = frozenset(case.name for case in (CPU_REFERENCE, *CASES) if case.model == "tiny")  # compared
MAIN = "sd-fp16"  # the case that also runs the cancel, and whose memory sizes the capped worker


@dataclass
class Checks:
    """The checks' lines, in order, and whether any failed."""

    lines: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    failed: int = 0

    def check(self, what: str, passed: bool, detail: str = "") -> bool:
        self.failed += not passed
        self.say(f"{'ok    ' if passed else 'FAILED'} {what}{': ' + detail if detail else ''}")
        return passed

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)


@dataclass(frozen=True)
class RunningWorker:
    """A started worker: its process, its metrics' port, the seconds it took to load and register."""

    process: harness.Process
    metrics_port: int
    load_s: float

    def metric(self, name: str) -> float:
        """One unlabelled sample of the worker's Prometheus metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as page:
            for line in page.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise KeyError(name)


@contextmanager
def worker(settings: Settings, case: Case, scratch: Path, memory_cap: int | None = None
           ) -> Iterator[RunningWorker]:
    """One ``slotq worker`` for this case, registered; stopped on the way out."""
    port = free_port()
    settings = settings.model_copy(update={"model": case.model, "model_name": case.name, "dtype": case.dtype,
                                           "device": case.device or settings.device,
                                           "worker_metrics_port": port, "worker_name": f"smoke-{case.name}"})
    # The capped worker is this module, which caps the device's memory and then runs the worker.
    args, module = (["--capped-worker", str(memory_cap)], "bench.gpu_smoke") if memory_cap else (
        ["worker"], "slotq.cli")
    log = scratch / f"worker-{case.name}{'-capped' if memory_cap else ''}.log"
    began = time.monotonic()
    process = harness.spawn(args, harness.slotq_env(settings), log, module=module)
    try:
        harness.wait_workers([process], settings.redis_url, START_TIMEOUT_S)
        yield RunningWorker(process, port, time.monotonic() - began)
    finally:
        process.stop()


def run_job(port: int, body: Body) -> tuple[Body, list[np.ndarray]]:
    """Submit, wait for the end, fetch every image (none unless it succeeded)."""
    view = ended(port, submit(port, body), time.monotonic() + JOB_TIMEOUT_S)
    images = []
    if view["status"] == JobStatus.SUCCEEDED:
        for index in range(len(view["images"])):
            status, png = call(port, "GET", f"/v1/jobs/{view['id']}/images/{index}")
            if status != 200:
                raise RuntimeError(f"GET image {index} of {view['id']} answered {status}")
            images.append(np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float32))
    return view, images


def seconds(view: Body) -> float:
    """From the job's start to its end, as its record says."""
    return (datetime.fromisoformat(view["finished_at"]) - datetime.fromisoformat(view["started_at"])
            ).total_seconds()


def job(model: str, side: int, seed: int = 1, steps: int = 4, **extra: Any) -> Body:
    return {"prompt": "a lighthouse at dusk", "model": model, "width": side, "height": side, "steps": steps,
            "seed": seed, **extra}


def image_check(checks: Checks, what: str, view: Body, images: list[np.ndarray], side: int) -> bool:
    succeeded = view["status"] == JobStatus.SUCCEEDED
    ending = "" if succeeded else f"{view['status']} {view.get('error')}"
    if not checks.check(f"{what} succeeded", succeeded, ending):
        return False
    image = images[0]
    return checks.check(f"{what}: a {side}x{side} image, not flat",
                        image.shape == (side, side, 3) and float(image.std()) > 2.0,
                        f"shape {image.shape}, std {image.std():.1f}, {seconds(view) * 1000:.0f} ms")


def run_case(checks: Checks, port: int, settings: Settings, case: Case, side: int, scratch: Path,
             references: dict[str, np.ndarray]) -> None:
    """A case's checks; the main case's device memory goes into ``checks.figures``."""
    with worker(settings, case, scratch) as running:
        checks.say(f"-- {case.name}: {case.model} in {case.dtype}, loaded and registered in "
                   f"{running.load_s:.1f} s")
        for size in (64, side):
            view, images = run_job(port, job(case.name, size))
            if image_check(checks, f"{case.name} {size}x{size}", view, images, size) and size == side:
                references[case.name] = images[0]
        if case.name in TINY_SD and case.name in references:
            for earlier in [name for name in references if name in TINY_SD and name != case.name]:
                difference = float(np.abs(references[case.name] - references[earlier]).mean())
                checks.say(f"   against {earlier}'s image of the same seed: mean |difference| "
                           f"{difference:.2f} of 255")
        lora_check(checks, port, case, side, references.get(case.name))
        if case.name == MAIN:
            memory_figures(checks, port, case, running)  # before the cancel's large job
            cancel_check(checks, port, case, checks.figures["big_side"])


def lora_check(checks: Checks, port: int, case: Case, side: int, plain: np.ndarray | None) -> None:
    """The LoRA at scale 0.5 changes the image and leaves none of itself behind; at scale 2 (the most a
    job may ask) an image either stays finite or its job fails ``nan_output``, never a black success."""
    if plain is None:
        return
    view, images = run_job(port, job(case.name, side, loras=[{"name": "ink", "scale": 0.5}]))
    if not image_check(checks, f"{case.name} with LoRA ink at 0.5", view, images, side):
        return
    again_view, again = run_job(port, job(case.name, side))
    if not image_check(checks, f"{case.name} without it again", again_view, again, side):
        return
    moved = float(np.abs(images[0] - plain).mean())
    back = float(np.abs(again[0] - plain).mean())
    checks.check(f"{case.name}: the LoRA changes the image, and without it the first image is back",
                 moved > 2.0 and back < moved / 10,
                 f"mean |difference| {moved:.2f} with it, {back:.3f} after")
    strong, images = run_job(port, job(case.name, side, loras=[{"name": "ink", "scale": 2.0}]))
    code = (strong.get("error") or {}).get("code")
    finite = strong["status"] == JobStatus.SUCCEEDED and float(images[0].std()) > 2.0
    seen = f", {code}" if code else f", std {images[0].std():.1f}" if images else ""
    checks.check(f"{case.name} with LoRA ink at 2: an image, or the job fails nan_output",
                 finite or (strong["status"] == JobStatus.FAILED and code == "nan_output"),
                 f"{strong['status']}{seen}")


def cancel_check(checks: Checks, port: int, case: Case, side: int) -> None:
    steps = CANCEL_STEPS
    view = submit(port, job(case.name, side, steps=steps, num_images=4))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (view.get("progress") and view["progress"]["step"] >= 1) and time.monotonic() < deadline:
        if JobStatus(view["status"]).is_terminal:
            break
        time.sleep(0.02)  # a plain GET: a long poll returns on a change of status, not of step
        view = json.loads(call(port, "GET", f"/v1/jobs/{view['id']}")[1])
    asked = time.monotonic()
    status, _ = call(port, "DELETE", f"/v1/jobs/{view['id']}")
    final = ended(port, view, time.monotonic() + JOB_TIMEOUT_S)
    took = time.monotonic() - asked
    step = (final.get("progress") or {}).get("step")
    checks.check(f"{case.name}: a {steps}-step {side}x{side} job of 4 images canceled mid-run",
                 status in (200, 202) and final["status"] == JobStatus.CANCELED,
                 f"DELETE {status}, ended {final['status']} at step {step} of {steps}, {took * 1000:.0f} ms "
                 "after the DELETE")
    after, images = run_job(port, job(case.name, 64, seed=5))
    image_check(checks, f"{case.name}: the next job after the cancel", after, images, 64)


def memory_figures(checks: Checks, port: int, case: Case, running: RunningWorker) -> None:
    """The device memory a small and a large job take (the worker's peak), for the capped worker."""
    if not checks.figures.get("cuda"):
        return
    small = running.metric("slotq_cuda_memory_peak_bytes")
    view, images = run_job(port, job(case.name, checks.figures["big_side"], steps=1, num_images=4))
    image_check(checks, f"{case.name}: {checks.figures['big_side']}px, 4 images", view, images,
                checks.figures["big_side"])
    large = running.metric("slotq_cuda_memory_peak_bytes")
    checks.figures |= {"peak_small_bytes": small, "peak_large_bytes": large}
    checks.say(f"   device memory at its peak: {small / 2**20:.0f} MiB after the small jobs, "
               f"{large / 2**20:.0f} MiB after the large one")


def oom_check(checks: Checks, port: int, settings: Settings, scratch: Path) -> None:
    small, large = checks.figures.get("peak_small_bytes"), checks.figures.get("peak_large_bytes")
    if not (small and large and large > 1.5 * small):
        checks.check("a real out-of-memory", False, f"no room between the peaks ({small}, {large})")
        return
    cap = int((small + large) / 2)
    case = next(case for case in CASES if case.name == MAIN)
    with worker(settings, case, scratch, memory_cap=cap) as running:
        side = checks.figures["big_side"]
        view, _ = run_job(port, job(case.name, side, steps=1, num_images=4))
        code = (view.get("error") or {}).get("code")
        checks.check(f"capped at {cap / 2**20:.0f} MiB, the large job fails with out_of_memory",
                     view["status"] == JobStatus.FAILED and code == "out_of_memory",
                     f"{view['status']}, {code}")
        after, images = run_job(port, job(case.name, 64, seed=9))
        image_check(checks, "the same worker process then runs a small job", after, images, 64)
        checks.check("the capped worker is still the same live process",
                     running.process.popen.poll() is None and after.get("worker") == view.get("worker"),
                     f"pid {running.process.pid}, worker {after.get('worker')}")


YIELD_BELOW_MB = 1024  # the sharing check's threshold: this process leaves half of it free
IDLE_RELEASE_S = 5.0


def sharing_check(checks: Checks, port: int, settings: Settings, scratch: Path) -> None:
    """A worker yields the device while this process holds its memory and comes back once it is freed;
    idle, it lets go again (figures: how long each took)."""
    import torch

    case = next(case for case in CASES if case.name == MAIN)
    sharing = settings.model_copy(update={"yield_below_mb": YIELD_BELOW_MB, "idle_release_s": IDLE_RELEASE_S})
    with worker(sharing, case, scratch):
        view, images = run_job(port, job(case.name, 64))
        image_check(checks, f"{case.name}, yielding below {YIELD_BELOW_MB} MB: a job", view, images, 64)
        free, _ = torch.cuda.mem_get_info(settings.device)
        taken_at = time.monotonic()
        hog = torch.empty(free - YIELD_BELOW_MB * 2**20 // 2, dtype=torch.uint8, device=settings.device)
        try:
            place = wait_place(port, case.name, "in_host")
            checks.check("another process takes the device's memory: the worker yields, its model to host "
                         "memory", place == "in_host", f"{place} after {time.monotonic() - taken_at:.1f} s")
            waiting = submit(port, job(case.name, 64, seed=3))
            time.sleep(3)
            status = json.loads(call(port, "GET", f"/v1/jobs/{waiting['id']}")[1])["status"]
            checks.check("while it yields, a job waits", status == JobStatus.QUEUED, status)
        finally:
            del hog
            torch.cuda.empty_cache()
        back = ended(port, waiting, time.monotonic() + JOB_TIMEOUT_S)
        load = back.get("model_load") or {}
        checks.check("the memory freed, it comes back and runs the waiting job, its model from host memory",
                     back["status"] == JobStatus.SUCCEEDED and load.get("source") == "host",
                     f"{back['status']}, model_load {load}")
        wait_place(port, case.name, "on_device")  # a heartbeat after the job, not the one before it
        idle_at = time.monotonic()
        place = wait_place(port, case.name, "in_host")
        checks.check(f"idle for {IDLE_RELEASE_S:g} s, it lets go of the device again", place == "in_host",
                     f"{place} after {time.monotonic() - idle_at:.1f} s")


def wait_place(port: int, model: str, place: str, timeout: float = 60.0) -> str | None:
    """Where the worker's heartbeat says its model is, once it says ``place`` or at the timeout."""
    deadline, seen = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        for view in json.loads(call(port, "GET", "/v1/workers")[1])["workers"]:
            places = view.get("model_places", [])
            seen = next((each["place"] for each in places if each["model"] == model), seen)
        if seen == place:
            return seen
        time.sleep(0.25)
    return seen


def lora_folder(cache_dir: Path, into: Path, cases: tuple[Case, ...]) -> Path:
    """Each case's adapters in a subfolder named after it, as SLOTQ_LORA_DIR serves them."""
    from worker.tiny.loras import ensure_tiny_loras

    for case in cases:
        shutil.copytree(ensure_tiny_loras(cache_dir, case.model), into / case.name, dirs_exist_ok=True)
    return into


def smoke(device: str, side: int, big_side: int, logs: Path | None = None) -> Checks:
    """Every check, on a Redis and an API of the smoke's own (the workers come and go); the checks."""
    import torch

    checks = Checks(figures={"cuda": device.startswith("cuda"), "big_side": big_side})
    if checks.figures["cuda"]:
        checks.say(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    cases = ((CPU_REFERENCE,) if checks.figures["cuda"] else ()) + CASES
    with tempfile.TemporaryDirectory(prefix="slotq-smoke-") as folder:
        scratch = Path(folder)
        try:
            with harness.service(smoke_settings(device, scratch, cases), scratch, workers=0) as service:
                run_checks(checks, service, cases, side, scratch)
        finally:
            if logs:
                logs.mkdir(parents=True, exist_ok=True)
                for log in scratch.glob("*.log"):
                    shutil.copy(log, logs / log.name)
    return checks


def smoke_settings(device: str, scratch: Path, cases: tuple[Case, ...]) -> Settings:
    """Every case's name served by the API, each with its tiny adapters; jobs as long as the cancel's."""
    models = scratch / "models"
    names = [f"{case.name}={case.family}" for case in cases]
    return Settings(cache_dir=models, device=device, log_level="INFO", drain_s=0, model_names=names,
                    lora_dir=lora_folder(models, scratch / "loras", cases), max_steps=CANCEL_STEPS)


def run_checks(checks: Checks, service: harness.Service, cases: tuple[Case, ...], side: int,
               scratch: Path) -> None:
    """Each case's checks, then the out-of-memory check on a GPU; an error fails only its own part."""
    references: dict[str, np.ndarray] = {}
    for case in cases:
        try:
            run_case(checks, service.port, service.settings, case, side, scratch, references)
        except (RuntimeError, TimeoutError, OSError) as error:
            checks.check(f"{case.name}", False, str(error)[-1500:])
    if not checks.figures["cuda"]:
        checks.say("-- out-of-memory: skipped on the CPU")
        checks.say("-- sharing the device: skipped on the CPU")
        return
    try:
        oom_check(checks, service.port, service.settings, scratch)
    except (RuntimeError, TimeoutError, OSError) as error:
        checks.check("a real out-of-memory", False, str(error)[-1500:])
    try:
        sharing_check(checks, service.port, service.settings, scratch)
    except (RuntimeError, TimeoutError, OSError) as error:
        checks.check("sharing the device", False, str(error)[-1500:])


def capped_worker(cap: int) -> int:
    """In the worker subprocess: cap this process's device memory, then run the worker as usual."""
    import torch

    from worker.__main__ import main as worker_main

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total)
    return worker_main([])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--side", type=int, default=256, help="the size of each case's second job and LoRA")
    parser.add_argument("--big-side", type=int, default=1024, help="the large job of the memory check")
    parser.add_argument("--json", type=Path, help="also write the lines and figures here")
    parser.add_argument("--logs", type=Path, help="copy the processes' logs into this folder")
    parser.add_argument("--capped-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.capped_worker:
        raise SystemExit(capped_worker(args.capped_worker))
    checks = smoke(args.device, args.side, args.big_side, args.logs)
    print(f"{len(checks.lines)} lines, {checks.failed} failed")
    if args.json:
        args.json.write_text(json.dumps({"lines": checks.lines, "figures": checks.figures}, indent=2))
    raise SystemExit(1 if checks.failed else 0)


if __name__ == "__main__":
    main()
