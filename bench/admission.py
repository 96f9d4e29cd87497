"""What one admission and one refusal cost, against a bare LPUSH measured in the same run.

    python -m bench.admission [--jobs 2000] [--processes 2] [--clients 16]

Two views of the same question:

- **in-process**, through Flask's WSGI test client (no HTTP): the service's own work per request,
  with the Redis round trips it makes (counted at the client) and the commands Redis runs (counted
  by the server, those inside scripts included). Baseline: one ``LPUSH`` on the same connection.
- **over HTTP**, with ``--processes`` gunicorn API processes and ``--clients`` concurrent keep-alive
  clients: latency and throughput of accepted and refused submits. Baseline: a bare Flask endpoint
  that parses the JSON and does one ``LPUSH``, served by the same gunicorn configuration on the
  same Redis.
"""

from __future__ import annotations

import argparse
import http.client
import json
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from threading import Event

from flask import Flask, jsonify, request
from redis import Redis
from redis.connection import Connection

from api.app import create_app
from bench.stats import median, percentile
from shared.contract.settings import Settings
from shared.store.connection import connect
from slotq import harness
from slotq.localredis import free_port, running_redis

BODY = json.dumps({"prompt": "bench", "width": 256, "height": 256, "steps": 4})
SETTLE_S = 3.0  # after the API first answers, until every gunicorn process takes connections
HEADER = f"{'':36}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}"


class RoundTrips:
    """Counts what redis-py sends: one packed send is one round trip (a pipeline is one)."""

    count = 0
    _send = Connection.send_packed_command

    @classmethod
    @contextmanager
    def counting(cls) -> Iterator[type[RoundTrips]]:
        def send(self: Connection, *args: object, **kwargs: object) -> None:
            cls.count += 1
            cls._send(self, *args, **kwargs)  # type: ignore[arg-type]

        Connection.send_packed_command = send  # type: ignore[method-assign]
        try:
            yield cls
        finally:
            Connection.send_packed_command = cls._send  # type: ignore[method-assign]


def row(name: str, times: list[float], wall: float, *extra: str) -> str:
    return (f"{name:36}{1000 * median(times):>9.3f}{1000 * percentile(times, 0.99):>9.3f}"
            f"{len(times) / wall:>9.0f}" + "".join(f"{value:>11}" for value in extra))


def in_process(url: str, jobs: int, scratch: Path) -> list[str]:
    """The service's own work per request, through the WSGI test client; the table."""
    settings = Settings(redis_url=url, queue_name="in-process", queue_capacity=jobs, cache_dir=scratch)
    client = create_app(settings).test_client()
    connection = Redis.from_url(url)

    def post() -> object:
        return client.post("/v1/jobs", data=BODY, content_type="application/json")

    def measure(call: Callable[[], object]) -> tuple[list[float], float, str, str]:
        commands = int(connection.info("stats")["total_commands_processed"])
        with RoundTrips.counting() as trips:
            trips.count, times, began = 0, [], time.perf_counter()
            for _ in range(jobs):
                started = time.perf_counter()
                call()
                times.append(time.perf_counter() - started)
            wall, sent = time.perf_counter() - began, trips.count
        commands = int(connection.info("stats")["total_commands_processed"]) - commands - 1
        return times, wall, f"{sent / jobs:.1f}", f"{commands / jobs:.1f}"

    post()  # load the admission script once
    connection.flushdb()
    baseline = measure(lambda: connection.lpush("bench:list", "x" * 36))
    admitted = measure(post)
    refused = measure(post)
    assert post().status_code == 429
    return [f"in-process (WSGI test client), {jobs} requests each, one Redis on loopback",
            "round trips: client sends per request; commands: what Redis ran, inside scripts included",
            HEADER + f"{'trips/req':>11}{'cmds/req':>11}",
            row("bare LPUSH (baseline)", *baseline),
            row("POST /v1/jobs admitted (202)", *admitted),
            row("POST /v1/jobs refused (429)", *refused)]


