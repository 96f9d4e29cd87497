"""Every benchmark in turn, as one report: ``python -m bench [--quick]``.

Each section prints its figures next to a baseline measured in the same run, so a noisy machine
moves both. ``--quick`` runs tiny sizes, for CI's smoke test; its figures mean little.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from bench import adapters, admission, batching, edges, end_to_end, gpu, images, memory, streams

Section = tuple[str, Callable[[], list[str]]]


def sections(quick: bool) -> list[Section]:
    """The report's sections, with their sizes."""
    if quick:
        return [("Speed at the edges", lambda: edges.report(quick=True)),
                ("GPU duty cycle and dispatch overhead",
                 lambda: gpu.report(jobs=4, size=64, steps=1, large_jobs=0, dispatch_jobs=20, rounds=1)),
                ("Dynamic batching", lambda: batching.batching_lines(rounds=1, sizes=(64,))),
                ("Admission", lambda: admission.report(jobs=40, processes=2, clients=4)),
                ("End to end", lambda: end_to_end.report(jobs=8, clients=4, size=64, steps=1)),
                ("Memory", lambda: memory.report(jobs=40, first=10, clients=4)),
                ("Image inputs", lambda: images.report(size=256, checks=20, posts=20, runs=2, steps=1)),
                ("LoRA adapters",
                 lambda: adapters.report(rounds=2, size=64, jobs=12, duty_jobs=3, duty_rounds=1)),
                ("Event streams", lambda: streams.report(streams=4, threads=2, requests=5))]
    return [("Speed at the edges", edges.report),
            ("GPU duty cycle and dispatch overhead", gpu.report),
            ("Dynamic batching", batching.batching_lines),
            ("Admission", admission.report),
            ("End to end", end_to_end.report),
            ("Memory", memory.report),
            ("Image inputs", images.report),
            ("LoRA adapters", adapters.report),
            ("Event streams", streams.report)]


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's name where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    """The 1, 5 and 15 minute load averages: other work on this machine shows here."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def machine() -> list[str]:
    """The report's header: what ran it, and when."""
    import torch

    cuda = torch.cuda.is_available()
    gpu_name = f" ({torch.cuda.get_device_name(0)})" if cuda else ""
    return [f"slotq benchmarks, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
            f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {load_average()}",
            f"Python {platform.python_version()}, torch {torch.__version__} ({torch.get_num_threads()} "
            f"CPU threads, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), "
            f"CUDA available: {'yes' if cuda else 'no'}{gpu_name}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test; figures mean little)")
    args = parser.parse_args(argv)
    print("\n".join(machine() + (["--quick: tiny sizes, figures mean little"] if args.quick else [])))
    for title, run in sections(args.quick):
        print(f"\n== {title} ==", flush=True)
        began = time.monotonic()
        print("\n".join(run()))
        print(f"({time.monotonic() - began:.0f} s; load average {load_average()})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
