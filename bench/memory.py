"""Resident memory of the worker and of each API process across 1,000 jobs: it must stay flat.

    python -m bench.memory [--jobs 1000] [--first 100] [--clients 8]

Runs ``--jobs`` small jobs (tiny model, 64x64, 1 step) over HTTP through the same service as
``bench.end_to_end`` (its own Redis, one ``slotq api`` with 2 gunicorn processes, one ``slotq
worker``) and reads VmRSS from ``/proc/<pid>/status`` for the worker, its finishing process and
each gunicorn process (the master's children) when ready, after the first ``--first`` jobs and
after all of them. The growth between the last two samples shows whether memory stays flat; the
peak is VmHWM.

Baseline, in the same run: the same jobs through the pipeline and PNG encoding in a loop, in a
fresh Python process sampled the same way: what the model and its libraries do to memory alone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.end_to_end import bench_settings, bodies, burst, serving
from bench.gpu import requests
from shared.contract.settings import Settings
from slotq.harness import Service, slotq_env

SIZE, STEPS = 64, 1
Sample = dict[str, tuple[int, int]]  # process -> (VmRSS, VmHWM) in kB


def memory(pid: int | str) -> tuple[int, int]:
    """VmRSS and VmHWM of a process, in kB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (the gunicorn master's workers), from /proc/*/stat."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            after_name = stat.read_text().rsplit(")", 1)[1].split()  # the name may hold spaces
        except (OSError, IndexError):
            continue  # a process that ended while we looked
        if int(after_name[1]) == pid:
            found.append(int(stat.parent.name))
    return sorted(found)


def finishing_process(worker: int) -> int:
    """The worker's finishing process (a ``spawn`` child, not multiprocessing's resource tracker)."""
    return next(pid for pid in children(worker) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes())


def sample(worker: int, api: int) -> Sample:
    """The memory of the worker, its finishing process and every API process now."""
    processes = {"slotq worker": worker, "slotq finishing process": finishing_process(worker)}
    processes |= {f"api process (pid {pid})": pid for pid in children(api)}
    return {name: memory(pid) for name, pid in processes.items()}


def loop_samples(settings: Settings, jobs: int, first: int) -> list[Sample]:
    """The baseline: the loop in a fresh process, sampled when loaded, after ``first`` and at the end."""
    command = [sys.executable, "-m", "bench.memory", "--jobs", str(jobs), "--first", str(first), "--loop"]
    done = subprocess.run(command, env=slotq_env(settings), capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the loop failed:\n{done.stderr[-3000:]}")
    printed = json.loads(done.stdout.splitlines()[-1])  # the last line: libraries may print before it
    return [{"in-process loop (baseline)": (rss, hwm)} for rss, hwm in printed]


def run_loop(jobs: int, first: int) -> None:
    """In the fresh process of ``loop_samples``: run the loop and print its samples as JSON."""
    from shared.contract.settings import load_settings
    from worker.messages import encode_png
    from worker.pipeline import load_pipeline

    settings = load_settings()
    pipeline = load_pipeline(settings)
    samples = [memory("self")]
    for index, request in enumerate(requests(jobs, SIZE, STEPS), start=1):
        for image in pipeline.generate(request):
            encode_png(image, request, settings.png_compress_level)
        if index in (first, jobs):
            samples.append(memory("self"))
    print(json.dumps(samples))


def service_samples(scratch: Path, jobs: int, first: int, clients: int,
                    shared: Service | None = None) -> list[Sample]:
    """The service's processes (``shared``'s, or its own), sampled when ready, after ``first`` jobs
    and after all ``jobs``."""
    batch = bodies(jobs, SIZE, STEPS)
    with serving(shared, scratch, clients) as service:
        samples = [sample(service.worker.pid, service.api.pid)]
        for part in (batch[:first], batch[first:]):
            burst(service.port, part, clients)
            samples.append(sample(service.worker.pid, service.api.pid))
    return samples


def table(title: str, samples: list[Sample], first: int, jobs: int) -> list[str]:
    """One row per process: MiB when ready, after ``first`` and ``jobs`` jobs, the growth, the peak."""
    mib = 1024
    lines = [title, f"{'':32}{'ready':>8}{f'@{first}':>8}{f'@{jobs}':>8}{'growth':>8}{'peak':>8}"]
    for name in dict.fromkeys(name for sample in samples for name in sample):
        values = [sample[name] for sample in samples if name in sample]
        if len(values) != 3:  # a gunicorn process replaced between samples
            lines.append(f"{name:32}  not alive for every sample")
            continue
        (ready, _), (middle, _), (last, peak) = values
        lines.append(f"{name:32}{ready / mib:>8.1f}{middle / mib:>8.1f}{last / mib:>8.1f}"
                     f"{(last - middle) / mib:>+8.1f}{peak / mib:>8.1f}")
    return lines


def report(jobs: int = 1000, first: int = 100, clients: int = 8, shared: Service | None = None) -> list[str]:
    """Run the loop, then the service (``shared``, or one of its own), on this machine; the table."""
    first = min(first, jobs - 1)
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        baseline = loop_samples(bench_settings(Path(scratch), clients), jobs, first)
        served = service_samples(Path(scratch), jobs, first, clients, shared)
    merged = [loop | service for loop, service in zip(baseline, served, strict=True)]
    return table(f"Memory over {jobs} jobs: tiny model, {SIZE}x{SIZE}, {STEPS} step, {clients} clients over "
                 f"HTTP; VmRSS in MiB when ready, after {first} jobs and after {jobs}; growth = "
                 f"@{jobs} - @{first}; peak = VmHWM", merged, first, jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--first", type=int, default=100, help="the first sample is taken after these jobs")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop:
        run_loop(args.jobs, min(args.first, args.jobs - 1))
        return
    print("\n".join(report(args.jobs, args.first, args.clients)))


if __name__ == "__main__":
    main()
