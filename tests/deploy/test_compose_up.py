"""`docker compose up` for real, on a host with no GPU: the documented CPU command brings up Redis,
the API behind its proxy and a CPU worker, built from a clean copy of the checkout with the
project's Dockerfiles as they are.

Needs a Docker engine (tests/deploy/engine.py starts Debian's dockerd as root) and reaches PyPI and
Debian's mirror from inside its builds. Without an engine these tests skip, unless
``SLOTQ_REQUIRE_DOCKER=1`` (CI) makes that a failure. From cold (no image cached) it takes about
five and a half minutes here, most of it building the images; with them cached, under three.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from slotq.localredis import free_port
from tests.deploy import engine

MISSING = engine.missing()
REQUIRED = os.environ.get("SLOTQ_REQUIRE_DOCKER") == "1"
pytestmark = pytest.mark.skipif(MISSING is not None and not REQUIRED,
                                reason=f"no container engine: {MISSING}")

# The documented way to run the stack on a host with no GPU (README, docs/gpus.md).
FILES = ["-f", "docker-compose.yml", "-f", "docker-compose.cpu.yml"]
# One fixed name: a run that died is brought down by the next, and the next reuses its image tags.
PROJECT = "slotq-compose-test"
README_JOB = {"prompt": "a red fox in snow", "width": 256, "height": 256, "steps": 8, "seed": 42}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class Stack:
    """A compose project of a clean copy of the checkout, and its proxy's URL."""

    command: list[str]
    env: dict[str, str]
    folder: Path
    url: str

    def compose(self, *args: str, timeout: float = 900) -> str:
        """Run a compose command on the project; fail the test with its output if it fails."""
        done = subprocess.run([*self.command, *args], cwd=self.folder, env=self.env, capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, f"compose {' '.join(args)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        return done.stdout

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).split()

    def address(self, container: str) -> str:
        """A container's address on the project's network."""
        return self.docker("inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}",
                           container).strip()

    def docker(self, *args: str) -> str:
        done = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        sent = urllib.request.Request(self.url + path, data=data, method=method,
                                      headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(sent, timeout=70) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def submit(self, job: dict[str, Any]) -> str:
        status, body = self.request("POST", "/v1/jobs", job)
        assert status == 202, body
        return str(json.loads(body)["id"])

    def ended(self, job_id: str, timeout: float = 300) -> dict[str, Any]:
        """The job's view once it ends (each ?wait answers when its status changes)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status, body = self.request("GET", f"/v1/jobs/{job_id}?wait=10")
            assert status == 200, body
            view: dict[str, Any] = json.loads(body)
            if view["status"] in {"succeeded", "failed", "canceled", "expired"}:
                return view
        raise AssertionError(f"job {job_id} did not end in {timeout} s: {view}\n{self.logs()}")

    def logs(self, *services: str) -> str:
        return self.compose("logs", "--no-color", "--tail", "40", *services)


def _clean_copy(folder: Path) -> Path:
    """The files of the checkout that a clone would have (and new ones not ignored), with
    .env.example copied to .env as the docs say."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=engine.ROOT, capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = engine.ROOT / name
        if source.is_file() and name != ".env":
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    shutil.copy2(folder / ".env.example", folder / ".env")
    return folder


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The CPU stack up and healthy (its images built, stand-ins for Docker Hub's where needed);
    brought down with its volumes after."""
    if MISSING:
        pytest.fail(f"SLOTQ_REQUIRE_DOCKER=1 but {MISSING}")
    folder = tmp_path_factory.mktemp("compose")
    checkout = _clean_copy(folder / "slotq")
    with engine.engine(folder) as env:
        binary = engine.compose_binary()
        port = free_port()
        env["SLOTQ_PORT"] = str(port)
        stack = Stack([str(binary), "-p", PROJECT, *FILES], env, checkout, f"http://127.0.0.1:{port}")
        stack.compose("--profile", "*", "down", "--volumes", "--remove-orphans")
        config = json.loads(stack.compose("config", "--format", "json"))
        pulled = [service["image"] for service in config["services"].values() if "build" not in service]
        engine.ensure_images(engine.base_images(pulled), env)
        try:
            stack.compose("up", "--detach", "--build", "--wait", "--wait-timeout", "600", timeout=1800)
        except AssertionError as failure:
            raise AssertionError(f"{failure}\n{stack.logs()}") from None
        try:
            yield stack
        finally:
            stack.compose("--profile", "*", "down", "--volumes", "--remove-orphans", "--timeout", "20")


def _png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(PNG_SIGNATURE), data[:16]
    width, height = struct.unpack(">II", data[16:24])  # IHDR, the first chunk
    return width, height


@pytest.mark.timeout(2400)  # the first test pays for the images' builds
def test_the_readme_job_comes_back_as_a_png(stack: Stack) -> None:
    """The README's job, through the proxy, the API, Redis and the CPU worker: a 256x256 PNG."""
    # `up --wait` returned: the worker's healthcheck said healthy once its model was loaded.
    [worker] = stack.containers("worker")
    assert stack.docker("inspect", "-f", "{{.State.Health.Status}}", worker).strip() == "healthy"
    status, body = stack.request("GET", "/v1/workers")
    assert status == 200 and len(json.loads(body)["workers"]) == 1, body
    # Published on loopback only, unless SLOTQ_BIND_ADDRESS says otherwise.
    assert stack.compose("port", "proxy", "8080").strip() == stack.url.removeprefix("http://")
    view = stack.ended(stack.submit(README_JOB))
    assert view["status"] == "succeeded", view
    status, image = stack.request("GET", view["images"][0])
    assert status == 200
    assert _png_size(image) == (256, 256)
    # The API image is a bare `pip install .[api]`: its gunicorn serves with gevent's worker.
    assert "Using worker: gevent" in stack.compose("logs", "--no-color", "api")


@pytest.mark.timeout(600)
def test_the_api_scales_apart_from_the_one_worker(stack: Stack) -> None:
    """With three API replicas, jobs are admitted through each of them and run by the one worker."""
    stack.compose("up", "--detach", "--scale", "api=3", "--no-recreate", "--wait", "--wait-timeout", "300")
    replicas = {stack.address(container) for container in stack.containers("api")}
    assert len(replicas) == 3, replicas
    since = stack.docker("info", "--format", "{{.SystemTime}}").strip()
    # nginx re-resolves the replicas' name each second: a replica that has just come up may take the
    # first requests' second to be among its upstreams. Jobs go on, a few at a time, until each
    # replica has admitted one (or 30 s pass).
    jobs: list[str] = []
    admitted_by: set[str] = set()
    deadline = time.monotonic() + 30
    while admitted_by != replicas and time.monotonic() < deadline:
        jobs += [stack.submit({"prompt": f"job {len(jobs) + index}", "width": 64, "height": 64, "steps": 2})
                 for index in range(6)]
        admitted_by = set(re.findall(r'"POST /v1/jobs HTTP/1\.1" 202 .* upstream=([\d.]+):8000',
                                     stack.compose("logs", "--no-color", "--since", since, "proxy")))
    assert admitted_by == replicas
    views = [stack.ended(job) for job in jobs]
    assert {view["status"] for view in views} == {"succeeded"}
    assert len({view["worker"] for view in views}) == 1


@pytest.mark.timeout(600)
def test_scaling_the_api_down_stalls_no_request(stack: Stack) -> None:
    """Right after replicas are removed, requests reach the one left without waiting on the others'
    addresses (nginx re-resolves each second and gives up on a silent address after one)."""
    stack.compose("up", "--detach", "--scale", "api=1", "--no-recreate", "--wait", "--wait-timeout", "300")
    slowest = 0.0
    for _ in range(20):
        began = time.monotonic()
        status, body = stack.request("GET", "/v1/queue")
        slowest = max(slowest, time.monotonic() - began)
        assert status == 200, body
    # A stall is a connect timeout per removed replica (5 s each with the former settings).
    assert slowest < 3.0, f"a request waited {slowest:.1f} s after the API was scaled down"


@pytest.mark.timeout(900)
def test_a_job_whose_worker_is_killed_runs_again(stack: Stack) -> None:
    """SIGKILL of the worker mid-job, then a start: the job ends `succeeded`, at attempt 2."""
    job = stack.submit({"prompt": "a long one", "width": 768, "height": 768, "steps": 100, "seed": 1})
    deadline = time.monotonic() + 300
    while True:
        status, body = stack.request("GET", f"/v1/jobs/{job}?wait=5")
        view = json.loads(body)
        if view["status"] == "running" and (view.get("progress") or {}).get("step", 0) >= 1:
            break
        assert view["status"] in {"queued", "running"} and time.monotonic() < deadline, view
    stack.compose("kill", "worker")
    stack.compose("start", "worker")
    view = stack.ended(job, timeout=600)
    assert view["status"] == "succeeded", view
    assert view["attempt"] == 2, view


@pytest.mark.timeout(600)
def test_down_with_every_profile_leaves_nothing_running(stack: Stack) -> None:
    """`--profile "*" down` stops a profile's worker too (a plain `down` would leave it), and with
    --volumes nothing of the project is left."""
    stack.compose("--profile", "xl", "up", "--detach", "--no-deps", "worker-xl")
    assert stack.containers("worker-xl")
    stack.compose("--profile", "*", "down", "--volumes", "--remove-orphans", "--timeout", "20")
    label = f"label=com.docker.compose.project={PROJECT}"
    assert stack.docker("ps", "--all", "--quiet", "--filter", label).split() == []
    assert stack.docker("volume", "ls", "--quiet", "--filter", label).split() == []
    assert stack.docker("network", "ls", "--quiet", "--filter", label).split() == []
