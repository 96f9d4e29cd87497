"""Step-level scheduling through real workers: jobs joining a running batch, and preemption.

    python -m bench.joining [--rounds 3] [--jobs 40] [--load 0.8] [--size 64]

Starts its own ``redis-server`` and three ``slotq worker`` processes with the tiny model, each on a
queue of its own, ``SLOTQ_MAX_BATCH=8``: start-only batching (``SLOTQ_STEP_SCHEDULING=false``, today's
default and the baseline), step-level scheduling without preemption, and step-level scheduling that
preempts at the next step boundary. Jobs are admitted in this process (``create_app``'s test
client: the same admission as the HTTP API, without a web server's own latency); each job's latency
is its record's ``finished_at`` less its ``created_at``, both written on this host.

- Joining: a seeded Poisson sequence of ``--jobs`` text jobs of ``--size``, 4, 8 or 16 steps, at
  ``--load`` of the capacity measured before the round (images/s of the start-only worker draining a
  burst of 24 such jobs), to the start-only worker and to the step-level one (which first alternating
  by round): mean and p95 latency and images/s.
- Preemption: 4 low jobs of 32 steps run as one batch; once they have taken 2 steps, a high job of
  twice the side (it cannot join them), 8 steps, arrives. Without preemption (the step-level worker
  that never preempts) it waits for the batch to end; with it, the batch is paused at the next step
  boundary. The high job's latency and the low jobs' last end, both ways.

Each part says from which round the median of its rounds' ratios stood beyond the noise band (the
larger of the capacity's drift over the run and a third).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from flask.testing import FlaskClient

from api.app import create_app
from bench.stats import median, paired_ratio, percentile
from bench.stepping import noise_line
from shared.contract.settings import Settings
from slotq import harness

MAX_BATCH = 8
STEPS = (4, 8, 16)
LOW_JOBS, LOW_STEPS, HIGH_STEPS = 4, 32, 8
POLICIES = {"start": "start-only batching (baseline)", "step": "step-level joining"}
ENDED = ("succeeded", "failed", "canceled", "expired")


@dataclass(frozen=True)
class Served:
    """One worker's queue, and an admission client for it."""

    settings: Settings
    client: FlaskClient

    def submit(self, **body: Any) -> str:
        response = self.client.post("/v1/jobs", json={"prompt": "a lighthouse", **body})
        if response.status_code != 202:
            raise RuntimeError(f"admission answered {response.status_code}: {response.get_json()}")
        return str(response.get_json()["id"])

    def view(self, job_id: str) -> dict[str, Any]:
        return dict(self.client.get(f"/v1/jobs/{job_id}").get_json())

    def ended(self, job_ids: Sequence[str], timeout: float = 300) -> list[dict[str, Any]]:
        """Each job's view once all have ended (succeeded: anything else stops the benchmark)."""
        views: dict[str, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(views) < len(job_ids):
            for job_id in job_ids:
                if job_id not in views:
                    seen = self.view(job_id)
                    if seen["status"] in ENDED:
                        if seen["status"] != "succeeded":
                            raise RuntimeError(f"job {job_id} ended {seen['status']}: {seen['error']}")
                        views[job_id] = seen
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(job_ids) - len(views)} job(s) did not end in {timeout:.0f} s")
            time.sleep(0.02)
        return [views[job_id] for job_id in job_ids]


def moment(value: str) -> float:
    return datetime.fromisoformat(value).timestamp()


def latency(view: dict[str, Any]) -> float:
    return moment(view["finished_at"]) - moment(view["created_at"])


@contextmanager
def workers(scratch: Path, size: int) -> Iterator[dict[str, Served]]:
    """Redis and the three workers, registered; their admission clients by policy."""
    with ExitStack() as stack:
        redis = harness.start_redis_server(scratch / "redis")
        stack.callback(redis.stop)
        base = Settings(redis_url=redis.url, queue_capacity=10_000, drain_s=0, cache_dir=scratch / "models",
                        log_level="WARNING", max_batch=MAX_BATCH, worker_metrics_port=0,
                        max_side=max(512, 2 * size))
        policies: dict[str, dict[str, Any]] = {
            "start": {"step_scheduling": False},
            "step": {"step_scheduling": True, "preempt_after_s": -1},
            "preempt": {"step_scheduling": True, "preempt_after_s": 0}}
        served, started = {}, []
        for name, overrides in policies.items():
            settings = base.model_copy(update={"queue_name": f"bench-{name}", **overrides})
            process = harness.start_worker(settings, scratch / f"worker-{name}.log", wait=False)
            stack.callback(process.stop)
            started.append(process)
            served[name] = Served(settings, create_app(settings).test_client())
        harness.wait_workers(started, redis.url)
        yield served