def bare_app(settings: Settings) -> Flask:
    """The ceiling for this stack: Flask under the same gunicorn, parsing the JSON body and pushing it
    with one LPUSH per request."""
    app = Flask("bare")
    connection = connect(settings)
    app.extensions.update({"slotq.settings": settings, "slotq.draining": Event()})

    @app.get("/healthz")
    def healthz() -> tuple[object, int]:
        return jsonify({"status": "ok"}), 200  # what the harness waits for, as with slotq's API

    @app.post("/v1/jobs")
    def push() -> tuple[object, int]:
        request.get_json()
        connection.lpush("bench:bare", request.get_data())
        return jsonify({"id": "x"}), 202

    return app


@contextmanager
def served(settings: Settings, processes: int, bare: bool, scratch: Path, log_level: str = "WARNING",
           settle_s: float = SETTLE_S) -> Iterator[int]:
    """A bare or a slotq API under gunicorn on a free port, both configured alike; the port."""
    settings = settings.model_copy(update={"api_workers": processes, "api_threads": 8, "log_level": log_level,
                                           "drain_s": 0})
    port = free_port()
    args, module = (["--serve-bare", str(port)], "bench.admission") if bare else (
        ["api", "--port", str(port)], "slotq.cli")
    process = harness.spawn(args, harness.slotq_env(settings), scratch / f"api-{port}.log", module=module)
    process.url = f"http://127.0.0.1:{port}"
    try:
        harness.wait_api(process)
        # gunicorn's processes each load the app after forking, so the first to answer may be alone
        # for a moment: keep-alive clients connecting then all land on it.
        time.sleep(settle_s)
        yield port
    finally:
        process.stop(30)


def load(port: int, requests: int, clients: int,
         body: str = BODY) -> tuple[list[float], float, dict[int, int]]:
    """``requests`` POSTs of ``body`` from ``clients`` threads, each on its own keep-alive connection."""
    share = [requests // clients + (index < requests % clients) for index in range(clients)]

    def client(count: int) -> list[tuple[float, int]]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        results = []
        for _ in range(count):
            started = time.perf_counter()
            connection.request("POST", "/v1/jobs", body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            response.read()
            results.append((time.perf_counter() - started, response.status))
        connection.close()
        return results

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [result for batch in pool.map(client, share) for result in batch]
    wall = time.perf_counter() - began
    statuses: dict[int, int] = {}
    for _, status in results:
        statuses[status] = statuses.get(status, 0) + 1
    return [seconds for seconds, _ in results], wall, statuses


def over_http(url: str, jobs: int, processes: int, clients: int, scratch: Path,
              settle_s: float = SETTLE_S) -> list[str]:
    """Accepted and refused submits through real gunicorn processes, against a bare Flask LPUSH."""
    settings = Settings(redis_url=url, queue_name="http", queue_capacity=jobs, cache_dir=scratch)
    with served(settings, processes, True, scratch, settle_s=settle_s) as port:
        load(port, min(200, jobs), clients)  # warm up connections and code paths
        baseline = load(port, jobs, clients)
    with served(settings, processes, False, scratch, settle_s=settle_s) as port:
        admitted = load(port, jobs, clients)
        refused = load(port, jobs, clients)
    lines = [f"over HTTP: gunicorn {settings.api_worker_class}, {processes} API processes x 8 threads, "
             f"{clients} keep-alive "
             f"clients, {jobs} requests each (the load generator shares this machine's cores)",
             HEADER + f"{'statuses':>11}"]
    for name, (times, wall, statuses) in [("bare Flask + LPUSH (baseline)", baseline),
                                          ("POST /v1/jobs admitted", admitted),
                                          ("POST /v1/jobs refused", refused)]:
        lines.append(row(name, times, wall, " ".join(f"{code}x{n}" for code, n in sorted(statuses.items()))))
    assert admitted[2] == {202: jobs} and refused[2] == {429: jobs}, (admitted[2], refused[2])
    return lines


def report(jobs: int = 2000, processes: int = 2, clients: int = 16, settle_s: float = SETTLE_S) -> list[str]:
    """Both views on their own Redis; the tables."""
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch, \
            running_redis(Path(scratch) / "redis") as url:
        return (in_process(url, jobs, Path(scratch)) + [""]
                + over_http(url, jobs, processes, clients, Path(scratch), settle_s))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--serve-bare", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        from api.server import serve
        from shared.contract.settings import load_settings

        serve(port=args.serve_bare, settings=load_settings(), factory=bare_app)
        return
    print("\n".join(report(args.jobs, args.processes, args.clients)))


if __name__ == "__main__":
    main()
