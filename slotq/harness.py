"""Start, wait for and stop slotq's processes: a throwaway Redis, API servers and workers.

One harness for the test suite, the benchmarks and ``slotq dev``; each process is started with the
environment that gives it a :class:`Settings`, and stopped the way a supervisor stops it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import SecretStr
from redis import Redis
from rq import Worker

from shared.contract.settings import Settings
from slotq.localredis import free_port, start_redis

STOP_TIMEOUT_S = 10.0  # for each SIGTERM
API_TIMEOUT_S = 60.0
WORKER_TIMEOUT_S = 180.0  # a worker imports torch and diffusers and loads its model before it registers
T = TypeVar("T")


class StartError(RuntimeError):
    """A process exited while it started (one not ready in time raises TimeoutError)."""


def wait_for(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll ``condition`` until it returns something truthy, and return that; TimeoutError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def slotq_env(settings: Settings, **extra: Any) -> dict[str, str]:
    """This environment, but with these settings and ``extra`` (more of their fields) for SLOTQ_*."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLOTQ_")}
    values = settings.model_dump(mode="json")
    values |= {name: value for name, value in settings if _secret(value)}  # not "*****"
    if "job_timeout_s" not in settings.model_fields_set:
        del values["job_timeout_s"]  # unset stays unset: a video model's jobs get their family's
    for name, value in (values | extra).items():
        if value is not None:
            env[f"SLOTQ_{name.upper()}"] = _env_value(value)
    return env


def _secret(value: Any) -> bool:
    """Whether a setting is a secret, or a list of them (SLOTQ_ADMIN_KEYS)."""
    return isinstance(value, SecretStr) or (isinstance(value, list) and any(isinstance(each, SecretStr)
                                                                             for each in value))


def _env_value(value: Any) -> str:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, list):
        value = [each.get_secret_value() if isinstance(each, SecretStr) else each for each in value]
    return json.dumps(value) if isinstance(value, list | dict) else str(value)


