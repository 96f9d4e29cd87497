"""Do open event streams hold the API's threads? Request latency with streams open, per worker class.

    python -m bench.streams [--streams 40] [--threads 4] [--requests 60]

Starts its own ``redis-server`` and, for each gunicorn worker class (``gthread``, ``gevent``), one
``slotq api`` of one process with ``--threads`` threads and room for every stream
(SLOTQ_MAX_STREAMS). With no worker, ``--streams`` jobs are queued and a client thread each opens
its event stream and keeps reading it; then ``--requests`` GET /v1/queue calls are timed, one after
another. The baseline is the same calls with no stream open, on the same process, in this run.
A call that does not answer within ``TIMEOUT_S`` counts as timed out.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.end_to_end import bench_settings, spawn, stop
from shared.contract.settings import Settings
from slotq.localredis import free_port, running_redis

TIMEOUT_S = 2.0
CLASSES = ("gthread", "gevent")


def answers(port: int) -> bool:
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        connection.request("GET", "/healthz")
        return connection.getresponse().status == 200
    except OSError:
        return False


def submitted(port: int, count: int) -> list[str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    ids = []
    for index in range(count):
        body = json.dumps({"prompt": f"streamed {index}", "width": 64, "height": 64, "steps": 1})
        connection.request("POST", "/v1/jobs", body, {"Content-Type": "application/json"})
        ids.append(json.loads(connection.getresponse().read())["id"])
    return ids


def follow(port: int, job_id: str, opened: threading.Semaphore, stop_reading: threading.Event) -> None:
    """Open a job's stream and read it until told to stop."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("GET", f"/v1/jobs/{job_id}/events")
        response = connection.getresponse()
        response.readline()  # the `retry:` line: the stream is open
        opened.release()
        while not stop_reading.is_set() and response.readline():
            pass
    except OSError:
        pass  # never opened (every thread taken) or cut when the API stopped: counted as not open
    finally:
        connection.close()


def latencies(port: int, count: int) -> tuple[list[float], int]:
    """Seconds of each GET /v1/queue that answered, and how many did not within TIMEOUT_S."""
    times, timed_out = [], 0
    for _ in range(count):
        began = time.perf_counter()
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
            connection.request("GET", "/v1/queue")
            connection.getresponse().read()
            times.append(time.perf_counter() - began)
        except OSError:
            timed_out += 1
    return times, timed_out


def row(label: str, times: list[float], timed_out: int, requests: int) -> str:
    if not times:
        return f"{label:34}{'-':>9}{'-':>9}{timed_out:>7}/{requests}"
    ordered = sorted(times)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return f"{label:34}{1000 * statistics.median(ordered):>9.1f}{1000 * p99:>9.1f}{timed_out:>7}/{requests}"


def run_class(settings: Settings, worker_class: str, scratch: Path, streams: int, requests: int) -> list[str]:
    port = free_port()
    api = spawn(["api", "--port", str(port)], settings.model_copy(update={"api_worker_class": worker_class}),
                scratch / f"api-{worker_class}.log")
    try:
        deadline = time.monotonic() + 60
        while not answers(port):
            if time.monotonic() > deadline or api.poll() is not None:
                raise SystemExit(f"the {worker_class} API did not start:\n"
                                 f"{(scratch / f'api-{worker_class}.log').read_text()}")
            time.sleep(0.1)
        baseline = latencies(port, requests)
        opened, stop_reading = threading.Semaphore(0), threading.Event()
        readers = [threading.Thread(target=follow, args=(port, job_id, opened, stop_reading), daemon=True)
                   for job_id in submitted(port, streams)]
        for reader in readers:
            reader.start()
        held = sum(opened.acquire(timeout=TIMEOUT_S) for _ in readers)
        loaded = latencies(port, requests)
        stop_reading.set()
        return [row(f"{worker_class}, no stream (baseline)", *baseline, requests),
                row(f"{worker_class}, {held} of {streams} streams open", *loaded, requests)]
    finally:
        stop(api)


def report(streams: int = 40, threads: int = 4, requests: int = 60) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch_dir, \
            running_redis(Path(scratch_dir) / "redis") as url:
        scratch = Path(scratch_dir)
        settings = bench_settings(scratch, 1, url).model_copy(
            update={"api_workers": 1, "api_threads": threads, "max_streams": streams + 10})
        lines = [f"GET /v1/queue with event streams open: one API process, {threads} threads, "
                 f"{requests} calls", f"{'':34}{'p50 ms':>9}{'p99 ms':>9}{'timed out':>12}"]
        for worker_class in CLASSES:
            lines += run_class(settings, worker_class, scratch, streams, requests)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=40)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--requests", type=int, default=60)
    args = parser.parse_args()
    print("\n".join(report(args.streams, args.threads, args.requests)))


if __name__ == "__main__":
    main()
