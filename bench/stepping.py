"""What step-level scheduling buys: jobs joining a running batch at a step boundary, and preemption.

    python -m bench.stepping [--rounds 3] [--jobs 40] [--load 0.8] [--size 64] [--settle 3]

In-process, the tiny SD model (float32, one torch thread), euler, both ways through
worker/stepping.py's ``SteppingLoop``, so that only the scheduling policy differs: the same admission
(text encoding), UNet calls and decode, which the loop's tests show make diffusers' own images. The
worker does not use the loop yet: these figures say what it would buy, not what slotq does today.

- Joining: Poisson arrivals of ``--size`` jobs of 4, 8 or 16 steps (one seeded sequence a round, both
  policies on it, which runs first alternating) at ``--load`` of the capacity measured just before
  the round: images/s of full batches of 8 through the loop, one batch at each step count.
  Start-only batching (today's slotq, the baseline): a batch starts with the waiting jobs of the
  oldest one's batch key (so of its step count), up to 8, and runs to its last step before the next
  starts. Step-level joining: at each step boundary every arrived job joins, up to 8 flights, and
  each is decoded as it finishes. A job's latency runs from its arrival to its image decoded. The
  clock is real time, the compute setting the pace, except that a spell with nothing to do is
  skipped to the next arrival.
- Preemption: 8 low jobs of 32 steps running; a high job of twice the side (it cannot share their
  UNet call), 8 steps, arrives as their 4th step begins. Without preemption (the baseline) it waits
  for the batch to finish; with it, the low flights are paused at that step's boundary, the high job
  runs alone, and they resume. The low jobs' images must be the same both ways.

Each part ends with how many rounds it took for its difference to stand above the machine's noise:
from that round on, the median of the rounds' ratios so far lay beyond the noise band, the larger of
the drift of the capacity probed before every round and a third (what this 2-core machine drifts by
within minutes).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.stats import median, paired_ratio, percentile, ratios, timed
from shared.contract.jobs import JobRequest
from worker.batching import WINDOW_PER_PLACE

# SLOTQ_MAX_BATCH defaults to 1 (batching off); 8 is the batch bench.batching and bench.edges measure.
MAX_BATCH = 8
STEPS = (4, 8, 16)
SAMPLER = "euler"
LOW_STEPS, HIGH_STEPS, ARRIVES_AFTER = 32, 8, 3
KNOWN_DRIFT = 1 / 3


@dataclass(frozen=True)
class Arrival:
    """A job of the sequence: its place, when it arrives (seconds since the run began), its request."""

    index: int
    at: float
    request: JobRequest


@dataclass
class Outcome:
    """One policy's run of a sequence: when each job's image was decoded, the images, and how many
    flights each model call of a step carried."""

    decoded: dict[int, float] = field(default_factory=dict)
    images: dict[int, np.ndarray] = field(default_factory=dict)
    fills: list[int] = field(default_factory=list)

    def latencies(self, arrivals: Sequence[Arrival]) -> list[float]:
        return [self.decoded[arrival.index] - arrival.at for arrival in arrivals]

    def rate(self, arrivals: Sequence[Arrival]) -> float:
        """Images a second from the first arrival to the last image."""
        return len(arrivals) / (max(self.decoded.values()) - arrivals[0].at)


class Clock:
    """Seconds since the run began: real time, but for idle spells skipped to the next arrival."""

    def __init__(self) -> None:
        self.began = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.began

    def skip_to(self, at: float) -> None:
        self.began -= max(0.0, at - self.now())


def request(index: int, steps: int, size: int) -> JobRequest:
    return JobRequest(prompt=f"job {index}", width=size, height=size, steps=steps, seed=index,
                      scheduler=SAMPLER)


def arrivals(seed: int, jobs: int, rate: float, size: int) -> list[Arrival]:
    """A Poisson sequence: exponential gaps at ``rate`` jobs a second, steps drawn from STEPS."""
    draw, at, sequence = random.Random(seed), 0.0, []
    for index in range(jobs):
        at += draw.expovariate(rate)
        sequence.append(Arrival(index, at, request(index, draw.choice(STEPS), size)))
    return sequence


def run_batch(loop: Any, requests: Sequence[JobRequest]) -> list[np.ndarray]:
    """Requests admitted together, stepped to their end and decoded together: a pipeline call's work."""
    flights = [loop.admit(each) for each in requests]
    while loop.running:
        loop.step()
    return loop.decode(flights)


