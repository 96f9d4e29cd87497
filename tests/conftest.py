"""Shared fixtures: one real redis-server per session, real API and worker processes on demand."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from redis import Redis
from redis.connection import Connection
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue

from api import state
from api.app import create_app
from shared.contract import keys
from shared.contract.jobs import PRIORITIES
from shared.contract.settings import Settings
from slotq import harness
from slotq.harness import Process, start_worker
from slotq.harness import slotq_env as slotq_env  # re-exported: the tests import it from here
from slotq.harness import spawn as spawn
from slotq.localredis import free_port

DEADLINE_S = 60.0
# A worker that runs one job per execution: for tests of what one execution does (claiming ahead,
# counting executions, timing one job), where the defaults would batch and join (docs/settings.md).
ONE_AT_A_TIME: dict[str, Any] = {"max_batch": 1, "step_scheduling": False}

# The suite's workers run torch on one thread: the suite's two processes and all that they start share
# two cores, where an operator on two threads waits whenever another process takes one of them
# (docs/settings.md). Choosing the count per execution is tested on its own (tests/worker/test_main.py).
os.environ.setdefault("SLOTQ_TORCH_THREADS", "1")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test marked ``alone`` (it times the machine) runs, fixtures and all, with no other test
    beside it: under pytest-xdist the other process waits at its next test, and the others run side
    by side."""
    with machine(alone=item.get_closest_marker("alone") is not None):
        return (yield)


@contextmanager
def machine(alone: bool) -> Iterator[None]:
    """The machine, shared or alone: a fair reader-writer lock on two files of this run's. A test
    alone holds the turnstile throughout, so no other starts while it waits for the running one."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:  # one process
        yield
        return
    folder = Path(tempfile.gettempdir()) / f"slotq-tests-{run}"
    folder.mkdir(exist_ok=True)
    with (folder / "turnstile").open("a") as turnstile, (folder / "machine").open("a") as held:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(held, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        yield  # closing the files lets go of both


def wait_for(condition: Callable[[], Any], timeout: float = DEADLINE_S, what: str = "condition") -> Any:
    """Poll ``condition`` until it returns something truthy, or fail the test at the deadline."""
    try:
        return harness.wait_for(condition, timeout, what, interval=0.02)
    except TimeoutError as error:
        raise AssertionError(str(error)) from None


class LosesOneReply(Connection):
    """A connection that reads a reply and then fails as if it had timed out: a reply lost after
    Redis ran the command. ``lose_at``: which reply to lose, counting those read (by any connection
    of this class) from when it is set; 1 is the next."""

    lose_at = 0

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        response = super().read_response(*args, **kwargs)
        if LosesOneReply.lose_at:
            LosesOneReply.lose_at -= 1
            if not LosesOneReply.lose_at:
                raise RedisTimeoutError("Timeout reading from socket (the test lost the reply)")
        return response


# The line's order and RQ's lists, read in one step (a worker may claim between two reads).
LINE_SNAPSHOT_LUA = """
local ordered, listed = {}, {}
for i = 2, #ARGV do
  for _, id in ipairs(redis.call('ZRANGE', KEYS[1] .. ':' .. ARGV[i], 0, -1)) do table.insert(ordered, id) end
