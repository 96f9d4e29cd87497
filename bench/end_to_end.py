"""Submit-to-result latency and images per second over HTTP, against the in-process loop.

    python -m bench.end_to_end [--jobs 60] [--clients 8] [--size 256] [--steps 4]

Starts its own ``redis-server``, one ``slotq api`` (2 gunicorn processes) and one ``slotq worker``.
Each of ``--clients`` threads takes the next job of the burst (distinct seeds): it POSTs it, follows
it with ``GET /v1/jobs/<id>?wait=30`` until it ends, GETs its first image, then takes the next one,
so ``--clients`` jobs are outstanding at any time. Latency is POST sent to PNG bytes received.

Baseline, in the same run: the same jobs through the pipeline and PNG encoding back to back in this
process (``bench.gpu.in_process_loop``), whose images per second are the ceiling; its latencies are
what each job would see there with as many jobs outstanding: from the end of the job ``--clients``
places earlier (or from the loop's start) to the end of its own PNG encoding.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from bench.gpu import Sections, in_process_loop, requests
from bench.stats import percentiles
from shared.contract.jobs import JobStatus
from shared.contract.settings import Settings
from slotq import harness
from slotq.harness import Service

PNG = b"\x89PNG\r\n\x1a\n"
WAIT_S = 30
Body = dict[str, Any]


def bench_settings(scratch: Path, clients: int, redis_url: str = "redis://127.0.0.1:6379/0") -> Settings:
    """The settings of every process of a run; threads enough for every client on one API process.
    One job an execution, whole-pipeline: these sections measure the service around one execution
    (their recorded results did so); batching and step scheduling, the defaults, have benchmarks of
    their own (bench.batching, bench.joining, bench.peers)."""
    return Settings(redis_url=redis_url, queue_name="bench", queue_capacity=100_000, drain_s=0,
                    cache_dir=scratch / "models", log_level="WARNING", api_workers=2,
                    api_threads=max(4, clients), max_batch=1, step_scheduling=False)


def running(scratch: Path, clients: int, **overrides: Any) -> AbstractContextManager[Service]:
    """Redis, one ``slotq api`` and one ``slotq worker`` on :func:`bench_settings` with ``overrides``."""
    return harness.service(bench_settings(scratch, clients).model_copy(update=overrides), scratch)


def serving(shared: Service | None, scratch: Path, clients: int, **overrides: Any
            ) -> AbstractContextManager[Service]:
    """``shared`` as it is (a service several benchmarks use, in ``--quick``), else :func:`running`."""
    return nullcontext(shared) if shared is not None else running(scratch, clients, **overrides)


def call(port: int, method: str, path: str, body: Body | None = None) -> tuple[int, bytes]:
    """One request on a fresh connection, as an independent client makes it: status and body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S + 30)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def follow(port: int, body: Body, deadline: float) -> float:
    """POST one job, long-poll it until it ends, GET its first image: seconds from POST to PNG."""
    began = time.perf_counter()
    view = wait_end(port, submit(port, body), deadline)
    status, image = call(port, "GET", f"/v1/jobs/{view['id']}/images/0")
    if status != 200 or not image.startswith(PNG):
        raise RuntimeError(f"image of job {view['id']}: {status} {image[:100]!r}")
    return time.perf_counter() - began


def submit(port: int, body: Body) -> Body:
    """POST one job; its view (any answer but 202 raises)."""
    status, answer = call(port, "POST", "/v1/jobs", body)
    if status != 202:
        raise RuntimeError(f"POST /v1/jobs answered {status}: {answer[:300]!r}")
    return dict(json.loads(answer))


def wait_end(port: int, view: Body, deadline: float) -> Body:
    """:func:`ended`, for a job that must succeed: its view once it has (anything else raises)."""
    view = ended(port, view, deadline)
    if view["status"] != JobStatus.SUCCEEDED:
        raise RuntimeError(f"job {view['id']} ended {view['status']}: {view.get('error')}")
    return view