def capacity(loop: Any, size: int, rounds: int) -> float:
    """Images a second of full batches of MAX_BATCH through the loop, one batch at each step count."""
    batches = [[request(index, steps, size) for index in range(MAX_BATCH)] for steps in STEPS]
    took = timed(lambda: [run_batch(loop, batch) for batch in batches], rounds, warm_ups=0)
    return MAX_BATCH * len(STEPS) / median(took)


def arrive(clock: Clock, line: deque[Arrival], waiting: deque[Arrival]) -> None:
    """Jobs whose arrival time the clock has passed, from the line into the waiting queue."""
    now = clock.now()
    while line and line[0].at <= now:
        waiting.append(line.popleft())


def finish(outcome: Outcome, clock: Clock, flights: Sequence[Any], arrivals: dict[Any, Arrival],
           images: Sequence[np.ndarray]) -> None:
    decoded = clock.now()
    for flight, image in zip(flights, images, strict=True):
        outcome.decoded[arrivals[flight].index] = decoded
        outcome.images[arrivals[flight].index] = image


def step_level(loop: Any, sequence: Sequence[Arrival]) -> Outcome:
    """At each step boundary every arrived job joins (up to MAX_BATCH flights); each finished
    flight is decoded at once."""
    clock, line, waiting, outcome = Clock(), deque(sequence), deque[Arrival](), Outcome()
    flying: dict[Any, Arrival] = {}
    while line or waiting or loop.running:
        arrive(clock, line, waiting)
        while waiting and len(loop.running) < MAX_BATCH:
            arrival = waiting.popleft()
            flying[loop.admit(arrival.request)] = arrival
        if not loop.running:
            clock.skip_to(line[0].at)
            continue
        outcome.fills.append(len(loop.running))
        finished = loop.step()
        if finished:
            finish(outcome, clock, finished, flying, loop.decode(finished))
    return outcome


def companions(waiting: deque[Arrival]) -> list[Arrival]:
    """Today's batch: the oldest waiting job and those of its batch key among the first few waiting
    (worker/batching.py's window), up to MAX_BATCH, taken out of the queue."""
    key = waiting[0].request.batch_key
    window = list(waiting)[:WINDOW_PER_PLACE * MAX_BATCH]
    batch = [arrival for arrival in window if arrival.request.batch_key == key][:MAX_BATCH]
    for arrival in batch:
        waiting.remove(arrival)
    return batch


def start_only(loop: Any, sequence: Sequence[Arrival]) -> Outcome:
    """A batch starts with the waiting jobs of one batch key and runs to its last step, decoded
    together, before the next starts: a job arriving meanwhile waits."""
    clock, line, waiting, outcome = Clock(), deque(sequence), deque[Arrival](), Outcome()
    while line or waiting:
        arrive(clock, line, waiting)
        if not waiting:
            clock.skip_to(line[0].at)
            continue
        batch = {loop.admit(arrival.request): arrival for arrival in companions(waiting)}
        while loop.running:
            outcome.fills.append(len(loop.running))
            loop.step()
        flights = list(batch)
        finish(outcome, clock, flights, batch, loop.decode(flights))
    return outcome


