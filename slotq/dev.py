"""``slotq dev``: Redis (started here when none answers), the API and one worker, in one command."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import FrameType

from redis import Redis
from rq import Worker

from shared.contract.settings import Settings
from slotq.localredis import free_port, is_reachable, start_redis

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_dev(settings: Settings, host: str, port: int) -> int:
    """Run everything until Ctrl-C or SIGTERM, then stop it all; the exit code."""
    signal.signal(signal.SIGTERM, _interrupt)
    children: list[subprocess.Popen[bytes]] = []
    env = dict(os.environ)
    redis_url = settings.redis_url
    with tempfile.TemporaryDirectory(prefix="slotq-dev-") as scratch:
        try:
            if not is_reachable(redis_url):
                redis_port = free_port()
                children.append(start_redis(redis_port, Path(scratch) / "redis"))
                redis_url = env["SLOTQ_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
                print(f"slotq: started redis-server on port {redis_port}", flush=True)
            # Own sessions: Ctrl-C reaches only this process, which then stops each child once.
            cli = [sys.executable, "-m", "slotq.cli"]
            children.append(subprocess.Popen([*cli, "worker"], env=env, start_new_session=True))
            children.append(subprocess.Popen([*cli, "api", "--host", host, "--port", str(port)],
                                             env=env, start_new_session=True))
            url = f"http://{host}:{port}"
            _wait_until_up(url, children)
            print("slotq: the API answers; waiting for the worker to load the model", flush=True)
            _wait_for_worker(redis_url, children)
            print(f"slotq: serving on {url} (Ctrl-C stops everything)", flush=True)
            while all(child.poll() is None for child in children):
                time.sleep(0.5)
            print("slotq: a process exited; stopping the others", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nslotq: stopping", flush=True)
            return 0
        finally:
            _stop(reversed(children))


def _wait_until_up(url: str, children: list[subprocess.Popen[bytes]], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(child.poll() is not None for child in children):
            raise RuntimeError("a slotq process exited during start-up")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the API did not answer on {url} within {timeout:.0f}s")


def _wait_for_worker(redis_url: str, children: list[subprocess.Popen[bytes]],
                     timeout: float = 300.0) -> None:
    with Redis.from_url(redis_url) as connection:
        deadline = time.monotonic() + timeout
        while not Worker.all(connection=connection):
            if any(child.poll() is not None for child in children):
                raise RuntimeError("a slotq process exited during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no worker registered within {timeout:.0f}s")
            time.sleep(0.2)


def _stop(children: object) -> None:
    # The API first (stop admitting), then the worker (finishes its job), then Redis.
    for child in children:  # type: ignore[attr-defined]
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
