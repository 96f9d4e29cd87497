"""Does the GPU stay busy? Duty cycle, idle gaps and dispatch overhead, each against its baselines.

    python -m bench.gpu [--jobs 60] [--size 256] [--steps 4] [--dispatch-jobs 400] [--rounds 5]

**Duty cycle.** A saturated queue of identical tiny-model jobs (all admitted before the worker
starts). Each pipeline records when its GPU sections (denoise and decode) begin and end; the duty
cycle is their share of the wall time from the first start to the last end, and the gaps are the
idle times between consecutive sections. Run three ways, in this run:

- the in-process loop: the pipeline and PNG encoding back to back in one Python loop (the ceiling);
- a plain RQ ``SimpleWorker`` running ``worker.tasks.generate`` from RQ's own list (what a user
  would write first);
- the slotq worker (``SlotWorker``, burst mode), from slotq's waiting line.

The three take turns for ``--rounds`` rounds and each reports its median round, so a slow spell of
this machine lands on all of them rather than on whichever ran during it. A way's share of the
loop is the median of its per-round shares, each against the loop's run of the same round.

**Dispatch overhead.** The same workers with a pipeline that does no work (one blank image at once),
so the time per job is what taking, starting and recording a job costs; against a bare Redis loop
that moves an id with ``BLMOVE`` and drops it with ``LREM``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from shared.contract.jobs import JobRequest
from shared.contract.models import ModelInfo, model_info
from shared.contract.settings import Settings
from shared.store import admission
from shared.store.connection import connect, job_queue
from slotq.localredis import running_redis
from worker.adapters import Adapters
from worker.previews import Previewer

Sections = list[tuple[float, float]]
LOOP = "in-process loop (ceiling)"
PREVIEWS = "slotq worker, previews"
FILE_STORE = "slotq worker, file store"
CLAIM_AHEAD = "slotq worker, claim ahead "


@dataclass
class NullPipeline:
    """A pipeline that does no work: one blank image per request, at once."""

    sections: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=100_000))
    busy_s: float = 0.0
    running_since: float | None = None
    device: str = "null"  # not a torch device: the worker's metrics name it and ask nothing more
    info: ModelInfo = field(default_factory=lambda: model_info("tiny", "sd"))  # what the jobs are checked for
    adapters: Adapters = field(default_factory=lambda: Adapters(None, 1))  # none: every job is bare
    previewer: Previewer = field(default_factory=lambda: Previewer("sd", 8))  # no job here asks for one

    def generate_batch(self, requests: list[JobRequest], on_step: Callable[[int, int, None], None],
                       inputs: Sequence[Mapping[str, Image.Image]] = ()) -> list[list[Image.Image]]:
        began, first = time.perf_counter(), requests[0]
        for step in range(1, first.steps_run + 1):
            on_step(step, first.steps_run, None)
        self.sections.append((began, time.perf_counter()))
        return [[Image.new("RGB", (r.width, r.height)) for _ in range(r.num_images)] for r in requests]

    def release_memory(self) -> None:
        """Nothing to release."""


@dataclass(frozen=True)
class Figures:
    """What one run measured."""

    jobs: int
    wall: float
    busy: float
    gaps: list[float]

    @classmethod
    def of(cls, sections: Sections) -> Figures:
        sections = sorted(sections)
        gaps = [start - end for (_, end), (start, _) in zip(sections, sections[1:], strict=False)]
        return cls(len(sections), sections[-1][1] - sections[0][0], sum(e - s for s, e in sections), gaps)

    @property
    def per_second(self) -> float:
        return self.jobs / self.wall

    def gap_ms(self, share: float) -> float:
        ordered = sorted(self.gaps) or [0.0]
        return 1000 * ordered[int(share * (len(ordered) - 1))]


def requests(count: int, size: int, steps: int, previews: bool = False) -> list[JobRequest]:
    return [JobRequest(prompt="bench", width=size, height=size, steps=steps, seed=seed, previews=previews)
            for seed in range(count)]


def in_process_loop(settings: Settings, batch: list[JobRequest]) -> Sections:
    """The ceiling: the pipeline and PNG encoding back to back, nothing else."""
    from worker.messages import encode_png
    from worker.pipeline import load_pipeline

    pipeline = load_pipeline(settings)
    pipeline.sections.clear()  # not the warm-up
    for request in batch:
        for image in pipeline.generate(request):
            encode_png(image, request, settings.png_compress_level)
    return list(pipeline.sections)


def through_worker(kind: str, settings: Settings, batch: list[JobRequest], scratch: Path,
                   null: bool = False) -> Sections:
    """Admit the whole batch, then run a worker of this kind in burst mode; its GPU sections."""
    connection = connect(settings)
    connection.flushdb()
    queue = job_queue(connection, settings)
    for request in batch:
        if kind == "slotq":
            admission.enqueue_job(queue, settings, request)
        else:  # RQ's own list, as a user of plain RQ would enqueue it
            queue.enqueue("worker.tasks.generate", kwargs={"request": request.model_dump(mode="json")})
    trace = scratch / f"{kind}-trace.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLOTQ_")}
    env |= {f"SLOTQ_{name.upper()}": json.dumps(value) if isinstance(value, list | dict) else str(value)
            for name, value in settings.model_dump(mode="json").items() if value is not None}
    command = [sys.executable, "-m", "bench.gpu", "--serve", kind, "--trace", str(trace)]
    with (scratch / f"{kind}.log").open("wb") as log:
        done = subprocess.run(command + (["--null"] if null else []), env=env, stdout=log, stderr=log,
                              timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the {kind} worker failed:\n{(scratch / f'{kind}.log').read_text()}")
    sections = [tuple(pair) for pair in json.loads(trace.read_text())]
    return sections[-len(batch):]  # the jobs, not the model's warm-up


def serve(kind: str, trace: Path, null: bool) -> None:
    """In the worker subprocess: run the queue dry, then write the pipeline's GPU sections."""
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    from shared.contract.settings import get_settings
    from worker.main import SlotWorker, connect_worker
    from worker.pipeline import load_pipeline, set_current_pipeline

    logging.basicConfig(level=logging.WARNING)
    settings = get_settings()
    pipeline = NullPipeline() if null else load_pipeline(settings)
    set_current_pipeline(pipeline)  # type: ignore[arg-type]
    if kind == "slotq":
        SlotWorker(job_queue(connect_worker(settings), settings), settings).serve(burst=True)
    else:
        connection = connect(settings, blocking=True)
        queue = Queue(settings.queue_name, connection=connection, serializer=JSONSerializer)
        SimpleWorker([queue], connection=connection, serializer=JSONSerializer).work(burst=True)
    trace.write_text(json.dumps(list(pipeline.sections)))


