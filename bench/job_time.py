"""Time per tiny-model job through the whole service, against the same jobs in a plain loop.

    python -m bench.job_time [--jobs 40] [--size 256] [--steps 4]

Baseline: the pipeline called back to back in this process (plus PNG encoding), the ceiling.
Service: the same jobs admitted through the queue and run by a real ``slotq worker`` process.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rq import Worker

from shared import queue as jobs
from shared import records
from shared.jobs import JobRequest
from shared.localredis import free_port, start_redis
from shared.settings import Settings


def in_process(settings: Settings, requests: list[JobRequest]) -> list[float]:
    """Seconds per job when one loop calls the pipeline directly."""
    from worker.pipeline import encode_png, load_pipeline

    pipeline = load_pipeline(settings)
    times = []
    for request in requests:
        started = time.perf_counter()
        for image in pipeline.generate(request, on_step=lambda step, total: None):
            encode_png(image, request)
        times.append(time.perf_counter() - started)
    return times


def through_service(settings: Settings, requests: list[JobRequest], log: Path) -> tuple[float, list[float]]:
    """Wall seconds for the whole burst, and each job's submit-to-finish seconds."""
    env = {f"SLOTQ_{k.upper()}": str(v) for k, v in settings.model_dump(mode="json").items() if v is not None}
    with log.open("wb") as out:
        worker = subprocess.Popen([sys.executable, "-m", "shared.cli", "worker"],
                                  env={**env, "PATH": "/usr/bin:/bin"}, stdout=out, stderr=out)
    connection = jobs.connect(settings)
    queue = jobs.job_queue(connection, settings)
    try:
        while not Worker.all(connection=connection):
            if worker.poll() is not None:
                raise SystemExit(f"the worker exited during start-up; see {log}")
            time.sleep(0.05)
        started = time.perf_counter()
        admitted = [jobs.enqueue_job(queue, settings, request).job for request in requests]
        # One worker runs the queue in order: when the last job ends, all have. Polling only it
        # keeps this process from taking CPU time away from the worker on a small machine.
        while not records.job_status(jobs.fetch_job(queue, admitted[-1].id)).is_terminal:
            time.sleep(0.02)
        wall = time.perf_counter() - started
        latencies = []
        for job in admitted:
            job = jobs.fetch_job(queue, job.id)
            assert job.ended_at and job.created_at, job.id
            latencies.append((job.ended_at - job.created_at).total_seconds())
        return wall, latencies
    finally:
        worker.terminate()
        worker.wait(30)
        connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        port = free_port()
        server = start_redis(port, Path(scratch) / "redis")
        try:
            settings = Settings(redis_url=f"redis://127.0.0.1:{port}/0", queue_capacity=args.jobs,
                                cache_dir=Path(scratch) / "models", log_level="WARNING")
            requests = [JobRequest(prompt="bench", width=args.size, height=args.size, steps=args.steps,
                                   seed=index) for index in range(args.jobs)]
            baseline = in_process(settings, requests)
            wall, latencies = through_service(settings, requests, Path(scratch) / "worker.log")
        finally:
            server.terminate()
            server.wait(10)
    loop_per_job = statistics.fmean(baseline)
    service_per_job = wall / args.jobs
    print(f"tiny model, {args.size}x{args.size}, {args.steps} steps, {args.jobs} jobs")
    print(f"{'':32}{'s/job':>10}{'jobs/s':>10}")
    print(f"{'in-process loop (baseline)':32}{loop_per_job:>10.4f}{1 / loop_per_job:>10.2f}")
    print(f"{'through the service':32}{service_per_job:>10.4f}{1 / service_per_job:>10.2f}")
    print(f"service overhead per job: {1000 * (service_per_job - loop_per_job):.1f} ms "
          f"({100 * loop_per_job / service_per_job:.1f}% of the loop's throughput)")
    print(f"burst latency submit->finished: p50 {statistics.median(latencies):.2f}s, "
          f"max {max(latencies):.2f}s")


if __name__ == "__main__":
    main()
