"""The Python client against real API processes: typed errors, retries, waiting, and ``slotq submit``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from PIL import Image
from redis import Redis

from shared.contract.settings import Settings
from slotq import client as slotq
from slotq.client import (
    APIError,
    Client,
    ConflictError,
    ForbiddenError,
    InvalidRequestError,
    NotFoundError,
    QueueFullError,
    RateLimitedError,
    ServerError,
    UnauthorizedError,
    UnavailableError,
)
from slotq.localredis import free_port
from tests.conftest import Process, RedisServer, http_post_job, slotq_env, waiting_ids

SMALL = {"width": 64, "height": 64, "steps": 2}
KEYS = '{"k": "t", "k2": {"tenant": "t2", "priorities": ["low"]}}'


class Pauses(list[float]):
    """An injected ``sleep`` that records each pause instead of sleeping."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def test_client_imports_without_flask_redis_pydantic_or_torch() -> None:
    code = ("import sys, slotq.client; "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'flask', 'werkzeug', 'redis', 'rq', 'pydantic', 'torch', 'diffusers'}); "
            "print(heavy); sys.exit(bool(heavy))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(("status", "code", "kind"), [
    (422, "invalid_request", InvalidRequestError), (413, "payload_too_large", InvalidRequestError),
    (401, "unauthorized", UnauthorizedError), (403, "priority_not_allowed", ForbiddenError),
    (409, "idempotency_conflict", ConflictError), (429, "tenant_queue_full", QueueFullError),
    (429, "rate_limited", RateLimitedError), (503, "draining", UnavailableError),
    (500, "internal_error", ServerError),
    # Unknown codes fall back on the status: a proxy's 502 without our envelope is "unavailable".
    (502, "http_error", UnavailableError), (404, "http_error", NotFoundError),
    (418, "teapot", APIError), (507, "http_error", ServerError),
])
def test_error_class_by_code_then_status(status: int, code: str, kind: type[APIError]) -> None:
    error = slotq.api_error(status, code, "message", 3, [{"loc": ["width"], "msg": "bad"}])
    assert type(error) is kind and isinstance(error, APIError)
    assert (error.status, error.code, error.retry_after, error.details) == (status, code, 3,
                                                                           [{"loc": ["width"], "msg": "bad"}])


def test_typed_errors_from_a_real_api(settings: Settings, start_api: Callable[..., Process]) -> None:
    api = start_api(settings, api_keys=KEYS)
    pauses = Pauses()
    with pytest.raises(UnauthorizedError) as missing:
        Client(api.url, sleep=pauses).submit("a fox", **SMALL)
    assert (missing.value.status, missing.value.code) == (401, "unauthorized")
    with pytest.raises(UnauthorizedError):
        Client(api.url, api_key="nope").get("some-id")
    with pytest.raises(ForbiddenError) as forbidden:
        Client(api.url, api_key="k2", sleep=pauses).submit("a fox", priority="high", **SMALL)
    assert (forbidden.value.status, forbidden.value.code) == (403, "priority_not_allowed")

    client = Client(api.url, api_key="k", sleep=pauses)
    with pytest.raises(NotFoundError) as unknown:
        client.get("no-such-job")
    assert (unknown.value.status, unknown.value.code) == (404, "not_found")
    with pytest.raises(InvalidRequestError) as invalid:
        client.submit("a fox", width=65)
    assert (invalid.value.status, invalid.value.code) == (422, "invalid_request")
    assert invalid.value.details and invalid.value.details[0]["loc"] == ["width"]

    job_id = client.submit("a fox", **SMALL)["id"]
    with pytest.raises(NotFoundError):
        Client(api.url, api_key="k2").get(job_id)  # another tenant's job
    with pytest.raises(ConflictError) as not_ready:
        client.image_bytes(job_id)
    assert not_ready.value.code == "not_ready"
    assert client.cancel(job_id)["status"] == "canceled"
    with pytest.raises(ConflictError) as finished:
        client.cancel(job_id)
    assert finished.value.code == "already_finished"
    assert pauses == []  # none of these is retried


