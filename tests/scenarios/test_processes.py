"""Real gunicorn API processes: the atomic cap under concurrent load, and the path end to end."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image
from redis import Redis

from shared.contract.settings import Settings
from slotq.client import Client
from slotq.localredis import free_port
from tests.conftest import Process, http_post_job, slotq_env, spawn, wait_for, waiting_ids

CLIENTS = 32
REQUESTS = 240


def post(url: str) -> tuple[int, str | None, str | None]:
    """POST one job; the status, the job id or error code, and Retry-After."""
    status, answer, headers = http_post_job(url, {"prompt": "burst", "width": 64, "height": 64, "steps": 1})
    if status == 202:
        return status, answer["id"], None
    return status, answer["error"]["code"], headers.get("Retry-After")


@pytest.mark.slow
def test_cap_holds_exactly_across_api_processes(settings: Settings, redis: Redis,
                                                start_api: Callable[..., Process]) -> None:
    capacity = 37
    apis = [start_api(settings, queue_capacity=capacity, api_workers=2) for _ in range(3)]
    urls = [apis[i % len(apis)].url for i in range(REQUESTS)]
    with ThreadPoolExecutor(CLIENTS) as pool:
        answers = list(pool.map(post, urls))
    statuses = Counter(status for status, _, _ in answers)
    assert statuses == {202: capacity, 429: REQUESTS - capacity}
    admitted = {ident for status, ident, _ in answers if status == 202}
    queued = set(waiting_ids(redis, settings))
    assert queued == admitted  # exactly the admitted jobs wait: none lost, none extra
    refused = [(ident, retry) for status, ident, retry in answers if status == 429]
    assert all(ident == "queue_full" and retry and int(retry) >= 1 for ident, retry in refused)


def test_cap_of_one_admits_exactly_one(settings: Settings, redis: Redis,
                                       start_api: Callable[..., Process]) -> None:
    apis = [start_api(settings, queue_capacity=1) for _ in range(2)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(post, [apis[i % 2].url for i in range(40)]))
    assert Counter(status for status, _, _ in answers) == {202: 1, 429: 39}
    assert len(waiting_ids(redis, settings)) == 1


@pytest.mark.slow
def test_prompt_posted_to_the_running_service_comes_back_as_png(
        worker: Process, worker_settings: Settings, start_api: Callable[..., Process],
        tmp_path: Path) -> None:
    api = start_api(worker_settings)
    client = Client(api.url)
    view = client.wait(client.submit("a lighthouse at dusk", width=96, height=64, steps=3)["id"], timeout=60)
    assert view["status"] == "succeeded"
    png = client.image_bytes(view["id"])
    assert png.startswith(b"\x89PNG\r\n\x1a\n")
    output = tmp_path / "out.png"
    env = slotq_env(worker_settings)
    result = subprocess.run(
        [sys.executable, "-m", "slotq.cli", "submit", "a lighthouse at dusk", "--url", api.url,
         "--width", "96", "--height", "64", "--steps", "3", "--seed", str(view["request"]["seed"]),
         "-o", str(output)],
        env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert output.read_bytes() == png  # same request, same seed: the same bytes
    with Image.open(output) as picture:
        assert picture.size == (96, 64)


@pytest.mark.slow
def test_api_drains_on_sigterm(settings: Settings, start_api: Callable[..., Process]) -> None:
    api = start_api(settings, drain_s=3, api_workers=1)
    api.popen.send_signal(signal.SIGTERM)

    def draining() -> bool:
        try:
            with urllib.request.urlopen(api.url + "/readyz", timeout=2):
                pass
        except urllib.error.HTTPError as exc:
            return exc.code == 503 and json.loads(exc.read())["error"]["code"] == "draining"
        return False

    wait_for(draining, timeout=10, what="/readyz to answer 503 draining")
    assert post(api.url)[0] == 202  # still serving while it drains
    assert api.popen.wait(30) == 0


def test_api_stops_at_once_on_a_sigterm_while_its_workers_boot(settings: Settings, tmp_path: Path) -> None:
    """A SIGTERM that reaches a worker before it sets its own handlers (a gevent one first patches
    modules, for a few hundred ms) stops it; it was lost, and the worker served on for the
    graceful timeout (20 s here), which every test that stopped a just-started API waited out."""
    port = free_port()
    api = spawn(["api", "--port", str(port)], slotq_env(settings, api_workers=2, api_worker_class="gevent"),
                tmp_path / "api.log")
    try:
        wait_for(lambda: api.output().count("Booting worker with pid") == 2, timeout=30,
                 what="both workers to be forked")
        api.popen.terminate()
        assert api.popen.wait(10) == 0, api.output()
    finally:
        api.stop()