def capacity(served: Served, size: int) -> float:
    """Images/s of the worker draining a burst of 24 jobs (8 of each step count)."""
    began = time.time()
    ids = [served.submit(width=size, height=size, steps=STEPS[index % 3], seed=index) for index in range(24)]
    views = served.ended(ids)
    return len(views) / (max(moment(view["finished_at"]) for view in views) - began)


def arrivals(seed: int, jobs: int, rate: float) -> list[tuple[float, int]]:
    """(offset in seconds, steps) of each job of a Poisson sequence at ``rate`` jobs/s."""
    draw, offset, sequence = random.Random(seed), 0.0, []
    for _ in range(jobs):
        offset += draw.expovariate(rate)
        sequence.append((offset, draw.choice(STEPS)))
    return sequence


def replay(served: Served, sequence: Sequence[tuple[float, int]], size: int) -> list[dict[str, Any]]:
    """Submit the sequence on its schedule; each job's view once all have ended."""
    ids: list[str] = []
    began = time.monotonic()
    for index, (offset, steps) in enumerate(sequence):
        pause = began + offset - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        ids.append(served.submit(width=size, height=size, steps=steps, seed=1000 + index))
    return served.ended(ids)


@dataclass(frozen=True)
class Figures:
    mean_ms: float
    p95_ms: float
    images_per_s: float

    @classmethod
    def of(cls, views: Sequence[dict[str, Any]]) -> Figures:
        latencies = [1000 * latency(view) for view in views]
        span = max(moment(v["finished_at"]) for v in views) - min(moment(v["created_at"]) for v in views)
        return cls(sum(latencies) / len(latencies), percentile(latencies, 0.95), len(views) / span)

    def row(self, label: str, ratio: float) -> str:
        """A table row; ``ratio``: its mean latency's to the baseline's."""
        return (f"{label:34}{self.mean_ms:>10.1f}{self.p95_ms:>10.1f}{self.images_per_s:>8.1f}"
                f"{ratio:>9.2f}x")


def joining_lines(served: dict[str, Served], rounds: int, jobs: int, load: float, size: int
                  ) -> tuple[list[str], list[float]]:
    lines = [f"Step-level joining vs start-only batching through real workers: tiny model on cpu, "
             f"{size}x{size}, steps {'/'.join(map(str, STEPS))}, SLOTQ_MAX_BATCH={MAX_BATCH}",
             f"each round: the capacity (img/s of the start-only worker draining 24 jobs), then {jobs} "
             f"Poisson arrivals at {load:.2f} of it, the same sequence to both workers",
             f"{'':34}{'mean ms':>10}{'p95 ms':>10}{'img/s':>8}{'x base':>10}"]
    probes: list[float] = []
    runs: list[dict[str, Figures]] = []
    for number in range(1, rounds + 1):
        probes.append(capacity(served["start"], size))
        sequence = arrivals(number, jobs, load * probes[-1])
        order = ["start", "step"] if number % 2 else ["step", "start"]
        figures = {name: Figures.of(replay(served[name], sequence, size)) for name in order}
        runs.append(figures)
        first = POLICIES[order[0]].split(" (")[0]
        lines.append(f"round {number} ({first} first; capacity {probes[-1]:.1f} img/s, "
                     f"arrivals at {load * probes[-1]:.1f} jobs/s)")
        base = figures["start"].mean_ms
        lines += [figures[name].row(f"  {POLICIES[name]}", figures[name].mean_ms / base) for name in POLICIES]
    means = {name: [run[name].mean_ms for run in runs] for name in POLICIES}
    p95s = {name: [run[name].p95_ms for run in runs] for name in POLICIES}
    rates = {name: [run[name].images_per_s for run in runs] for name in POLICIES}
    # Each column's median over the rounds; the ratio is the median of the rounds' own (paired) ratios.
    lines.append(f"median of {rounds} paired round(s)")
    for name in POLICIES:
        medians = Figures(median(means[name]), median(p95s[name]), median(rates[name]))
        lines.append(medians.row(POLICIES[name], paired_ratio(means[name], means["start"])))
    by_round = " ".join(f"{s / b:.2f}" for s, b in zip(means["step"], means["start"], strict=True))
    lines.append(f"mean latency step-level ÷ start-only "
                 f"{paired_ratio(means['step'], means['start']):.2f} (by round: {by_round}); p95 "
                 f"{paired_ratio(p95s['step'], p95s['start']):.2f}; img/s "
                 f"{paired_ratio(rates['step'], rates['start']):.2f}")
    lines.append(noise_line("the mean latency's ratio", means["step"], means["start"], probes))
    return lines, probes