def test_full_queue_is_retried_after_retry_after_then_refused(
        settings: Settings, redis: Redis, start_api: Callable[..., Process]) -> None:
    api = start_api(settings, queue_capacity=1)
    first = Client(api.url).submit("the one place", **SMALL)
    status, _, headers = http_post_job(api.url, {"prompt": "probe", **SMALL})
    assert status == 429
    pauses = Pauses()
    with pytest.raises(QueueFullError) as refused:
        Client(api.url, retries=2, sleep=pauses).submit("no room", **SMALL)
    assert (refused.value.status, refused.value.code) == (429, "queue_full")
    assert refused.value.retry_after == int(headers["Retry-After"]) >= 1
    assert pauses == [refused.value.retry_after] * 2  # each pause is the answer's Retry-After
    assert waiting_ids(redis, settings) == [first["id"]]

    capped = Pauses()
    with pytest.raises(QueueFullError):
        Client(api.url, retries=1, max_retry_wait=0.25, sleep=capped).submit("no room", **SMALL)
    assert capped == [0.25]


def test_the_client_lists_jobs_across_pages(settings: Settings, start_api: Callable[..., Process]) -> None:
    api = start_api(settings, queue_capacity=10)
    client = Client(api.url)
    ids = [client.submit("listed", **SMALL)["id"] for _ in range(5)]
    client.cancel(ids[0])
    assert [view["id"] for view in client.jobs(limit=2)] == ids[::-1]  # three pages
    assert [view["id"] for view in client.jobs("canceled")] == [ids[0]]
    assert [view["id"] for view in client.jobs("queued", "canceled", limit=4)] == ids[::-1]


def test_unreachable_api_is_retried_with_backoff() -> None:
    pauses = Pauses()
    client = Client(f"http://127.0.0.1:{free_port()}", retries=3, max_retry_wait=1.5, sleep=pauses)
    with pytest.raises(UnavailableError) as unreachable:
        client.submit("nobody listens", **SMALL)
    assert (unreachable.value.status, unreachable.value.code) == (503, "unreachable")
    assert pauses == [0.5, 1.0, 1.5]  # 0.5 s doubling, capped at max_retry_wait
    pauses.clear()
    with pytest.raises(UnavailableError):
        client.get("any")
    assert pauses == [0.5, 1.0, 1.5]
    pauses.clear()
    with pytest.raises(UnavailableError):
        client.cancel("any")  # a cancel without an answer may have landed: not sent again
    assert pauses == []


def test_503_while_redis_is_down_is_retried_until_it_is_back(
        settings: Settings, private_redis: RedisServer, start_api: Callable[..., Process]) -> None:
    api = start_api(settings, redis_url=private_redis.url, redis_timeout_s=0.5)
    private_redis.stop()
    pauses = Pauses()
    with pytest.raises(UnavailableError) as unavailable:
        Client(api.url, retries=2, sleep=pauses).submit("redis is down", **SMALL)
    assert (unavailable.value.status, unavailable.value.code) == (503, "unavailable")
    assert unavailable.value.retry_after is not None and unavailable.value.retry_after >= 1
    assert pauses == [unavailable.value.retry_after] * 2

    def restart_redis(seconds: float) -> None:
        pauses.append(seconds)
        private_redis.start()

    pauses.clear()
    view = Client(api.url, retries=2, sleep=restart_redis).submit("redis is back", **SMALL)
    assert view["status"] == "queued" and pauses == [unavailable.value.retry_after]


def test_same_idempotency_key_gives_the_same_job(settings: Settings, redis: Redis,
                                                 start_api: Callable[..., Process]) -> None:
    client = Client(start_api(settings).url)
    first = client.submit("once", idempotency_key="order-17", **SMALL)
    again = client.submit("once", idempotency_key="order-17", **SMALL)
    assert again["id"] == first["id"] and again["request"]["seed"] == first["request"]["seed"]
    with pytest.raises(ConflictError) as conflict:
        client.submit("another body", idempotency_key="order-17", **SMALL)
    assert conflict.value.code == "idempotency_conflict"
    other = client.submit("once", **SMALL)  # a new key per call: a second job
    assert other["id"] != first["id"]
    assert sorted(waiting_ids(redis, settings)) == sorted([first["id"], other["id"]])


