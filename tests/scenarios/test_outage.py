"""Redis goes away: the API answers 503 quickly, then recovers by itself when Redis is back."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from shared.contract.settings import Settings
from tests.conftest import RedisServer, app_client, post_job, wait_for


def test_redis_down_gives_503_then_recovers(private_redis: RedisServer, model_cache: Path) -> None:
    settings = Settings(redis_url=private_redis.url, redis_timeout_s=1.0, queue_name="outage",
                        cache_dir=model_cache)
    clients = app_client(settings)
    client = next(clients)
    try:
        job_id = post_job(client).get_json()["id"]
        private_redis.stop()

        for method, path in [("post", "/v1/jobs"), ("get", f"/v1/jobs/{job_id}"), ("get", "/readyz")]:
            started = time.monotonic()
            response = post_job(client) if method == "post" else client.get(path)
            assert time.monotonic() - started < 5, "a Redis outage must not hang a request"
            assert response.status_code == 503
            assert response.get_json()["error"]["code"] == "unavailable"
            assert int(response.headers["Retry-After"]) >= 1
        assert client.get("/healthz").status_code == 200  # alive, just not ready

        private_redis.start()
        wait_for(lambda: client.get("/readyz").status_code == 200, what="readiness after restart")
        assert client.get(f"/v1/jobs/{job_id}").get_json()["status"] == "queued"  # AOF kept it
        assert post_job(client).status_code == 202
    finally:
        clients.close()


def test_redis_that_never_answers_gives_503_not_a_hang(tmp_path: Path, model_cache: Path) -> None:
    # A socket that accepts connections (the kernel completes the handshake) but never replies.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        settings = Settings(redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s=0.5,
                            queue_name="silent", cache_dir=model_cache)
        clients = app_client(settings)
        client = next(clients)
        try:
            started = time.monotonic()
            response = post_job(client)
            assert time.monotonic() - started < 5
            assert response.status_code == 503
            assert response.get_json()["error"]["code"] == "unavailable"
            assert client.get("/readyz").status_code == 503
        finally:
            clients.close()