def ended(port: int, view: Body, deadline: float) -> Body:
    """Follow a job with ``GET /v1/jobs/<id>?wait=30`` until it ends, as slotq's client does; its
    last view, whatever the ending."""
    while not JobStatus(view["status"]).is_terminal:
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {view['id']} still {view['status']} at the deadline")
        asked, before = time.monotonic(), view["status"]
        status, answer = call(port, "GET", f"/v1/jobs/{view['id']}?wait={WAIT_S}")
        if status != 200:
            raise RuntimeError(f"GET /v1/jobs/{view['id']} answered {status}: {answer[:300]!r}")
        view = json.loads(answer)
        if view["status"] == before and time.monotonic() - asked < WAIT_S / 2:
            time.sleep(0.05)  # an API without long polling answers at once: do not spin on it
    return view


def bodies(count: int, size: int, steps: int, first_seed: int = 0) -> list[Body]:
    """The JSON bodies of ``count`` jobs with distinct seeds."""
    return [{**request.model_dump(mode="json", exclude_none=True), "seed": first_seed + index}
            for index, request in enumerate(requests(count, size, steps))]


def burst(port: int, batch: list[Body], clients: int, timeout: float = 1800.0) -> tuple[list[float], float]:
    """Every job of ``batch`` from ``clients`` threads: each job's latency, and the wall time."""
    deadline = time.monotonic() + timeout
    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        latencies = list(pool.map(lambda body: follow(port, body, deadline), batch))
    return latencies, time.perf_counter() - began


def loop_latencies(sections: Sections, clients: int) -> tuple[list[float], float]:
    """The loop's latencies with ``clients`` jobs outstanding, and its wall time."""
    sections = sorted(sections)
    done = [start for start, _ in sections[1:]] + [sections[-1][1]]  # the next job starts once encoded
    sent = [sections[0][0]] * clients + done
    return [end - sent[index] for index, end in enumerate(done)], done[-1] - sections[0][0]


def table(title: str, runs: dict[str, tuple[list[float], float]]) -> list[str]:
    """One row per run: latency percentiles, images per second and its share of the first row's."""
    baseline, baseline_wall = next(iter(runs.values()))
    ceiling = len(baseline) / baseline_wall
    lines = [title, f"{'':32}{'p50 s':>8}{'p95 s':>8}{'p99 s':>8}{'images/s':>10}{'% of loop':>11}"]
    for name, (latencies, wall) in runs.items():
        rate = len(latencies) / wall
        p50, p95, p99 = percentiles(latencies)
        lines.append(f"{name:32}{p50:>8.3f}{p95:>8.3f}{p99:>8.3f}{rate:>10.2f}{100 * rate / ceiling:>10.1f}%")
    return lines


def report(jobs: int = 60, clients: int = 8, size: int = 256, steps: int = 4,
           shared: Service | None = None) -> list[str]:
    """Run the loop, then the service (``shared``, or one of its own), on this machine; the table."""
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        loop = loop_latencies(in_process_loop(bench_settings(Path(scratch), clients),
                                              requests(jobs, size, steps)), clients)
        with serving(shared, Path(scratch), clients) as service:
            burst(service.port, bodies(clients, 64, 1, first_seed=10**6), clients)  # warm every path
            served = burst(service.port, bodies(jobs, size, steps), clients)
    per_image = {name: 1000 * wall / len(latencies) for name, (latencies, wall) in
                 (("loop", loop), ("service", served))}
    return table(f"End to end over HTTP: tiny model, {size}x{size}, {steps} steps, {jobs} jobs, {clients} "
                 "concurrent clients, 2 API processes, 1 worker; latency = POST sent -> PNG received",
                 {"in-process loop (baseline)": loop, "slotq over HTTP": served}) + [
        f"time per image: {per_image['service']:.1f} ms through the service, {per_image['loop']:.1f} ms "
        f"in the loop ({per_image['service'] - per_image['loop']:+.1f} ms)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=60)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print("\n".join(report(args.jobs, args.clients, args.size, args.steps)))


if __name__ == "__main__":
    main()
