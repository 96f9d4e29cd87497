"""Torch's CPU threads for each execution (SLOTQ_TORCH_THREADS): a fixed count, torch's own on a GPU,
or on the CPU one thread or torch's default, by the execution's work."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from time import perf_counter

import torch

from shared.contract.jobs import JobRequest

TORCH_DEFAULT_THREADS = torch.get_num_threads()  # before any load sets it: its cores or OMP_NUM_THREADS
CALIBRATION_STEPS = 2
CALIBRATION_ROUNDS = (2, 5)  # the least and the most; each size and count keeps its best
CALIBRATION_BUDGET_S = (1.0, 2.0)  # no round past the least starts after the first, no call after the second
CALIBRATION_FIRST_S = 0.125  # the first call longer than this (a real model) scales the budget with it
MARGIN = 0.05  # more threads count as the faster where they take under 95 % of fewer's time


def work_of(requests: Sequence[JobRequest]) -> int:
    """An execution's work: pixels x denoising steps x images (or a clip's frames), over its requests."""
    return sum(r.width * r.height * r.steps_run * r.pictures for r in requests)


@dataclass(frozen=True)
class Timing:
    """The best time of one calibration size at each of the two counts."""

    work: int
    fewer_s: float
    more_s: float


@dataclass(frozen=True)
class ThreadChoice:
    """Torch's CPU threads for an execution: ``fewer`` below ``threshold`` work, ``more`` from it on.
    0 leaves torch's count as it is (a GPU, where the work is the device's)."""

    fewer: int
    more: int
    threshold: float = math.inf
    calibration_s: float | None = None  # how long finding the threshold took

    @classmethod
    def configured(cls, setting: int, device: torch.device) -> ThreadChoice:
        """SLOTQ_TORCH_THREADS: a count it names; 0 on a GPU torch's own, on the CPU 1 until
        calibrated, then torch's default from the threshold on."""
        if setting:
            return cls(setting, setting)
        if device.type != "cpu":
            return cls(0, 0)
        return cls(1, TORCH_DEFAULT_THREADS)

    @property
    def automatic(self) -> bool:
        """Whether the count depends on the work (there are two to choose from)."""
        return self.fewer != self.more

    def threads_for(self, work: int) -> int:
        """The threads for an execution of this much work; 0: leave torch's count as it is."""
        return self.more if work >= self.threshold else self.fewer

    def use(self, work: int) -> None:
        """Give torch the threads for this work (on the thread that runs the execution)."""
        threads = self.threads_for(work)
        if threads and threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def calibrated(self, run: Callable[[int, int], object], small: int, large: int) -> ThreadChoice:
        """This choice with its threshold, from timing ``run(side, threads)`` (an execution of a square
        of that side at CALIBRATION_STEPS) at a small and a large side with each count (see ``crossover``).

        Timed at warm-up rather than as jobs run: the worker starts with its threshold, and no job
        runs at the slower count to find it. Where another process takes a core, an operator's
        threads wait for the slowest and a call with more threads can take many times its time: each
        size and count keeps its best of two to five interleaved rounds within a budget (without one
        whole round in it, more threads are never chosen), and, since the worker's own
        processes (finishing, Redis, the API) share the cores, more threads must win by MARGIN. The
        tiny model on 2 cores, 64 and 256: 0.6-0.8 s, thresholds 26,000-86,000 pixel-steps."""
        began = perf_counter()
        run(large, self.fewer)  # untimed: a shape's first call is slow
        scale = max(1.0, (perf_counter() - began) / CALIBRATION_FIRST_S)
        best = self._best_times(run, (small, large), began, [scale * limit for limit in CALIBRATION_BUDGET_S])
        threshold = math.inf
        if best is not None:
            timed = [Timing(side * side * CALIBRATION_STEPS, best[side, self.fewer], best[side, self.more])
                     for side in (small, large)]
            threshold = crossover(timed[0], timed[1])
        return replace(self, threshold=threshold, calibration_s=perf_counter() - began)

    def _best_times(self, run: Callable[[int, int], object], sides: tuple[int, int], began: float,
                    budget: Sequence[float]) -> dict[tuple[int, int], float] | None:
        """Each side's and count's best time over interleaved rounds; None where not one round fit."""
        best: dict[tuple[int, int], float] = {}
        (least, most), (soft, hard) = CALIBRATION_ROUNDS, budget
        for done in range(1, most + 1):
            for side in sides:
                for threads in (self.fewer, self.more):
                    start = perf_counter()
                    if start - began > hard:
                        return best if done > 1 else None
                    run(side, threads)
                    took = perf_counter() - start
                    best[side, threads] = min(best.get((side, threads), math.inf), took)
            if done >= least and perf_counter() - began > soft:
                break
        return best

    def __str__(self) -> str:
        if not self.fewer:
            return "torch's own count of CPU threads"
        if not self.automatic:
            return f"{self.fewer} CPU thread(s)"
        took = f", calibrated in {self.calibration_s:.2f} s" if self.calibration_s is not None else ""
        if self.threshold == math.inf:
            return f"{self.fewer} CPU thread(s) at any work ({self.more} never won by {MARGIN:.0%}{took})"
        return (f"{self.fewer} CPU thread(s) below {self.threshold:,.0f} pixel-steps an execution "
                f"(pixels x steps x images), {self.more} from there{took}")


def crossover(small: Timing, large: Timing, margin: float = MARGIN) -> float:
    """The work from which more threads are the faster by ``margin``: where the line through the two
    sizes' gaps (more threads' time less fewer's, less the margin) crosses zero between them; 0 where
    they won at both sizes, infinite (never) where they lost at the large one."""
    small_gap = small.more_s - (1 - margin) * small.fewer_s
    large_gap = large.more_s - (1 - margin) * large.fewer_s
    if large_gap >= 0:  # not extrapolated: on a busy machine the gaps are no line
        return math.inf
    if small_gap <= 0:
        return 0.0
    return small.work + (large.work - small.work) * small_gap / (small_gap - large_gap)
