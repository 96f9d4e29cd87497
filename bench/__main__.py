"""Every benchmark in turn, as one report: ``python -m bench [--quick]``.

Each section prints its figures next to a baseline measured in the same run, so a noisy machine
moves both. ``--quick`` proves each runs, for CI's smoke test: the least of each (one round, the
fewest jobs and ways) and one service for every section that follows jobs through one; its
figures mean little.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from bench import (
    adapters,
    admission,
    batching,
    compat,
    control,
    edges,
    end_to_end,
    gpu,
    images,
    joining,
    memory,
    models,
    stepping,
    streams,
)
from slotq.harness import Service
from slotq.localredis import free_port

Section = tuple[str, Callable[[], list[str]]]


def quick_sections(shared: Service) -> list[Section]:
    """The report's sections at their least, those that follow jobs through a service on ``shared``."""
    return [("Speed at the edges", lambda: edges.report(quick=True, shared=shared)),
            ("GPU duty cycle and dispatch overhead",
             lambda: gpu.report(jobs=2, size=64, steps=1, large_jobs=0, dispatch_jobs=4, rounds=1,
                                one_process=True)),
            ("Dynamic batching", lambda: batching.batching_lines(rounds=1, sizes=(64,), settle_s=0)),
            ("Admission", lambda: admission.report(jobs=40, processes=2, clients=4, settle_s=0)),
            ("End to end", lambda: end_to_end.report(jobs=4, clients=2, size=64, steps=1, shared=shared)),
            ("Synchronous calls", lambda: compat.report(rounds=1, size=64, steps=1, shared=shared)),
            ("Memory", lambda: memory.report(jobs=4, first=2, clients=2, shared=shared)),
            ("Image inputs",
             lambda: images.report(size=64, checks=5, posts=5, runs=1, steps=1, shared=shared)),
            ("LoRA adapters",
             lambda: adapters.report(rounds=1, size=64, jobs=4, duty_jobs=2, duty_rounds=1,
                                     duty_ways=(gpu.LOOP, "slotq worker"))),
            ("Several models", lambda: models.report(rounds=1, line_rounds=1, jobs=4)),
            ("ControlNets and hires", lambda: control.report(rounds=1, size=64)),
            # As many threads as streams and more: no call waits out its timeout.
            ("Event streams", lambda: streams.report(streams=4, threads=8, requests=5)),
            ("Step-level scheduling", lambda: stepping.report(rounds=1, jobs=8, settle_s=0)),
            ("Step-level scheduling through workers", lambda: joining.report(rounds=1, jobs=6))]


@contextmanager
def shared_service() -> Iterator[Service]:
    """One service for the quick sections (each of its worker's starts imports torch and diffusers),
    serving its worker's metrics, which bench.edges reads."""
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch, \
            end_to_end.running(Path(scratch), 8, log_level="INFO", worker_metrics_port=free_port()) as shared:
        yield shared


def sections() -> list[Section]:
    """The report's sections, at their full sizes."""
    return [("Speed at the edges", edges.report),
            ("GPU duty cycle and dispatch overhead", gpu.report),
            ("Dynamic batching", batching.batching_lines),
            ("Admission", admission.report),
            ("End to end", end_to_end.report),
            ("Synchronous calls", compat.report),
            ("Memory", memory.report),
            ("Image inputs", images.report),
            ("LoRA adapters", adapters.report),
            ("Several models", models.report),
            ("ControlNets and hires", control.report),
            ("Event streams", streams.report),
            ("Step-level scheduling", stepping.report),
            ("Step-level scheduling through workers", joining.report)]


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
    if not args.quick:
        run_all(sections())
        return 0
    began = time.monotonic()
    with shared_service() as shared:
        print(f"(one service for the sections, ready in {time.monotonic() - began:.0f} s)", flush=True)
        run_all(quick_sections(shared))
    return 0


def run_all(parts: list[Section]) -> None:
    """Each section under its title, with the time it took."""
    for title, run in parts:
        print(f"\n== {title} ==", flush=True)
        began = time.monotonic()
        print("\n".join(run()))
        print(f"({time.monotonic() - began:.0f} s; load average {load_average()})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