end
for _, key in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if string.sub(key, 1, #ARGV[1]) == ARGV[1] then
    for _, id in ipairs(redis.call('LRANGE', key, 0, -1)) do table.insert(listed, id) end
  end
end
return {ordered, listed}
"""


def waiting_ids(redis: Redis, settings: Settings, model: str | None = None) -> list[str]:
    """The ids of the jobs waiting in a model's line (the default's), in the order a worker takes
    them; checks that RQ's lists hold exactly these ids (the line's order and its lists never disagree)."""
    line = settings.line_of(model or settings.default_model)
    lists = keys.RQ_QUEUE_PREFIX + line + keys.QUEUE_SEPARATOR
    ordered, listed = redis.eval(LINE_SNAPSHOT_LUA, 2, keys.line_key(line), keys.RQ_QUEUES_KEY,
                                 lists, *PRIORITIES)
    ordered, listed = [raw.decode() for raw in ordered], [raw.decode() for raw in listed]
    assert sorted(listed) == sorted(ordered), f"RQ's lists hold {listed}, the line's order {ordered}"
    return ordered


def rq_queues(redis: Redis, settings: Settings) -> list[Queue]:
    """The RQ queues of the slotq line, as RQ's own registry of queues lists them."""
    prefix = settings.queue_name + keys.QUEUE_SEPARATOR
    return [queue for queue in Queue.all(connection=redis) if queue.name.startswith(prefix)]


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server on a free port, for the whole session."""
    server = harness.start_redis_server(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@dataclass
class RedisServer:
    """A redis-server of one test's own, which the test may stop and start again."""

    port: int
    data: Path
    appendonly: bool = False
    process: Process | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = harness.start_redis_server(self.data, self.port, appendonly=self.appendonly)

    def stop(self) -> None:
        """A clean shutdown: with AOF on, every acknowledged write is on disk."""
        if self.process is not None:
            self.process.stop(30)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server with AOF on, for tests that stop and restart it."""
    server = RedisServer(free_port(), tmp_path / "private-redis", appendonly=True)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one thread for a module of in-process images, the count restored after it: the images
    take milliseconds, and while another process keeps the two cores busy OpenMP's waiting threads
    slowed such a module from 7 s to 45-90 s. Its modules ask for it with ``pytestmark``."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tiny model is written once for the session."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture
def settings(redis_url: str, model_cache: Path) -> Iterator[Settings]:
    """Settings for one test on a freshly flushed database; the queue has no worker."""
    connection = Redis.from_url(redis_url)
    connection.flushdb()
    yield Settings(redis_url=redis_url, queue_name="api-tests", queue_capacity=5, cache_dir=model_cache,
                   drain_s=0, heartbeat_ttl_s=2)
    connection.close()


@pytest.fixture
def redis(settings: Settings) -> Iterator[Redis]:
    """A client on the test database."""
    connection = Redis.from_url(settings.redis_url)
    yield connection
    connection.close()


def app_client(settings: Settings) -> Iterator[FlaskClient]:
    """An in-process API whose Redis connections are closed afterwards."""
    app = create_app(settings)
    try:
        yield app.test_client()
    finally:
        state.close(app)


@pytest.fixture
def client(settings: Settings) -> Iterator[FlaskClient]:
    """The API in-process, for fast contract tests."""
    yield from app_client(settings)


@pytest.fixture
def start_api(tmp_path: Path) -> Iterator[Callable[..., Process]]:
    """Start real gunicorn API processes: ``start_api(settings, **env)``."""
    started: list[Process] = []

    def start(settings: Settings, port: int | None = None, **extra: Any) -> Process:
        port = port or free_port()
        process = harness.start_api(settings, tmp_path / f"api-{port}.log", port, wait=False, **extra)
        started.append(process)
        return harness.wait_api(process, DEADLINE_S)

    yield start
    for process in started:
        process.stop()


def own_database(redis_url: str, number: int) -> str:
    """Database ``number`` of the session's redis-server, emptied: a queue of a module's own, apart
    from the per-test flushes of database 0."""
    url = redis_url.removesuffix("/0") + f"/{number}"
    with Redis.from_url(url) as connection:
        connection.flushdb()
    return url


def running_worker(settings: Settings, tmp_path_factory: pytest.TempPathFactory, label: str,
                   clean_stop: bool = True, **extra: Any) -> Iterator[Process]:
    """A fixture's real worker (``yield from`` it), its log in a folder named after ``label``. It is
    stopped afterwards; with ``clean_stop`` the stop must exit 0 (its log shown if not)."""
    process = start_worker(settings, tmp_path_factory.mktemp(label) / "worker.log", **extra)
    yield process
    code = process.stop()
    if clean_stop:
        assert code == 0, process.output()


def running_api(settings: Settings, tmp_path_factory: pytest.TempPathFactory, label: str,
                **extra: Any) -> Iterator[Process]:
    """A fixture's real API process (``yield from`` it), its log in a folder named after ``label``."""
    process = harness.start_api(settings, tmp_path_factory.mktemp(label) / "api.log", **extra)
    yield process
    process.stop()


@pytest.fixture(scope="session")
def worker_settings(redis_url: str, model_cache: Path) -> Settings:
    """Settings shared by the session's worker and the tests that feed it."""
    # Database 1: the per-test flush of database 0 never touches the worker's queue.
    return Settings(redis_url=redis_url.removesuffix("/0") + "/1", queue_name="worker-tests",
                    queue_capacity=50, cache_dir=model_cache, max_steps=100, max_side=1024,
                    drain_s=0, worker_metrics_port=free_port())