def bare_loop(settings: Settings, count: int) -> float:
    """Seconds per job for the floor of a reliable Redis queue: BLMOVE into a claims list, LREM."""
    connection = connect(settings, blocking=True)
    connection.flushdb()
    connection.rpush("bench:waiting", *[f"job-{index}" for index in range(count)])
    began = time.perf_counter()
    for _ in range(count):
        job_id = connection.blmove("bench:waiting", "bench:claims", 1, "LEFT", "RIGHT")
        connection.lrem("bench:claims", 1, job_id)
    return (time.perf_counter() - began) / count


def duty_table(title: str, measured: dict[str, list[Figures]]) -> list[str]:
    """Each way's median round, and its share of the loop: the median of its rounds' shares, each
    against the loop's run of the same round (a slow spell of the machine hits both)."""
    loops = measured[LOOP]
    lines = [title, f"{'':30}{'jobs/s':>8}{'% of loop':>11}{'duty':>8}{'gap p50 ms':>12}{'gap p99 ms':>12}"]
    shares: dict[str, list[float]] = {}
    for name, rounds in measured.items():
        shares[name] = sorted(100 * run.per_second / loop.per_second for run, loop in zip(rounds, loops,
                                                                                         strict=True))
        figures = median_round(rounds)
        lines.append(f"{name:30}{figures.per_second:>8.2f}{shares[name][len(rounds) // 2]:>10.1f}%"
                     f"{100 * figures.busy / figures.wall:>7.1f}%{figures.gap_ms(0.5):>12.2f}"
                     f"{figures.gap_ms(0.99):>12.2f}")
    for name in list(measured)[1:]:
        lines.append(f"% of loop by round, {name}: " + " ".join(f"{share:.1f}" for share in shares[name]))
    flipped = [(name, f"claiming ahead {name.removeprefix(CLAIM_AHEAD)}:") for name in measured
               if name.startswith(CLAIM_AHEAD)]
    for name, what in ((FILE_STORE, "the file store's"), (PREVIEWS, "previews'"), *flipped):
        if name in measured:  # against the same worker as it is by default, round by round
            ratios = sorted(100 * run.per_second / plain.per_second
                            for run, plain in zip(measured[name], measured["slotq worker"], strict=True))
            lines.append(f"{what} jobs/s, % of the slotq worker's (median {ratios[len(ratios) // 2]:.1f}) "
                         "by round: " + " ".join(f"{ratio:.1f}" for ratio in ratios))
    return lines


