"""What batching buys: images per second at batch 1, 4 and 8, one GPU execution per batch.

    python -m bench.batching [--rounds 3]

In-process, the tiny model: for each size, images made one job at a time (batch 1, the baseline
measured in this run) and as batches of 4 and 8 compatible jobs, each with its own seed.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from bench.stats import median, timed
from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings

SIZES = (64, 256)
BATCHES = (1, 4, 8)


def images_per_second(pipeline: object, size: int, batch: int, rounds: int) -> float:
    """Images a second in batches of ``batch``: the median of ``rounds`` timed executions, since
    single calls on a shared machine now and then take ten times as long."""
    requests = [JobRequest(prompt=f"b{i}", width=size, height=size, steps=4, seed=i) for i in range(batch)]
    run = pipeline.generate_batch  # type: ignore[attr-defined]
    # The first calls of a shape are slower: two warm-ups, untimed.
    return batch / median(timed(lambda: run(requests), rounds, warm_ups=2))


def batching_lines(rounds: int = 7, sizes: tuple[int, ...] = SIZES, settle_s: float = 5.0) -> list[str]:
    """The table, one row per size: images/s by batch size, and the speed-up over batch 1."""
    from worker.pipeline import load_pipeline

    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        pipeline = load_pipeline(Settings(cache_dir=Path(scratch), device="cpu"))
    # A fresh process runs its first seconds of torch work several times slower: settle first.
    settle = [JobRequest(prompt="settle", width=64, height=64, steps=4, seed=0)]
    until = time.perf_counter() + settle_s
    while time.perf_counter() < until:
        pipeline.generate_batch(settle)
    header = "".join(f"{f'batch {b} img/s':>16}" for b in BATCHES) + f"{'x at 8':>8}"
    lines = [f"Dynamic batching: tiny model, 4 steps, in-process; median of {rounds} executions each",
             f"{'':14}{header}"]
    for size in sizes:
        rates = [images_per_second(pipeline, size, batch, rounds) for batch in BATCHES]
        cells = "".join(f"{rate:>16.1f}" for rate in rates)
        lines.append(f"{f'{size}x{size}':14}{cells}{rates[-1] / rates[0]:>7.1f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    print("\n".join(batching_lines(parser.parse_args().rounds)))


if __name__ == "__main__":
    main()