@dataclass
class Process:
    """A started process, where its output goes and where it answers (a URL, when it serves one)."""

    popen: subprocess.Popen[bytes]
    log: Path | None = None
    url: str = ""

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def port(self) -> int:
        """The port of its URL."""
        port = urlsplit(self.url).port
        if port is None:
            raise ValueError(f"no port in {self.url!r}")
        return port

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (warm), a second SIGTERM (interrupt), SIGKILL as a last resort; the exit code."""
        for _ in range(2):
            if self.popen.poll() is None:
                self.popen.terminate()
                try:
                    self.popen.wait(timeout)
                except subprocess.TimeoutExpired:
                    continue
        if self.popen.poll() is None:
            self.popen.kill()
        return self.popen.wait()

    def output(self) -> str:
        """What it has written to its log so far."""
        return self.log.read_text(errors="replace") if self.log else ""

    def check_running(self, what: str = "the process") -> None:
        """StartError, with the end of its log, if it has exited."""
        if self.popen.poll() is not None:
            where = f" (log {self.log})" if self.log else ""
            raise StartError(f"{what} exited with {self.popen.returncode}{where}:\n{self.output()[-3000:]}")


def spawn(args: Sequence[str], env: Mapping[str, str], log: Path | None, *, module: str = "slotq.cli",
          new_session: bool = False) -> Process:
    """Start ``python -m MODULE ARGS`` (``slotq ARGS``) with its output in ``log`` (None: this process's)."""
    command = [sys.executable, "-m", module, *args]
    if log is None:
        return Process(subprocess.Popen(command, env=dict(env), start_new_session=new_session))
    with log.open("wb") as handle:  # the child keeps its own copy of the descriptor
        popen = subprocess.Popen(command, env=dict(env), stdout=handle, stderr=subprocess.STDOUT,
                                 start_new_session=new_session)
    return Process(popen, log)


def start_redis_server(data_dir: Path, port: int | None = None, appendonly: bool = False,
                       new_session: bool = False) -> Process:
    """A throwaway ``redis-server`` on loopback, answering; its URL on the :class:`Process`."""
    port = port or free_port()
    popen = start_redis(port, data_dir, appendonly=appendonly, new_session=new_session)
    return Process(popen, data_dir / "redis.log", f"redis://127.0.0.1:{port}/0")


def answers(url: str, path: str = "/healthz") -> bool:
    """Whether ``GET url+path`` answers 200 within a second."""
    try:
        with urllib.request.urlopen(url + path, timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def start_api(settings: Settings, log: Path | None, port: int | None = None, host: str | None = None,
              wait: bool = True, **extra: Any) -> Process:
    """``slotq api`` (gunicorn) on ``port`` (a free one) of ``host`` (SLOTQ_API_HOST's), answering
    /healthz unless ``wait`` is off."""
    port = port or free_port()
    hosted = ["--host", host] if host else []
    process = spawn(["api", *hosted, "--port", str(port)], slotq_env(settings, **extra), log)
    process.url = f"http://{host if host and host != '0.0.0.0' else '127.0.0.1'}:{port}"
    return wait_api(process) if wait else process


def wait_api(process: Process, timeout: float = API_TIMEOUT_S, path: str = "/healthz") -> Process:
    """Until the API at ``process.url`` answers ``path`` (/healthz: it serves; /readyz: and Redis
    answers); one that does not in time is stopped before the error."""
    def up() -> bool:
        process.check_running(f"the API at {process.url}")
        return answers(process.url, path)

    _ready_or_stopped([process], lambda: wait_for(up, timeout, f"the API at {process.url}"))
    return process


def start_worker(settings: Settings, log: Path, wait: bool = True, **extra: Any) -> Process:
    """``slotq worker``, registered with RQ unless ``wait`` is off."""
    process = spawn(["worker"], slotq_env(settings, **extra), log)
    if wait:
        wait_workers([process], settings.redis_url)
    return process


def wait_workers(processes: Sequence[Process], redis_url: str, timeout: float = WORKER_TIMEOUT_S) -> None:
    """Until every one of these workers has registered with RQ (its model is loaded by then); if one
    does not in time, they are all stopped before the error (left running, they would take jobs)."""
    pids = {process.pid for process in processes}

    def registered() -> bool:
        for process in processes:
            process.check_running("a worker")
        return pids <= {worker.pid for worker in Worker.all(connection=connection)}

    what = f"{len(pids)} worker(s) to register"
    with Redis.from_url(redis_url, socket_timeout=5) as connection:
        _ready_or_stopped(processes, lambda: wait_for(registered, timeout, what))


def _ready_or_stopped(processes: Sequence[Process], wait: Callable[[], object]) -> None:
    """Run ``wait``; if it fails (pytest-timeout's interruption included), stop the processes first."""
    try:
        wait()
    except BaseException:
        for process in processes:
            process.stop()
        raise


@dataclass(frozen=True)
class Service:
    """A running slotq: its settings (on its own Redis), Redis, one API and its workers."""

    settings: Settings
    redis: Process
    api: Process
    workers: list[Process]

    @property
    def port(self) -> int:
        return self.api.port

    @property
    def worker(self) -> Process:
        return self.workers[0]


@contextmanager
def service(settings: Settings, scratch: Path, workers: int = 1) -> Iterator[Service]:
    """A throwaway Redis, one ``slotq api`` (ready: /readyz) and ``workers`` workers (registered),
    started side by side, their logs in ``scratch``; stopped on the way out, the workers first."""
    scratch.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        redis = start_redis_server(scratch / "redis")
        stack.callback(redis.stop)
        settings = settings.model_copy(update={"redis_url": redis.url})
        api = start_api(settings, scratch / "api.log", wait=False)
        stack.callback(api.stop)
        started = [start_worker(settings, scratch / f"worker-{index}.log", wait=False)
                   for index in range(workers)]
        for worker in started:
            stack.callback(worker.stop)  # the callbacks run last in, first out
        wait_api(api, path="/readyz")
        wait_workers(started, settings.redis_url)
        yield Service(settings, redis, api, started)
