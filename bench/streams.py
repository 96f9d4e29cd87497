"""Do open event streams hold the API's threads? Request latency with streams open, per worker class.

    python -m bench.streams [--streams 200] [--threads 4] [--requests 200]

Starts its own ``redis-server`` and, for each gunicorn worker class (``gthread``, ``gevent``), one
``slotq api`` of one process with ``--threads`` threads whose bound (SLOTQ_MAX_STREAMS) is
``--streams``. With no worker, ``--streams`` jobs are queued and a client thread each opens its
event stream and keeps reading it; then ``--requests`` POST /v1/jobs and as many GET /v1/queue
calls are timed, one after another, and ``EXTRA`` more streams are asked for (past the bound: each
should be refused with 503). The baseline is the same calls with no stream open, on the same
process, in this run. A call that does not answer within ``TIMEOUT_S`` counts as timed out.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import threading
import time
from pathlib import Path

from bench.end_to_end import bench_settings
from bench.stats import median, percentile
from shared.contract.settings import Settings
from slotq import harness
from slotq.localredis import running_redis

TIMEOUT_S = 2.0
EXTRA = 10  # streams asked for past the bound
GIVE_UP = 3  # calls timed out, none answered, before the rest are counted as timed out too
JOB = json.dumps({"prompt": "timed", "width": 64, "height": 64, "steps": 1})
CLASSES = ("gthread", "gevent")


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


def latencies(port: int, count: int, method: str) -> tuple[list[float], int]:
    """Seconds of each POST /v1/jobs (or GET /v1/queue) that answered, and how many did not
    within TIMEOUT_S."""
    times, timed_out = [], 0
    path, body = ("/v1/jobs", JOB) if method == "POST" else ("/v1/queue", None)
    for index in range(count):
        if timed_out >= GIVE_UP and not times:  # it answers nothing: the rest would not either
            return times, count - index + timed_out
        began = time.perf_counter()
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
            connection.request(method, path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            if response.status >= 400:
                raise SystemExit(f"{method} {path} answered {response.status}")
            times.append(time.perf_counter() - began)
        except OSError:
            timed_out += 1
    return times, timed_out


def past_the_bound(port: int, job_id: str) -> str:
    """What EXTRA more streams got: how many 503 with Retry-After, and how many no answer."""
    refused = timed_out = 0
    for _ in range(EXTRA):
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
            connection.request("GET", f"/v1/jobs/{job_id}/events")
            response = connection.getresponse()
            refused += response.status == 503 and response.getheader("Retry-After") is not None
            connection.close()
        except OSError:
            timed_out += 1
    return f"{refused} refused (503), {timed_out} no answer"


def row(label: str, times: list[float], timed_out: int, requests: int) -> str:
    if not times:
        return f"{label:44}{'-':>9}{'-':>9}{timed_out:>7}/{requests}"
    return (f"{label:44}{1000 * median(times):>9.1f}{1000 * percentile(times, 0.99):>9.1f}"
            f"{timed_out:>7}/{requests}")


def run_class(settings: Settings, worker_class: str, scratch: Path, streams: int, requests: int) -> list[str]:
    api = harness.start_api(settings, scratch / f"api-{worker_class}.log", api_worker_class=worker_class)
    port = api.port
    try:
        baseline = {method: latencies(port, requests, method) for method in ("POST", "GET")}
        opened, stop_reading = threading.Semaphore(0), threading.Event()
        ids = submitted(port, streams)
        readers = [threading.Thread(target=follow, args=(port, job_id, opened, stop_reading), daemon=True)
                   for job_id in ids]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + TIMEOUT_S * 2  # for all of them: those not open by then never open
        held = sum(opened.acquire(timeout=max(0.0, deadline - time.monotonic())) for _ in readers)
        loaded = {method: latencies(port, requests, method) for method in ("POST", "GET")}
        beyond = (past_the_bound(port, ids[0]) if held == streams
                  else "not asked (the open ones hold every thread)")
        stop_reading.set()
        lines = []
        for method, label in (("POST", "POST /v1/jobs"), ("GET", "GET /v1/queue")):
            lines += [row(f"{worker_class}, {label}, no stream", *baseline[method], requests),
                      row(f"{worker_class}, {label}, {held} streams", *loaded[method], requests)]
        return [*lines, f"{worker_class}, {EXTRA} more streams past the bound of {streams}: {beyond}"]
    finally:
        api.stop()


def report(streams: int = 200, threads: int = 4, requests: int = 200) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch_dir, \
            running_redis(Path(scratch_dir) / "redis") as url:
        scratch = Path(scratch_dir)
        settings = bench_settings(scratch, 1, url).model_copy(
            update={"api_workers": 1, "api_threads": threads, "max_streams": streams})
        lines = [f"Requests with event streams open: one API process, {threads} threads, "
                 f"{requests} calls each",
                 f"{'':44}{'p50 ms':>9}{'p99 ms':>9}{'timed out':>12}"]
        for worker_class in CLASSES:
            lines += run_class(settings, worker_class, scratch, streams, requests)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    print("\n".join(report(args.streams, args.threads, args.requests)))


if __name__ == "__main__":
    main()