@pytest.mark.slow
def test_wait_and_prefer_wait_on_the_worker(worker: Process, worker_settings: Settings,
                                            start_api: Callable[..., Process]) -> None:
    client = Client(start_api(worker_settings).url)
    job_id = client.submit("followed", **SMALL)["id"]
    view = client.wait(job_id, timeout=60)
    assert view["status"] == "succeeded" and len(view["images"]) == 1
    assert client.image_bytes(job_id).startswith(b"\x89PNG\r\n\x1a\n")

    seen: list[str] = []
    reads: list[str] = []
    counting = Client(client.base_url)
    counting._request = lambda method, path, *rest: reads.append(path) or Client._request(  # type: ignore[method-assign]
        counting, method, path, *rest)
    followed = counting.wait(client.submit("followed", **SMALL)["id"], timeout=60,
                             on_update=lambda v: seen.append(v["status"]))
    # The worker is idle: the job may have started before the stream opened (then no `queued`).
    assert followed["status"] == seen[-1] == "succeeded" and seen[0] in ("queued", "running")
    assert "running" in seen
    assert reads == []  # it followed the event stream: not one poll

    # Long enough to be running when the stream first reads it: a stream leaves out a `started`
    # the job has moved past, and two steps on an idle worker could end before it opened.
    streamed = {**SMALL, "steps": 16}
    events = list(client.events(client.submit("streamed", **streamed)["id"], timeout=60))
    names = [name for name, _ in events]
    assert names[0] in ("queued", "started") and "started" in names and names[-1] == "succeeded"
    steps = [data["step"] for name, data in events if name == "progress"]
    assert steps[0] == 0 and steps[-1] == streamed["steps"] and steps == sorted(steps)

    finished = client.submit("held", wait=30, **SMALL)
    assert finished["status"] == "succeeded" and finished["images"]


@pytest.mark.slow
def test_cli_submit_waits_with_position_and_progress_and_saves_the_png(
        worker: Process, worker_settings: Settings, start_api: Callable[..., Process],
        tmp_path: Path) -> None:
    api = start_api(worker_settings)
    output = tmp_path / "out.png"
    result = subprocess.run(
        [sys.executable, "-m", "slotq.cli", "submit", "a lighthouse", "--url", api.url, "--wait",
         "--width", "96", "--height", "64", "--steps", "6", "-o", str(output)],
        env=slotq_env(worker_settings), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.strip()
    assert Client(api.url).get(job_id)["status"] == "succeeded"
    lines = result.stderr.splitlines()
    assert "\r" not in result.stderr  # not a terminal: a line per change
    assert lines[0].startswith("queued: position ")
    assert all(line.startswith(("queued: position ", "running", "succeeded", "saved ")) for line in lines)
    assert lines[-2:] == ["succeeded", f"saved {output}"]
    with Image.open(output) as picture:
        assert picture.size == (96, 64)


@pytest.mark.slow
def test_cli_submit_with_a_start_image_and_the_client_reads_the_input_back(
        worker: Process, worker_settings: Settings, start_api: Callable[..., Process],
        tmp_path: Path) -> None:
    api = start_api(worker_settings)
    start, output = tmp_path / "start.png", tmp_path / "out.png"
    Image.effect_noise((96, 64), 60).convert("RGB").save(start)
    result = subprocess.run(
        [sys.executable, "-m", "slotq.cli", "submit", "a lighthouse, repainted", "--url", api.url,
         "--image", str(start), "--strength", "0.5", "--steps", "4", "-o", str(output)],
        env=slotq_env(worker_settings), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    client = Client(api.url)
    view = client.get(result.stdout.strip())
    assert view["request"]["image"]["width"] == 96 and view["progress"] == {"step": 2, "total": 2}
    assert client.input_bytes(view["id"]) == start.read_bytes()
    with Image.open(output) as picture:
        assert picture.size == (96, 64)
    (model,) = client.models()
    assert (model["name"], model["checkpoint"], model["family"], model["workers"]) == (
        "default", "tiny", "sd", 1)

    with pytest.raises(InvalidRequestError) as refused:
        client.submit("a cut image", image=slotq.data_url(start)[:200])
    assert refused.value.code == "invalid_image" and refused.value.status == 422
    (tmp_path / "notes.txt").write_text("not a picture")
    with pytest.raises(ValueError, match="not a PNG, JPEG or WebP"):
        slotq.data_url(tmp_path / "notes.txt")
    missing = subprocess.run([sys.executable, "-m", "slotq.cli", "submit", "x", "--url", api.url, "--image",
                              str(tmp_path / "absent.png")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "absent.png" in missing.stderr