def settle(loop: Any, size: int, seconds: float) -> None:
    """A fresh process runs its first seconds of torch work several times slower: work first."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        run_batch(loop, [request(index, 2, size) for index in range(MAX_BATCH)])


def beyond_noise(figures: Sequence[float], baselines: Sequence[float], band: float) -> int | None:
    """The first round from which on the median of the rounds' ratios so far lay beyond ``band`` (1 +
    the noise) each round; None where it did not after the last round."""
    each = ratios(figures, baselines)
    held = [not 1 / band < median(each[:k]) < band for k in range(1, len(each) + 1)]
    if not held[-1]:
        return None
    return len(held) - held[::-1].index(False) + 1 if False in held else 1


def noise_line(what: str, figures: Sequence[float], baselines: Sequence[float],
               probes: Sequence[float]) -> str:
    """Whether and from which round ``what`` stood above the machine's noise."""
    drift = max(probes) / min(probes) - 1
    band = 1 + max(drift, KNOWN_DRIFT)
    rounds = beyond_noise(figures, baselines, band)
    verdict = (f"stood above it from round {rounds} of {len(figures)}" if rounds is not None
               else f"did not stand above it in {len(figures)} rounds")
    return (f"noise: the capacity, probed before each round, drifted {drift:.0%} over the run (img/s "
            f"{min(probes):.1f} to {max(probes):.1f}); band {1 / band:.2f}x to {band:.2f}x (the larger of "
            f"that and a third): {what} {verdict}")


def policy_row(label: str, arrivals: Sequence[Arrival], outcome: Outcome, base: float) -> str:
    latencies = [1000 * each for each in outcome.latencies(arrivals)]
    mean = sum(latencies) / len(latencies)
    return (f"{label:34}{mean:>10.1f}{percentile(latencies, 0.95):>10.1f}{outcome.rate(arrivals):>8.1f}"
            f"{sum(outcome.fills) / len(outcome.fills):>14.2f}{mean / (base or mean):>11.2f}x")


def mean_ms(outcome: Outcome, arrivals: Sequence[Arrival]) -> float:
    latencies = outcome.latencies(arrivals)
    return 1000 * sum(latencies) / len(latencies)


def image_difference(first: Outcome, second: Outcome) -> float:
    """The largest absolute difference of a job's images (0 to 1) between two runs of one sequence."""
    return max(float(np.abs(first.images[index] - second.images[index]).max()) for index in first.images)


POLICIES: dict[str, Callable[[Any, Sequence[Arrival]], Outcome]] = {
    "start-only batching (baseline)": start_only, "step-level joining": step_level}


def joining_round(loop: Any, number: int, sequence: list[Arrival]) -> dict[str, Outcome]:
    """Both policies on one sequence, the baseline first in odd rounds."""
    order = list(POLICIES) if number % 2 else list(POLICIES)[::-1]
    return {label: POLICIES[label](loop, sequence) for label in order}


def joining_lines(loop: Any, rounds: int, jobs: int, load: float, size: int,
                  probes: list[float]) -> list[str]:
    """The joining table: each round's two rows, their medians, the ratios, the noise and the images."""
    lines = [f"Step-level joining vs start-only batching: tiny model on cpu, 1 torch thread, {size}x{size}, "
             f"{SAMPLER}, {'/'.join(map(str, STEPS))} steps, at most {MAX_BATCH} a batch, both through "
             "worker/stepping.py's loop",
             f"each round: the capacity (img/s of full batches of {MAX_BATCH} through the loop, one at each "
             f"step count, median of 3), then {jobs} Poisson arrivals at {load:.2f} of it, the same for both "
             "policies",
             f"{'':34}{'mean ms':>10}{'p95 ms':>10}{'img/s':>8}{'flights/call':>14}{'x base':>12}"]
    runs, difference = [], 0.0
    for number in range(1, rounds + 1):
        probes.append(capacity(loop, size, 3))
        sequence = arrivals(number, jobs, load * probes[-1], size)
        outcomes = joining_round(loop, number, sequence)
        base = mean_ms(outcomes[next(iter(POLICIES))], sequence)
        lines.append(f"round {number} ({next(iter(outcomes)).split(' ')[0]} first; capacity {probes[-1]:.1f} "
                     f"img/s, arrivals at {load * probes[-1]:.1f} jobs/s)")
        lines += [policy_row(f"  {label}", sequence, outcomes[label], base) for label in POLICIES]
        difference = max(difference, image_difference(*outcomes.values()))
        runs.append((sequence, outcomes))
    return lines + joining_summary(runs, probes, difference)


