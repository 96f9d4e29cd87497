"""What LoRA adapters cost the worker: loading one, switching between resident ones, and a job with one.

    python -m bench.adapters [--rounds 7] [--size 256] [--jobs 40] [--duty-jobs 30]

In-process, the tiny model and its tiny adapters (worker/tiny/loras.py), through the worker's own
``Adapters`` and ``ImagePipeline``: the GPU section of a bare job (the baseline, measured in this
run) against a job with one resident adapter and with two; then an adapter's load from disk and
unload (``load_lora_weights``, ``delete_adapters``), a switch between two resident adapters
(``set_adapters``) and a switch back to the bare model (``disable_lora``), each the median of
``rounds``; a line of jobs alternating between two adapters, with the claim's affinity off and on;
and bench/gpu.py's duty cycle on a line of jobs that all run one adapter, against the in-process
loop running the same adapter.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from bench.stats import median, timed
from shared.contract.adapters import LoraRef
from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings


def median_ms(action: Callable[[], object], rounds: int) -> float:
    """The median wall time of ``action`` in ms, after one untimed call."""
    return 1000 * median(timed(action, rounds))


def report(rounds: int = 7, size: int = 256, jobs: int = 40, duty_jobs: int = 30, duty_rounds: int = 3,
           duty_ways: Collection[str] = ()) -> list[str]:
    """The four tables: the GPU section with and without adapters, what loading and switching
    cost, what affinity saves on a line of alternating adapters, and the worker's duty cycle on
    LoRA jobs against the in-process loop running the same adapter (``duty_ways``: only those)."""
    from worker.pipeline import load_pipeline
    from worker.tiny.loras import ensure_tiny_loras

    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        folder = ensure_tiny_loras(Path(scratch))
        settings = Settings(cache_dir=Path(scratch), device="cpu", lora_dir=folder, lora_cache=8)
        pipeline = load_pipeline(settings)
        bare, lines = section_lines(pipeline, size, rounds)
        lines += ["", *change_lines(pipeline, folder, bare, rounds)]
    duty = duty_lines(duty_jobs, size, duty_rounds, duty_ways) if duty_jobs else []
    return [*lines, "", *affinity_lines(jobs, min(size, 128)), *([""] + duty if duty else [])]


def section_lines(pipeline: Any, size: int, rounds: int) -> tuple[float, list[str]]:
    """The GPU section of a bare job (its ms, the baseline) and of jobs with one and two resident adapters."""
    def job(*names: str) -> Callable[[], object]:
        loras = [LoraRef(name=name) for name in names]
        request = JobRequest(prompt="bench", width=size, height=size, steps=4, seed=1, loras=loras)
        return lambda: pipeline.generate(request)

    bare = median_ms(job(), rounds)
    lines = [f"GPU section: tiny model on cpu, {size}x{size}, 4 steps, median of {rounds}",
             f"{'':34}{'ms':>10}{'x bare':>10}", f"{'bare model (baseline)':34}{bare:>10.1f}{1:>9.2f}x"]
    for names in (("ink",), ("ink", "neon")):
        took = median_ms(job(*names), rounds)
        label = f"with {' + '.join(names)} (resident)"
        lines.append(f"{label:34}{took:>10.1f}{took / bare:>9.2f}x")
    return bare, lines


def change_lines(pipeline: Any, folder: Path, bare: float, rounds: int) -> list[str]:
    """What loading an adapter and switching between resident ones cost, against a bare job."""
    pipe, adapters, turn = pipeline.pipe, pipeline.adapters, iter(range(10**9))

    def load() -> None:  # under a new name each time, as the worker loads one it has not got
        name = f"moss-{next(turn)}"
        pipe.load_lora_weights(str(folder), weight_name="moss.safetensors", adapter_name=name)
        pipe.delete_adapters(name)

    def switch() -> None:  # ink and neon are resident since the jobs with them
        adapters.use(pipe, [LoraRef(name="ink" if next(turn) % 2 else "neon")])

    def to_bare() -> None:
        adapters.use(pipe, [LoraRef(name="ink")] if next(turn) % 2 else [])

    costs = [("load from disk, then unload", median_ms(load, rounds)),
             ("switch between two resident", median_ms(switch, rounds)),
             ("switch adapter <-> bare model", median_ms(to_bare, rounds))]
    return [f"adapter changes on the same pipeline (diffusers + peft), median of {rounds}",
            f"{'':34}{'ms':>10}{'x bare job':>12}",
            *(f"{label:34}{took:>10.2f}{took / bare:>11.2f}x" for label, took in costs)]


def duty_lines(jobs: int, size: int, rounds: int, ways: Collection[str] = (), steps: int = 4) -> list[str]:
    """bench/gpu.py's duty cycle on a saturated line of jobs that all run adapter `ink`: the
    in-process loop with the same adapter (the ceiling), plain RQ and the slotq worker."""
    from bench import gpu
    from slotq.localredis import running_redis
    from worker.tiny.loras import ensure_tiny_loras

    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch, \
            running_redis(Path(scratch) / "redis") as url:
        settings = Settings(redis_url=url, queue_name="bench", queue_capacity=100_000,
                            cache_dir=Path(scratch) / "models", log_level="WARNING",
                            lora_dir=ensure_tiny_loras(Path(scratch) / "models"))
        batch = [JobRequest(prompt="bench", width=size, height=size, steps=steps, seed=seed,
                            loras=[LoraRef(name="ink", scale=0.8)]) for seed in range(jobs)]
        lines = gpu.duty_cycle(settings, batch, Path(scratch), rounds, only=ways)
    title = lines[0].replace("GPU duty cycle:", "GPU duty cycle, every job with LoRA ink at 0.8:")
    return [title, *lines[1:]]


def affinity_lines(jobs: int = 40, size: int = 128, steps: int = 2) -> list[str]:
    """A line of ``jobs`` alternating between two adapters, queued before the worker starts, run
    through the real claim script and pipeline with affinity off (the baseline) and on: how many
    times the adapters changed between jobs, how many loads from disk (one adapter resident at a
    time, SLOTQ_LORA_CACHE=1, so every change is a load) and images a second."""
    from slotq.localredis import running_redis
    from worker.pipeline import load_pipeline
    from worker.tiny.loras import ensure_tiny_loras

    lines = [f"affinity: {jobs} jobs alternating ink / neon, {size}x{size}, {steps} steps, one adapter "
             "resident (SLOTQ_LORA_CACHE=1), claimed by the claim script, run in-process",
             f"{'':34}{'switches':>10}{'loads':>8}{'img/s':>8}{'x off':>8}"]
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        folder = ensure_tiny_loras(Path(scratch))
        with running_redis(Path(scratch) / "redis") as url:
            settings = Settings(redis_url=url, cache_dir=Path(scratch),
                                device="cpu", lora_dir=folder, lora_cache=1, queue_capacity=jobs + 1)
            pipeline = load_pipeline(settings)
            baseline = 0.0
            for label, skip in (("affinity off (baseline)", 0), ("affinity on, max skip 8", 8)):
                ran, rate = affinity_run(settings, pipeline, skip, jobs, size, steps)
                baseline = baseline or rate
                changes = sum(before != after for before, after in zip(ran, ran[1:], strict=False))
                lines.append(f"{label:34}{changes:>10}{pipeline.adapters.loads:>8}{rate:>8.1f}"
                             f"{rate / baseline:>7.2f}x")
    return lines


def affinity_run(settings: Settings, pipeline: Any, skip: int, jobs: int, size: int, steps: int
                 ) -> tuple[list[str], float]:
    """The alternating line claimed with this affinity's skip and run from no adapter loaded: the
    adapters in the order run, and images a second."""
    from shared.contract.keys import claims_key
    from shared.store import admission, waiting
    from shared.store.connection import connect, job_queue
    from worker.adapters import Adapters

    queue = job_queue(connect(settings), settings)
    if pipeline.adapters.resident:
        pipeline.pipe.delete_adapters(list(pipeline.adapters.resident))
    pipeline.adapters = Adapters(settings.lora_dir, capacity=1)
    for index in range(jobs):
        request = JobRequest(prompt="line", width=size, height=size, steps=steps, seed=index,
                             loras=[LoraRef(name=("ink", "neon")[index % 2])])
        admission.enqueue_job(queue, settings, request)
    ran: list[str] = []
    began = time.perf_counter()
    while (claimed := waiting.claim(queue.connection, settings.line, claims_key("bench"),
                                    waiting.Affinity(skip, *pipeline.adapters.holding))) is not None:
        name = claimed.record[b"adapters"].decode().split(":")[0]
        pipeline.generate(JobRequest(prompt="line", width=size, height=size, steps=steps, seed=1,
                                     loras=[LoraRef(name=name)]))
        ran.append(name)
    rate = jobs / (time.perf_counter() - began)
    queue.connection.delete(claims_key("bench"))
    return ran, rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--jobs", type=int, default=40, help="the alternating line's length")
    parser.add_argument("--duty-jobs", type=int, default=30, help="jobs of the LoRA duty-cycle run (0: skip)")
    parser.add_argument("--duty-rounds", type=int, default=3)
    args = parser.parse_args()
    print("\n".join(report(args.rounds, args.size, args.jobs, args.duty_jobs, args.duty_rounds)))


if __name__ == "__main__":
    main()