def duty_cycle(settings: Settings, batch: list[JobRequest], scratch: Path, rounds: int = 5,
               claim_ahead_ab: bool = False) -> list[str]:
    """The ways, interleaved for ``rounds`` rounds: the loop, plain RQ, the slotq worker, and the
    slotq worker with its results in a folder, (jobs of two steps or more) with live previews and
    (``claim_ahead_ab``) with claiming ahead the other way from what ``auto`` picks on this device.

    Interleaving spreads the machine's slow spells (other processes, thermal) over all the ways
    instead of letting one of them draw the bad minute; the median drops the odd round out.
    """
    ways: dict[str, Callable[[], Sections]] = {
        LOOP: lambda: in_process_loop(settings, batch),
        "plain RQ SimpleWorker": lambda: through_worker("rq", settings, batch, scratch),
        "slotq worker": lambda: through_worker("slotq", settings, batch, scratch)}
    # The same worker writing its PNGs to a folder (SLOTQ_RESULT_STORE=file://) instead of Redis.
    in_folder = settings.model_copy(update={"result_store": f"file://{scratch / 'results'}"})
    ways[FILE_STORE] = lambda: through_worker("slotq", in_folder, batch, scratch)
    first = batch[0]
    if first.steps > 1:  # a job of one step has no preview
        previewing = [request.model_copy(update={"previews": True}) for request in batch]
        ways[PREVIEWS] = lambda: through_worker("slotq", settings, previewing, scratch)
    if claim_ahead_ab:
        from worker.main import claims_ahead
        from worker.pipeline import resolve_device

        flipped = claims_ahead(settings, resolve_device(settings.device)) != "thread"  # the thread's way
        ways[f"{CLAIM_AHEAD}{'on' if flipped else 'off'}"] = lambda: through_worker(
            "slotq", settings.model_copy(update={"claim_ahead": flipped}), batch, scratch)
    measured: dict[str, list[Figures]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, run in ways.items():
            measured[name].append(Figures.of(run()))
    return duty_table(f"GPU duty cycle: tiny model, {first.width}x{first.height}, {first.steps} steps, "
                      f"{len(batch)} jobs, saturated queue, {rounds} interleaved rounds", measured)


def median_round(rounds: list[Figures]) -> Figures:
    """The round with the median throughput."""
    return sorted(rounds, key=lambda figures: figures.per_second)[len(rounds) // 2]


def dispatch(settings: Settings, count: int, scratch: Path) -> list[str]:
    batch = requests(count, 64, 1)
    runs = {"bare BLMOVE/LREM loop": bare_loop(settings, count),
            "plain RQ SimpleWorker": Figures.of(through_worker("rq", settings, batch, scratch, True)),
            "slotq worker": Figures.of(through_worker("slotq", settings, batch, scratch, True))}
    lines = [f"Dispatch overhead: a pipeline that does no work, {count} jobs", f"{'':30}{'ms/job':>8}"]
    for name, figures in runs.items():
        per_job = figures if isinstance(figures, float) else figures.wall / (figures.jobs - 1)
        lines.append(f"{name:30}{1000 * per_job:>8.2f}")
    return lines


def report(jobs: int = 60, size: int = 256, steps: int = 4, large_jobs: int = 12,
           dispatch_jobs: int = 400, rounds: int = 5, claim_ahead_ab: bool = False) -> list[str]:
    """Every table of this benchmark (a count of 0 skips its run), on a Redis of its own."""
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch, \
            running_redis(Path(scratch) / "redis") as url:
        settings = Settings(redis_url=url, queue_name="bench", queue_capacity=100_000,
                            cache_dir=Path(scratch) / "models", log_level="WARNING", max_steps=1000)
        lines: list[str] = []
        for count, side, denoise in ((jobs, size, steps), (large_jobs, 1024, 1)):
            if count:
                batch = requests(count, side, denoise)
                lines += duty_cycle(settings, batch, Path(scratch), rounds, claim_ahead_ab) + [""]
        if dispatch_jobs:
            lines += dispatch(settings, dispatch_jobs, Path(scratch))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=60, help="jobs of the duty-cycle run (0: skip it)")
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--large-jobs", type=int, default=12, help="jobs of the 1024x1024 run (0: skip it)")
    parser.add_argument("--dispatch-jobs", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the duty-cycle runs")
    parser.add_argument("--claim-ahead-ab", action="store_true",
                        help="also run the slotq worker with SLOTQ_CLAIM_AHEAD the other way from auto's")
    parser.add_argument("--serve", choices=["slotq", "rq"], help=argparse.SUPPRESS)
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--null", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.trace, args.null)
        return
    print("\n".join(report(args.jobs, args.size, args.steps, args.large_jobs, args.dispatch_jobs,
                           args.rounds, args.claim_ahead_ab)))


if __name__ == "__main__":
    main()
