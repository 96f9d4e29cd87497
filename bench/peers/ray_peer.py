"""The Ray Serve peer of ``bench.peers``: ``bench.peers.ray_app`` (a local Ray, Serve's HTTP proxy, one
batching model replica) in a session of its own, and its clients on plain HTTP."""

from __future__ import annotations

import http.client
import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from contextlib import suppress
from pathlib import Path

from bench.peers.peer import Outcome
from bench.peers.trace import TraceJob
from slotq.harness import Process, spawn, wait_for
from slotq.localredis import free_port

START_TIMEOUT_S = 600.0  # Ray starts its own processes, then the replica imports torch and loads the model
STOP_TIMEOUT_S = 60.0  # Serve drains and Ray shuts down from SIGINT
KILL_TIMEOUT_S = 10.0
PID_FILE = "replica.pid"  # under scratch: the model replica's PID, written once its model is loaded
REFUSED = (503, 429)  # Serve's answers over max_queued_requests (503 unless configured otherwise)
PNG = b"\x89PNG\r\n\x1a\n"
READY_JOB = {"side": 64, "steps": 1, "seed": 0}
# Ray's sockets live at TEMP/session_<date>_<time>_<pid>/sockets/<name>, and a Unix socket's path has
# at most 107 bytes: a longer scratch folder gets its Ray folder in the system's temp folder.
MAX_TEMP_DIR_CHARS = 40
REPO = Path(__file__).resolve().parents[2]


class RayServePeer:
    """Ray Serve on the tiny SD pipeline: one replica, ``@serve.batch`` up to ``max_batch`` jobs."""

    name = "Ray Serve"
    priorities = False

    def __init__(self, cache_dir: Path, threads: int, max_batch: int = 8) -> None:
        self.cache_dir = cache_dir
        self.threads = threads
        self.max_batch = max_batch
        self.port = 0
        self._process: Process | None = None
        self._scratch: Path | None = None
        self._temp_dir: Path | None = None  # Ray's, when outside scratch (removed at stop)
        self._lost = 0
        self._lock = threading.Lock()

    def start(self, scratch: Path) -> None:
        """Start ``bench.peers.ray_app`` in a session of its own and wait until it renders a job."""
        scratch.mkdir(parents=True, exist_ok=True)
        self._scratch = scratch
        temp_dir = self._ray_temp_dir(scratch)
        self.port = free_port()
        args = ["--port", str(self.port), "--cache", str(self.cache_dir), "--threads", str(self.threads),
                "--max-batch", str(self.max_batch), "--pid-file", str(scratch / PID_FILE),
                "--temp-dir", str(temp_dir)]
        paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]  # for Ray's workers too
        env = os.environ | {
            "PYTHONPATH": os.pathsep.join(paths),
            "RAY_USAGE_STATS_ENABLED": "0",  # nothing leaves the machine
            # Ray's token auth stays on, with a token of this run's: left to itself, Ray writes one
            # to ~/.ray/auth_token, outside scratch.
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self._process = spawn(args, env, scratch / "ray_app.log", module="bench.peers.ray_app",
                              new_session=True)
        try:
            wait_for(self._serves, START_TIMEOUT_S, "Ray Serve to render a job", interval=1.0)
        except BaseException:
            self.stop()
            raise

    def _ray_temp_dir(self, scratch: Path) -> Path:
        inside = (scratch / "ray").resolve()
        if len(str(inside)) <= MAX_TEMP_DIR_CHARS:
            return inside
        self._temp_dir = Path(tempfile.mkdtemp(prefix="ray-"))
        return self._temp_dir

    def _serves(self) -> bool:
        assert self._process is not None
        self._process.check_running("bench.peers.ray_app")
        try:
            status, payload, _ = self._post(READY_JOB, timeout=120)
        except (OSError, http.client.HTTPException):
            return False  # not listening yet, or the app not deployed yet
        return status == 200 and payload.startswith(PNG)

    def _post(self, job: dict[str, int], timeout: float) -> tuple[int, bytes, bool]:
        """POST the job; the status, the body and whether a Retry-After came."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            connection.request("POST", "/", json.dumps(job), {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, response.read(), response.getheader("Retry-After") is not None
        finally:
            # On a give-up, the closed connection is what tells Serve to cancel the request.
            connection.close()

    def call(self, job: TraceJob, give_up_s: float, start_by_s: float | None = None) -> Outcome:
        """POST the job and wait up to ``give_up_s`` for its PNG (http.client, not urlopen: a client
        that gives up must close its connection at once, and urlopen leaves that to the collector)."""
        began = time.perf_counter()
        try:
            status, payload, retry_after = self._post(
                {"side": job.side, "steps": job.steps, "seed": job.seed}, timeout=give_up_s)
        except TimeoutError:
            return Outcome(admitted=True, gave_up=True)
        except (OSError, http.client.HTTPException):
            return self._lost_one()
        took = time.perf_counter() - began
        if status in REFUSED:
            return Outcome(admitted=False, refused_in_s=took, retry_after=retry_after)
        if status == 200 and payload.startswith(PNG):
            return Outcome(admitted=True, latency_s=took)
        return self._lost_one()

    def _lost_one(self) -> Outcome:
        with self._lock:
            self._lost += 1
        return Outcome(admitted=True, failed=True)

    def lost(self, settle_s: float) -> int:
        """Admitted jobs that ended without an image or a give-up: ``call`` blocks until each job's
        end, so once the replay's calls have returned there is nothing left to settle."""
        with self._lock:
            return self._lost

    def queue_rss(self) -> int:
        """VmRSS of every process of Ray's session but the model replica's (its PID from its file)."""
        if self._process is None or self._scratch is None:
            return 0
        replica = (self._scratch / PID_FILE).read_text().strip()
        return sum(_rss(pid) for pid in _session_pids(self._process.pid) if str(pid) != replica)

    def stop(self) -> None:
        """SIGINT the driver (it shuts Serve and Ray down), then SIGTERM and SIGKILL what is left."""
        if self._process is None:
            return
        popen, session = self._process.popen, self._process.pid
        if popen.poll() is None:
            popen.send_signal(signal.SIGINT)
            with suppress(subprocess.TimeoutExpired):
                popen.wait(STOP_TIMEOUT_S)
        for signum in (signal.SIGTERM, signal.SIGKILL):
            _signal_all(_session_pids(session), signum)
            with suppress(TimeoutError):
                wait_for(lambda: not _session_pids(session), KILL_TIMEOUT_S, "Ray's processes to end", 0.2)
        popen.wait()
        self._process = None
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None


def _session_pids(session: int) -> list[int]:
    """Live processes of this session (``start_new_session``: its id is the leader's PID)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[3]) == session:  # state, ppid, pgrp, session
                pids.append(int(stat.parent.name))
    return pids


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signum)


def _rss(pid: int) -> int:
    """VmRSS of one process in bytes (0 once it is gone)."""
    with suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0
