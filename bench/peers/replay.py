"""Replaying the trace against one peer, open loop (each job arrives at its time whatever the peer is
doing), and what its clients felt: per class, SLO attainment, goodput, latency tails, refusals."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.peers.peer import Outcome, Peer
from bench.peers.trace import GIVE_UP_FACTOR, SLO_FACTOR, TraceJob
from bench.stats import median, percentile

Shape = tuple[int, int]  # a job's side and steps


def shape(job: TraceJob) -> Shape:
    return job.side, job.steps


def solo_latencies(peer: Peer, jobs: Sequence[TraceJob], repeats: int = 2) -> dict[Shape, float]:
    """Each shape's latency alone on the peer (the median of ``repeats``), after one warm-up call."""
    distinct = {shape(job): job for job in jobs}
    peer.call(next(iter(distinct.values())), give_up_s=600)
    solo: dict[Shape, float] = {}
    for key, job in sorted(distinct.items()):
        took = [peer.call(job, give_up_s=600).latency_s for _ in range(repeats)]
        if any(each is None for each in took):
            raise RuntimeError(f"{peer.name}: a solo {key[0]}px {key[1]}-step job did not succeed")
        solo[key] = median([each for each in took if each is not None])
    return solo


def replay(peer: Peer, jobs: Sequence[TraceJob], slo_s: Callable[[TraceJob], float]) -> list[Outcome]:
    """Every job submitted at its arrival time on a thread of its own; the outcomes in trace order.
    Each client asks to start by its SLO less its solo latency: the latest start that can meet it."""
    outcomes: list[Outcome | None] = [None] * len(jobs)
    start = time.perf_counter() + 0.5

    def client(index: int, job: TraceJob) -> None:
        time.sleep(max(0.0, start + job.at - time.perf_counter()))
        try:
            slo = slo_s(job)
            start_by = slo - slo / SLO_FACTOR
            outcomes[index] = peer.call(job, give_up_s=GIVE_UP_FACTOR * slo, start_by_s=start_by)
        except Exception:  # noqa: BLE001  # a client that crashed saw its job fail
            outcomes[index] = Outcome(admitted=True, failed=True)

    threads = [threading.Thread(target=client, args=(index, job), daemon=True)
               for index, job in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [outcome or Outcome(admitted=True, failed=True) for outcome in outcomes]


@dataclass(frozen=True)
class ClassFigures:
    """What one class's clients felt in one replay."""

    jobs: int
    admitted: int
    met: int  # jobs that met their SLO
    attainment: float  # of all the class's jobs, the share that met their SLO (a refusal does not)
    goodput: float  # jobs meeting their SLO a second of the trace
    p50: float | None
    p95: float | None
    p99: float | None
    refused: int
    refusal_s: float | None  # the slowest refusal to come back
    retry_after: int  # refusals that said when to come back
    failed: int


def figures(jobs: Sequence[TraceJob], outcomes: Sequence[Outcome], slo_s: Callable[[TraceJob], float],
            job_class: str, span_s: float) -> ClassFigures:
    """One class's figures over a replay that lasted ``span_s`` (the first arrival to the last end)."""
    mine = [(job, outcome) for job, outcome in zip(jobs, outcomes, strict=True) if job.job_class == job_class]
    met = [job for job, outcome in mine if outcome.latency_s is not None and outcome.latency_s <= slo_s(job)]
    admitted = [outcome for _, outcome in mine if outcome.admitted]
    latencies = [outcome.latency_s for _, outcome in mine if outcome.latency_s is not None]
    refusals = [outcome for _, outcome in mine if not outcome.admitted]
    return ClassFigures(
        jobs=len(mine), admitted=len(admitted), met=len(met),
        attainment=len(met) / len(mine) if mine else 0.0,
        goodput=len(met) / span_s if span_s > 0 else 0.0,
        p50=percentile(latencies, 0.5) if latencies else None,
        p95=percentile(latencies, 0.95) if latencies else None,
        p99=percentile(latencies, 0.99) if latencies else None,
        refused=len(refusals),
        refusal_s=max((outcome.refused_in_s or 0.0 for outcome in refusals), default=None),
        retry_after=sum(outcome.retry_after for outcome in refusals),
        failed=sum(outcome.failed for _, outcome in mine))
