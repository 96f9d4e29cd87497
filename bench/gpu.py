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
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

from bench.stats import median, median_item, percentile, ratios
from shared.contract.jobs import JobRequest
from shared.contract.models import ModelInfo, model_info
from shared.contract.settings import Settings
from shared.store import admission
from shared.store.connection import connect, job_queue
from slotq.harness import slotq_env
from slotq.localredis import running_redis
from worker.adapters import Adapters
from worker.capacity import Capacity
from worker.device_time import DeviceTime
from worker.previews import Previewer
from worker.threads import ThreadChoice

Sections = list[tuple[float, float]]
LOOP = "in-process loop (ceiling)"
PREVIEWS = "slotq worker, previews"
FILE_STORE = "slotq worker, file store"
CLAIM_AHEAD = "slotq worker, claim ahead "


@dataclass
class NullPipeline:
    """A pipeline that does no work: one blank image per request, at once."""

    device_time: DeviceTime = field(default_factory=lambda: DeviceTime(deque(maxlen=100_000)))
    device: str = "null"  # not a torch device: the worker's metrics name it and ask nothing more
    threads: ThreadChoice = field(default_factory=lambda: ThreadChoice(0, 0))  # torch's: left as they are
    info: ModelInfo = field(default_factory=lambda: model_info("tiny", "sd"))  # what the jobs are checked for
    adapters: Adapters = field(default_factory=lambda: Adapters(None, 1))  # none: every job is bare
    previewer: Previewer = field(default_factory=lambda: Previewer("sd", 8))  # no job here asks for one
    capacity: Capacity = field(default_factory=Capacity)  # no bound: the worker's heartbeat says none

    def generate_batch(self, requests: list[JobRequest], on_step: Callable[[int, int, None], None],
                       inputs: Sequence[Mapping[str, Image.Image]] = (), resume: object = None,
                       checkpoint: object = None) -> list[list[Image.Image]]:
        began, first = time.perf_counter(), requests[0]
        for step in range(1, first.steps_run + 1):
            on_step(step, first.steps_run, None)
        self.device_time.sections.append((began, time.perf_counter()))
        return [[Image.new("RGB", (r.width, r.height)) for _ in range(r.num_images)] for r in requests]

    @property
    def holding(self) -> tuple[str, tuple[str, ...]]:
        """What the claim's affinity prefers: nothing (every job is bare)."""
        return self.adapters.holding

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
        return 1000 * percentile(self.gaps or [0.0], share)


def requests(count: int, size: int, steps: int, previews: bool = False) -> list[JobRequest]:
    return [JobRequest(prompt="bench", width=size, height=size, steps=steps, seed=seed, previews=previews)
            for seed in range(count)]


def in_process_loop(settings: Settings, batch: list[JobRequest]) -> Sections:
    """The ceiling: the pipeline and PNG encoding back to back, nothing else."""
    from worker.messages import encode_png
    from worker.pipeline import load_pipeline

    pipeline = load_pipeline(settings)
    pipeline.device_time.sections.clear()  # not the warm-up
    for request in batch:
        for image in pipeline.generate(request):
            encode_png(image, request, settings.png_compress_level)
    return list(pipeline.device_time.sections)


@dataclass(frozen=True)
class WorkerRun:
    """One burst worker's run: its kind (slotq or plain RQ), its settings and jobs, and whether its
    pipeline does no work."""

    kind: str
    settings: Settings
    batch: list[JobRequest]
    null: bool = False

    def plan(self, trace: Path) -> dict[str, Any]:
        """The run as the worker process reads it, with where it writes its GPU sections."""
        env = {key: value for key, value in slotq_env(self.settings).items() if key.startswith("SLOTQ_")}
        return {"kind": self.kind, "null": self.null, "env": env, "trace": str(trace),
                "batch": [request.model_dump(mode="json") for request in self.batch]}