def joining_summary(runs: list[tuple[list[Arrival], dict[str, Outcome]]], probes: Sequence[float],
                    difference: float) -> list[str]:
    """The medians of the rounds, each ratio by round, the noise verdict and the images' check."""
    def figures(label: str, of: Callable[[list[Arrival], Outcome], float]) -> list[float]:
        return [of(sequence, outcomes[label]) for sequence, outcomes in runs]

    measures: dict[str, Callable[[list[Arrival], Outcome], float]] = {
        "mean": lambda sequence, outcome: mean_ms(outcome, sequence),
        "p95": lambda sequence, outcome: 1000 * percentile(outcome.latencies(sequence), 0.95),
        "img/s": lambda sequence, outcome: outcome.rate(sequence),
        "fill": lambda sequence, outcome: sum(outcome.fills) / len(outcome.fills)}
    base, new = list(POLICIES)
    lines = [f"median of {len(runs)} paired round(s)"]
    for label in POLICIES:
        mean, p95, rate, fill = (median(figures(label, of)) for of in measures.values())
        ratio = paired_ratio(figures(label, measures["mean"]), figures(base, measures["mean"]))
        lines.append(f"{label:34}{mean:>10.1f}{p95:>10.1f}{rate:>8.1f}{fill:>14.2f}{ratio:>11.2f}x")
    for name in ("mean", "p95", "img/s"):
        each = ratios(figures(new, measures[name]), figures(base, measures[name]))
        lines.append(f"{name} step-level ÷ start-only by round: {' '.join(f'{r:.2f}' for r in each)}")
    lines.append(noise_line("the mean latency's ratio", figures(new, measures["mean"]),
                            figures(base, measures["mean"]), probes))
    lines.append(f"images: a job's image under the two policies differs by at most {difference:.1e} "
                 "(max abs, 0 to 1)")
    return lines


@dataclass
class Preempted:
    """One run of the preemption scenario: seconds from the high job's arrival to its admission and
    to its image, the low jobs' latency (they arrive at 0), and the images."""

    wait: float
    latency: float
    low: float
    low_images: list[np.ndarray]
    high_image: np.ndarray


def alone(loop: Any, clock: Clock, job: JobRequest) -> tuple[float, np.ndarray]:
    """A job admitted now and run alone to its image: when it was admitted, and the image."""
    admitted = clock.now()
    return admitted, run_batch(loop, [job])[0]


def preemption_run(loop: Any, lows: Sequence[JobRequest], high: JobRequest, preempt: bool) -> Preempted:
    """The low batch runs; the high job arrives as its step ARRIVES_AFTER + 1 begins and is seen at
    that step's boundary (the longest wait for one); then the policy's way."""
    clock = Clock()
    low = [loop.admit(each) for each in lows]
    for _ in range(ARRIVES_AFTER):
        loop.step()
    arrived = clock.now()
    loop.step()
    if preempt:
        for flight in low:
            loop.pause(flight)
        admitted, high_image = alone(loop, clock, high)
        high_done = clock.now()
        for flight in low:
            loop.resume(flight)
    while loop.running:
        loop.step()
    low_images = loop.decode(low)
    low_done = clock.now()
    if not preempt:
        admitted, high_image = alone(loop, clock, high)
        high_done = clock.now()
    return Preempted(admitted - arrived, high_done - arrived, low_done, low_images, high_image)


PREEMPTION = {False: "without preemption (baseline)", True: "with preemption"}


