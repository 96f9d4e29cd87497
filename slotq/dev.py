"""``slotq dev``: a throwaway Redis (unless SLOTQ_REDIS_URL names one), the API and one worker, in one
command. A Redis that merely answers at the default address is someone else's, perhaps another
program's: slotq writes nothing into it unless told to."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from types import FrameType

from dotenv import dotenv_values

from shared.contract.settings import Settings
from slotq.harness import Process, spawn, start_redis_server, wait_api, wait_workers
from slotq.localredis import free_port, is_reachable

log = logging.getLogger(__name__)
STOP_TIMEOUT_S = 30.0
ENV_FILE = Path(".env")  # read by this command as by `docker compose`; the environment wins over it


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run_dev(settings: Settings, host: str, port: int) -> int:
    """Run everything until Ctrl-C or SIGTERM, then stop it all; the exit code."""
    signal.signal(signal.SIGTERM, _interrupt)
    children: list[Process] = []
    env = _with_env_file(dict(os.environ))
    redis_url = settings.redis_url
    with tempfile.TemporaryDirectory(prefix="slotq-dev-") as scratch:
        try:
            if "redis_url" in settings.model_fields_set:  # SLOTQ_REDIS_URL, here or in .env: a choice
                if not is_reachable(redis_url):
                    print(f"slotq: SLOTQ_REDIS_URL ({_shown(redis_url)}) does not answer", file=sys.stderr)
                    return 1
                print(f"slotq: using the Redis of SLOTQ_REDIS_URL ({_shown(redis_url)})", flush=True)
            else:
                redis_port = free_port()
                # Its own session too: a Ctrl-C must not stop it before the worker has finished.
                children.append(start_redis_server(Path(scratch) / "redis", redis_port, new_session=True))
                redis_url = env["SLOTQ_REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
                print(f"slotq: started redis-server on port {redis_port}, a throwaway one: its data goes "
                      "when this stops (SLOTQ_REDIS_URL names a Redis to keep)", flush=True)
            # Own sessions: Ctrl-C reaches only this process, which then stops each child once.
            worker = spawn(["worker"], env, None, new_session=True)
            children.append(worker)
            api = spawn(["api", "--host", host, "--port", str(port)], env, None, new_session=True)
            children.append(api)
            api.url = url = f"http://{host}:{port}"
            wait_api(api, path="/readyz")
            print("slotq: the API answers; waiting for the worker to load the model", flush=True)
            wait_workers([worker], redis_url, timeout=300)
            print(f"slotq: serving on {url} (Ctrl-C stops everything)", flush=True)
            while all(child.popen.poll() is None for child in children):
                time.sleep(0.5)
            print("slotq: a process exited; stopping the others", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nslotq: stopping", flush=True)
            return 0
        finally:
            _stop(reversed(children))


def _with_env_file(env: dict[str, str]) -> dict[str, str]:
    """The children's environment: this one, plus the slotq settings of ENV_FILE it does not set."""
    if not ENV_FILE.is_file():
        return env
    told = {name: value for name, value in dotenv_values(ENV_FILE).items()
            if name.startswith("SLOTQ_") and value is not None}
    return told | env


def _shown(url: str) -> str:
    """A Redis URL as printed: its password left out."""
    return re.sub(r"//[^@/]*@", "//", url)


def _stop(children: Iterable[Process]) -> None:
    # The API first (stop admitting), then the worker (finishes its job), then Redis. A second
    # Ctrl-C while they stop ends them at once, as it does elsewhere.
    remaining = list(children)
    try:
        for child in remaining:
            child.stop(STOP_TIMEOUT_S)
    except KeyboardInterrupt:
        print("slotq: stopping at once", file=sys.stderr, flush=True)
        for child in remaining:
            if child.popen.poll() is None:
                child.popen.kill()
                child.popen.wait()