def preemption_run(served: Served, size: int) -> tuple[float, float]:
    """The high job's latency and the low batch's last end after the high job's admission, in ms."""
    lows = [served.submit(width=size, height=size, steps=LOW_STEPS, seed=index, priority="low")
            for index in range(LOW_JOBS)]
    deadline = time.monotonic() + 60
    while (served.view(lows[0])["progress"] or {"step": 0})["step"] < 2:
        if time.monotonic() > deadline:
            raise TimeoutError("the low batch did not start")
        time.sleep(0.005)
    high = served.submit(width=2 * size, height=2 * size, steps=HIGH_STEPS, seed=99, priority="high")
    (high_view,) = served.ended([high])
    low_views = served.ended(lows)
    low_end = max(moment(view["finished_at"]) for view in low_views) - moment(high_view["created_at"])
    return 1000 * latency(high_view), 1000 * low_end


def preemption_lines(served: dict[str, Served], rounds: int, size: int, probes: list[float]) -> list[str]:
    lines = [f"Preemption: {LOW_JOBS} low jobs {size}x{size}, {LOW_STEPS} steps, running; a high job "
             f"{2 * size}x{2 * size}, {HIGH_STEPS} steps, arrives after their 2nd step",
             f"{'':34}{'high ms':>10}{'low end ms':>12}"]
    labels = {"step": "without preemption (baseline)", "preempt": "preempting at the next step"}
    runs: list[dict[str, tuple[float, float]]] = []
    for number in range(1, rounds + 1):
        order = ["step", "preempt"] if number % 2 else ["preempt", "step"]
        runs.append({name: preemption_run(served[name], size) for name in order})
        lines.append(f"round {number}")
        lines += [f"  {labels[name]:32}{runs[-1][name][0]:>10.1f}{runs[-1][name][1]:>12.1f}"
                  for name in labels]
    lines.append(f"median of {rounds} paired round(s)")
    lines += [f"{labels[name]:34}{median(run[name][0] for run in runs):>10.1f}"
              f"{median(run[name][1] for run in runs):>12.1f}" for name in labels]
    with_, without = [run["preempt"][0] for run in runs], [run["step"][0] for run in runs]
    by_round = " ".join(f"{w / b:.2f}" for w, b in zip(with_, without, strict=True))
    lines.append(f"the high job's latency with ÷ without: {paired_ratio(with_, without):.2f} "
                 f"(by round: {by_round})")
    lines.append(noise_line("the high job's latency ratio", with_, without, probes))
    return lines


def report(rounds: int = 3, jobs: int = 40, load: float = 0.8, size: int = 64) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch, \
            workers(Path(scratch), size) as served:
        for each in served.values():  # first calls of a shape are slower: one untimed job each
            each.ended([each.submit(width=size, height=size, steps=4, seed=0),
                        each.submit(width=2 * size, height=2 * size, steps=4, seed=0)])
        lines, probes = joining_lines(served, rounds, jobs, load, size)
        return [*lines, "", *preemption_lines(served, rounds, size, probes)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--size", type=int, default=64)
    args = parser.parse_args()
    print("\n".join(report(args.rounds, args.jobs, args.load, args.size)))


if __name__ == "__main__":
    main()
