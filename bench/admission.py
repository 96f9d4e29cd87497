"""What one admission and one refusal cost: Redis commands and latency, against a bare LPUSH.

    python -m bench.admission [--jobs 2000]

In-process through Flask's WSGI test client (no HTTP, no network), so the figures are the
service's own work: validation, the admission transaction, the JSON answer. The baseline is one
``LPUSH`` per request on the same Redis connection, the floor for "admit into a Redis list".
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from redis import Redis

from api.app import create_app
from shared.localredis import free_port, start_redis
from shared.settings import Settings

BODY = json.dumps({"prompt": "bench", "width": 256, "height": 256, "steps": 4})


def measure(connection: Redis, count: int, call: Callable[[], object]) -> tuple[list[float], float]:
    """Per-call seconds, and Redis commands per call (from the server's own counter)."""
    before = int(connection.info("stats")["total_commands_processed"])
    times = []
    for _ in range(count):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    after = int(connection.info("stats")["total_commands_processed"])
    return times, (after - before - 1) / count  # the first INFO is counted by the second


def row(name: str, times: list[float], commands: float) -> str:
    ordered = sorted(times)
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    return (f"{name:34}{1000 * statistics.median(ordered):>9.3f}{1000 * p99:>9.3f}"
            f"{commands:>11.1f}{len(ordered) / sum(ordered):>10.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        port = free_port()
        server = start_redis(port, Path(scratch) / "redis")
        try:
            url = f"redis://127.0.0.1:{port}/0"
            settings = Settings(redis_url=url, queue_capacity=args.jobs, cache_dir=Path(scratch))
            client = create_app(settings).test_client()
            connection = Redis.from_url(url)

            def post() -> object:
                return client.post("/v1/jobs", data=BODY, content_type="application/json")

            baseline = measure(connection, args.jobs, lambda: connection.lpush("bench:list", "x" * 36))
            admitted = measure(connection, args.jobs, post)
            refused = measure(connection, args.jobs, post)
            assert post().status_code == 429
        finally:
            server.terminate()
            server.wait(10)
    print(f"{args.jobs} requests each, in-process (WSGI test client), one Redis on loopback")
    print("cmds/req: commands Redis executed per request, those run inside scripts included")
    print(f"{'':34}{'p50 ms':>9}{'p99 ms':>9}{'cmds/req':>11}{'req/s':>10}")
    print(row("bare LPUSH (baseline)", *baseline))
    print(row("POST /v1/jobs admitted (202)", *admitted))
    print(row("POST /v1/jobs refused (429)", *refused))


if __name__ == "__main__":
    main()
