"""The one open-loop trace every peer gets: seeded Poisson arrivals of three classes of jobs, and each
job's SLO (a multiple of its class's solo latency on the peer that serves it)."""

from __future__ import annotations

import random
from dataclasses import dataclass

SLO_FACTOR = 3.0  # a job's SLO: this many times its solo latency (vLLM-Omni #290, GenServe, InstGenIE)
GIVE_UP_FACTOR = 10.0  # a client stops waiting at this many times its SLO


@dataclass(frozen=True)
class JobClass:
    """A class of the trace: its share of the arrivals, its sizes and steps, its priority."""

    name: str
    share: float
    sides: tuple[int, ...]
    steps: tuple[int, ...]
    priority: str  # slotq's: high, normal, low

    @property
    def solo(self) -> TraceJob:
        """The job whose solo latency sets the class's SLO: its largest and longest."""
        return TraceJob(0.0, self.name, max(self.sides), max(self.steps), self.priority, seed=0)


CLASSES = (
    JobClass("interactive", 0.5, (64, 96, 128), (4, 6, 8), "high"),
    JobClass("standard", 0.3, (256,), (20,), "normal"),
    JobClass("bulk", 0.2, (256,), (40, 50, 60), "low"),
)
# --quick: the same three classes at the least sizes, to prove the benchmark runs.
QUICK_CLASSES = (
    JobClass("interactive", 0.5, (64,), (2,), "high"),
    JobClass("standard", 0.3, (64,), (4,), "normal"),
    JobClass("bulk", 0.2, (64,), (8,), "low"),
)


@dataclass(frozen=True)
class TraceJob:
    """One arrival: when (seconds after the trace starts), its class, size, steps, priority, seed."""

    at: float
    job_class: str
    side: int
    steps: int
    priority: str
    seed: int


def trace(classes: tuple[JobClass, ...], jobs: int, rate: float, seed: int) -> list[TraceJob]:
    """``jobs`` arrivals at ``rate`` a second (exponential gaps), each class drawn by its share."""
    draw = random.Random(seed)
    at, arrivals = 0.0, []
    weights = [job_class.share for job_class in classes]
    for index in range(jobs):
        at += draw.expovariate(rate)
        job_class = draw.choices(classes, weights)[0]
        arrivals.append(TraceJob(round(at, 4), job_class.name, draw.choice(job_class.sides),
                                 draw.choice(job_class.steps), job_class.priority, seed=index))
    return arrivals


def mean_service_s(classes: tuple[JobClass, ...], solo_s: dict[str, float]) -> float:
    """A job's mean service time over the mix, from each class's solo latency."""
    return sum(job_class.share * solo_s[job_class.name] for job_class in classes)