@pytest.fixture(scope="session")
def worker(worker_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """One real worker with the tiny model for the session. Its SLOTQ_MAX_STEPS is lower than
    the API's, so a job the API admits with more steps fails in the worker's re-validation: a
    real failing job."""
    yield from running_worker(worker_settings, tmp_path_factory, "worker", max_steps=60)


@pytest.fixture
def worker_client(worker: Process, worker_settings: Settings) -> Iterator[FlaskClient]:
    """An in-process API on the queue that the session's worker serves."""
    yield from app_client(worker_settings)


def http_post_job(url: str, body: dict[str, Any], key: str | None = None,
                  headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any], Any]:
    """POST a job to a real API process: the status, the JSON answer and the headers."""
    import urllib.error
    import urllib.request

    sent = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {}),
            **(headers or {})}
    request = urllib.request.Request(url + "/v1/jobs", data=json.dumps(body).encode(), method="POST",
                                     headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def data_url(image: Any, format: str = "PNG") -> str:
    """A Pillow image as the base64 ``data:`` URL a client sends as a job's ``image`` or ``mask``."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format)
    return f"data:image/{format.lower()};base64,{base64.b64encode(buffer.getvalue()).decode()}"


def start_image(width: int = 256, height: int = 256, seed: int = 0) -> Any:
    """A start image with structure (noise over a gradient), the same for the same arguments."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    gradient = np.linspace(0, 255, width, dtype=np.float32)[None, :, None].repeat(height, 0).repeat(3, 2)
    pixels = np.clip(gradient + rng.normal(0, 40, (height, width, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB")


def box_mask(width: int = 256, height: int = 256) -> Any:
    """A mask that repaints the middle of the image (white) and keeps the rest (black)."""
    from PIL import Image, ImageDraw

    mask = Image.new("L", (width, height), 0)
    box = (width // 4, height // 4, 3 * width // 4 - 1, 3 * height // 4 - 1)
    ImageDraw.Draw(mask).rectangle(box, fill=255)
    return mask


def post_job(client: FlaskClient, **body: Any) -> Any:
    """POST a job and return the response."""
    return client.post("/v1/jobs", data=json.dumps({"prompt": "a red fox", **body}),
                       content_type="application/json")


def wait_for_status(client: FlaskClient, job_id: str, *statuses: str, timeout: float = DEADLINE_S) -> dict:
    """Poll a job until it reaches one of ``statuses``; returns its view."""
    def reached() -> dict | None:
        view = client.get(f"/v1/jobs/{job_id}").get_json()
        return view if view["status"] in statuses else None

    return wait_for(reached, timeout, what=f"job {job_id} to become {'/'.join(statuses)}")


@contextmanager
def drained_and_resumed(settings: Settings, body: dict[str, Any], logs: Path, after_step: int = 2
                        ) -> Iterator[tuple[FlaskClient, dict]]:
    """A job posted to a worker that gets SIGTERM (stop it with SLOTQ_STOP_TIMEOUT_S in ``settings``)
    once the job has run ``after_step`` steps: the job saves the step the drain interrupted and goes
    back to its line; a second worker resumes it there. Yields the API's client and the job's view,
    succeeded; both workers' logs are in ``logs``."""
    first, second = start_worker(settings, logs / "first.log"), None
    try:
        with Redis.from_url(settings.redis_url) as redis, contextmanager(app_client)(settings) as client:
            job_id = post_job(client, **body).get_json()["id"]
            running = wait_for(lambda: (view := client.get(f"/v1/jobs/{job_id}").get_json())["progress"]
                               and view["progress"]["step"] >= after_step and view, 120, "the job to run")
            first.popen.send_signal(signal.SIGTERM)
            assert first.popen.wait(60) == 0
            saved = int(redis.hget(keys.checkpoint_key(job_id), "step") or 0)
            assert after_step <= saved < running["progress"]["total"]  # where the drain interrupted it
            assert client.get(f"/v1/jobs/{job_id}").get_json()["status"] == "queued"
            second = start_worker(settings, logs / "second.log")
            done = wait_for_status(client, job_id, "succeeded", "failed", timeout=180)
            assert done["status"] == "succeeded" and done["resumed_from_step"] == saved, done
            yield client, done
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0, second.output()


def raw_request(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are (no client library would send them) to a server on this machine and
    read the answer whole: its status, headers and body."""
    import socket

    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body