def through_workers(runs: Sequence[WorkerRun], scratch: Path) -> list[Sections]:
    """The runs in turn in one worker process, each queuing its jobs, then running the line dry in
    burst mode; each run's GPU sections."""
    plan, log = scratch / "plan.json", scratch / "worker.log"
    traces = [scratch / f"trace-{index}.json" for index in range(len(runs))]
    plan.write_text(json.dumps([run.plan(trace) for run, trace in zip(runs, traces, strict=True)]))
    with log.open("wb") as out:
        done = subprocess.run([sys.executable, "-m", "bench.gpu", "--serve", str(plan)],
                              env=slotq_env(runs[0].settings), stdout=out, stderr=out, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the worker failed:\n{log.read_text()}")
    return [[tuple(pair) for pair in json.loads(trace.read_text())][-len(run.batch):]  # not a warm-up
            for run, trace in zip(runs, traces, strict=True)]


def each_through_workers(runs: Sequence[WorkerRun], scratch: Path, one_process: bool) -> list[Sections]:
    """The runs in one worker process, or each in a fresh one of its own (as a worker starts)."""
    if one_process:
        return through_workers(runs, scratch)
    return [through_workers([run], scratch)[0] for run in runs]


def serve(plan: Path) -> None:
    """In the worker subprocess: each run of the plan in turn, then its pipeline's GPU sections written."""
    from shared.contract.settings import get_settings
    from worker.pipeline import load_pipeline, set_current_pipeline

    logging.basicConfig(level=logging.WARNING)
    for run in json.loads(plan.read_text()):
        # The worker's code reads its settings once, from the environment (its finishing process
        # too): each run's are put there, and read again.
        for key in [key for key in os.environ if key.startswith("SLOTQ_")]:
            del os.environ[key]
        os.environ.update(run["env"])
        get_settings.cache_clear()
        settings = get_settings()
        queue_jobs(run["kind"], settings, [JobRequest.model_validate(request) for request in run["batch"]])
        pipeline = NullPipeline() if run["null"] else load_pipeline(settings)
        set_current_pipeline(pipeline)  # type: ignore[arg-type]
        serve_burst(run["kind"], settings)
        Path(run["trace"]).write_text(json.dumps(list(pipeline.device_time.sections)))


def queue_jobs(kind: str, settings: Settings, batch: list[JobRequest]) -> None:
    """The whole batch waiting, on an empty database, as each kind of worker takes it."""
    connection = connect(settings)
    connection.flushdb()
    queue = job_queue(connection, settings)
    for request in batch:
        if kind == "slotq":
            admission.enqueue_job(queue, settings, request)
        else:  # RQ's own list, as a user of plain RQ would enqueue it
            queue.enqueue("worker.tasks.generate", kwargs={"request": request.model_dump(mode="json")})


def serve_burst(kind: str, settings: Settings) -> None:
    """A worker of this kind in burst mode: until its line is dry."""
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    from worker.main import SlotWorker, connect_worker

    if kind == "slotq":
        SlotWorker(job_queue(connect_worker(settings), settings), settings).serve(burst=True)
        return
    class BurstWorker(SimpleWorker):  # type: ignore[misc]
        """Plain RQ's worker without its command channel, which a burst run never hears from."""

        def subscribe(self) -> None:
            # Unsubscribing stops the listening thread, and redis-py 8's stop() waits for it: up to
            # RQ's 60 s poll once the channel is gone, a minute added to every run's end.
            pass

    connection = connect(settings, blocking=True)
    queue = Queue(settings.queue_name, connection=connection, serializer=JSONSerializer)
    BurstWorker([queue], connection=connection, serializer=JSONSerializer).work(burst=True)


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
    def shares(name: str, base: str) -> list[float]:
        return [100 * share for share in ratios(per_second(measured[name]), per_second(measured[base]))]

    lines = [title, f"{'':30}{'jobs/s':>8}{'% of loop':>11}{'duty':>8}{'gap p50 ms':>12}{'gap p99 ms':>12}"]
    for name, rounds in measured.items():
        figures = median_item(rounds, lambda run: run.per_second)
        lines.append(f"{name:30}{figures.per_second:>8.2f}{median(shares(name, LOOP)):>10.1f}%"
                     f"{100 * figures.busy / figures.wall:>7.1f}%{figures.gap_ms(0.5):>12.2f}"
                     f"{figures.gap_ms(0.99):>12.2f}")
    for name in list(measured)[1:]:
        by_round = " ".join(f"{share:.1f}" for share in shares(name, LOOP))
        lines.append(f"% of loop by round, {name}: {by_round}")
    flipped = [(name, f"claiming ahead {name.removeprefix(CLAIM_AHEAD)}:") for name in measured
               if name.startswith(CLAIM_AHEAD)]
    for name, what in ((FILE_STORE, "the file store's"), (PREVIEWS, "previews'"), *flipped):
        if name in measured:  # against the same worker as it is by default, round by round
            against = shares(name, "slotq worker")
            lines.append(f"{what} jobs/s, % of the slotq worker's (median {median(against):.1f}) "
                         "by round: " + " ".join(f"{ratio:.1f}" for ratio in against))
    return lines


def per_second(rounds: list[Figures]) -> list[float]:
    return [run.per_second for run in rounds]


def duty_cycle(settings: Settings, batch: list[JobRequest], scratch: Path, rounds: int = 5,
               claim_ahead_ab: bool = False, only: Collection[str] = (), one_process: bool = False
               ) -> list[str]:
    """The loop and the :func:`worker_ways` (``only`` those that it names, where it names some),
    interleaved for ``rounds`` rounds, the worker ways of a round in one process with ``one_process``.

    Interleaving spreads the machine's slow spells (other processes, thermal) over all the ways
    instead of letting one of them draw the bad minute; the median drops the odd round out.
    """
    ways = {name: run for name, run in worker_ways(settings, batch, scratch, claim_ahead_ab).items()
            if name in only or not only}
    measured: dict[str, list[Figures]] = {name: [] for name in [LOOP, *ways] if name in only or not only}
    for _ in range(rounds):
        if LOOP in measured:
            measured[LOOP].append(Figures.of(in_process_loop(settings, batch)))
        for name, sections in zip(ways, each_through_workers(list(ways.values()), scratch, one_process),
                                  strict=True):
            measured[name].append(Figures.of(sections))
    first = batch[0]
    return duty_table(f"GPU duty cycle: tiny model, {first.width}x{first.height}, {first.steps} steps, "
                      f"{len(batch)} jobs, saturated queue, {rounds} interleaved rounds", measured)


def worker_ways(settings: Settings, batch: list[JobRequest], scratch: Path, claim_ahead_ab: bool
                ) -> dict[str, WorkerRun]:
    """Plain RQ, the slotq worker, and the slotq worker with its results in a folder, (jobs of two
    steps or more) with live previews and (``claim_ahead_ab``) with claiming ahead the other way
    from what ``auto`` picks on this device."""
    ways = {"plain RQ SimpleWorker": WorkerRun("rq", settings, batch),
            "slotq worker": WorkerRun("slotq", settings, batch),
            FILE_STORE: WorkerRun("slotq", settings.model_copy(
                update={"result_store": f"file://{scratch / 'results'}"}), batch)}
    if batch[0].steps > 1:  # a job of one step has no preview
        ways[PREVIEWS] = WorkerRun("slotq", settings, [request.model_copy(update={"previews": True})
                                                       for request in batch])
    if claim_ahead_ab:
        from worker.main import claims_ahead
        from worker.pipeline import resolve_device

        flipped = claims_ahead(settings, resolve_device(settings.device)) != "thread"  # the thread's way
        ways[f"{CLAIM_AHEAD}{'on' if flipped else 'off'}"] = WorkerRun(
            "slotq", settings.model_copy(update={"claim_ahead": flipped}), batch)
    return ways


def dispatch(settings: Settings, count: int, scratch: Path, one_process: bool = False) -> list[str]:
    """Time per job with a pipeline that does no work, plain RQ and the slotq worker, against a bare loop."""
    settings = settings.model_copy(update={"checkpoint_every_s": 0})  # a null pipeline has no state to keep
    batch = requests(count, 64, 1)
    names = {"rq": "plain RQ SimpleWorker", "slotq": "slotq worker"}
    runs: dict[str, float | Figures] = {"bare BLMOVE/LREM loop": bare_loop(settings, count)}
    workers = [WorkerRun(kind, settings, batch, null=True) for kind in names]
    for name, sections in zip(names.values(), each_through_workers(workers, scratch, one_process),
                              strict=True):
        runs[name] = Figures.of(sections)
    lines = [f"Dispatch overhead: a pipeline that does no work, {count} jobs", f"{'':30}{'ms/job':>8}"]
    for name, figures in runs.items():
        per_job = figures if isinstance(figures, float) else figures.wall / (figures.jobs - 1)
        lines.append(f"{name:30}{1000 * per_job:>8.2f}")
    return lines


def report(jobs: int = 60, size: int = 256, steps: int = 4, large_jobs: int = 12,
           dispatch_jobs: int = 400, rounds: int = 5, claim_ahead_ab: bool = False,
           one_process: bool = False) -> list[str]:
    """Every table of this benchmark (a count of 0 skips its run), on a Redis of its own; with
    ``one_process``, the worker runs of a round in one process (fewer starts, for a smoke test)."""
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch, \
            running_redis(Path(scratch) / "redis") as url:
        # One job an execution, whole-pipeline: the duty cycle and the dispatch overhead of one
        # execution are what this measures (a null pipeline cannot step).
        settings = Settings(redis_url=url, queue_name="bench", queue_capacity=100_000,
                            cache_dir=Path(scratch) / "models", log_level="WARNING", max_steps=1000,
                            max_batch=1, step_scheduling=False)
        lines: list[str] = []
        for count, side, denoise in ((jobs, size, steps), (large_jobs, 1024, 1)):
            if count:
                batch = requests(count, side, denoise)
                lines += duty_cycle(settings, batch, Path(scratch), rounds, claim_ahead_ab,
                                    one_process=one_process) + [""]
        if dispatch_jobs:
            lines += dispatch(settings, dispatch_jobs, Path(scratch), one_process=one_process)
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
    parser.add_argument("--serve", type=Path, metavar="PLAN", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    print("\n".join(report(args.jobs, args.size, args.steps, args.large_jobs, args.dispatch_jobs,
                           args.rounds, args.claim_ahead_ab)))


if __name__ == "__main__":
    main()