def preemption_lines(loop: Any, rounds: int, size: int, probes: list[float]) -> list[str]:
    """The preemption table: each round's two rows, their medians, the noise and the images' check."""
    lows = [request(index, LOW_STEPS, size) for index in range(MAX_BATCH)]
    high = request(MAX_BATCH, HIGH_STEPS, 2 * size)
    preemption_run(loop, lows, high, preempt=True)  # untimed: the first calls at the high job's size
    lines = [f"Preemption: {MAX_BATCH} low jobs {size}x{size}, {LOW_STEPS} steps, running; a high job "
             f"{2 * size}x{2 * size}, {HIGH_STEPS} steps, arrives as their step {ARRIVES_AFTER + 1} begins",
             f"{'':34}{'high wait ms':>13}{'high ms':>10}{'low ms':>10}{'low added ms':>14}"]
    runs: list[dict[bool, Preempted]] = []
    for number in range(1, rounds + 1):
        probes.append(capacity(loop, size, 3))
        order = (False, True) if number % 2 else (True, False)
        run = {preempt: preemption_run(loop, lows, high, preempt) for preempt in order}
        runs.append(run)
        lines.append(f"round {number} ({'without' if number % 2 else 'with'} first)")
        lines += [preempted_row(f"  {label}", run[way].wait, run[way].latency, run[way].low,
                                run[way].low - run[False].low) for way, label in PREEMPTION.items()]
    lines.append(f"median of {rounds} paired round(s)")
    for way, label in PREEMPTION.items():
        lines.append(preempted_row(label, *(median(getattr(run[way], name) for run in runs)
                                            for name in ("wait", "latency", "low")),
                                   median(run[way].low - run[False].low for run in runs)))
    return lines + preemption_summary(runs, probes)


def preempted_row(label: str, wait: float, latency: float, low: float, added: float) -> str:
    return f"{label:34}{1000 * wait:>13.1f}{1000 * latency:>10.1f}{1000 * low:>10.1f}{1000 * added:>+14.1f}"


def preemption_summary(runs: list[dict[bool, Preempted]], probes: Sequence[float]) -> list[str]:
    """The high job's latency ratio by round, the noise verdict, and the images' check."""
    with_it = [run[True].latency for run in runs]
    without = [run[False].latency for run in runs]
    low = max(float(np.abs(a - b).max()) for run in runs
              for a, b in zip(run[True].low_images, run[False].low_images, strict=True))
    high = max(float(np.abs(run[True].high_image - run[False].high_image).max()) for run in runs)
    by_round = " ".join(f"{ratio:.3f}" for ratio in ratios(with_it, without))
    return [f"the high job's latency with ÷ without by round: {by_round}",
            noise_line("the high job's latency ratio", with_it, without, probes),
            f"images: the low jobs' with preemption and without differ by at most {low:.1e} (max abs, "
            f"0 to 1); the high job's by {high:.1e}"]


def report(rounds: int = 3, jobs: int = 40, load: float = 0.8, size: int = 64,
           settle_s: float = 3.0) -> list[str]:
    """Both tables, on one loop over the tiny model, at one torch thread (the caller's count restored)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loop = tiny_loop()
        settle(loop, size, settle_s)
        capacity(loop, size, 1)  # untimed: the first calls of each step count's batch
        probes: list[float] = []
        return [*joining_lines(loop, rounds, jobs, load, size, probes), "",
                *preemption_lines(loop, rounds, size, probes)]
    finally:
        torch.set_num_threads(threads)


def tiny_loop() -> Any:
    """A loop over the tiny SD model, loaded as the loop's tests load it (float32)."""
    import torch
    from diffusers import DiffusionPipeline

    from worker.stepping import SteppingLoop
    from worker.tiny.model import ensure_tiny_model

    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        folder = ensure_tiny_model(Path(scratch), "tiny")
        pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return SteppingLoop(pipe)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=40, help="jobs a round of the joining table")
    parser.add_argument("--load", type=float, default=0.8, help="arrival rate, a share of the capacity")
    parser.add_argument("--size", type=int, default=64, help="the jobs' side (the high job's: twice it)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds of untimed work first")
    args = parser.parse_args()
    print("\n".join(report(args.rounds, args.jobs, args.load, args.size, args.settle)))


if __name__ == "__main__":
    main()
