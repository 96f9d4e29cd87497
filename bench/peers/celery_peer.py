"""Celery as a peer: its own redis-server (broker and result backend), one Celery worker holding the
pipeline, and the Flask app of bench/peers/celery_app.py under gunicorn; its client POSTs a job and
polls it every 50 ms, as a user of that app would, and revokes it when it gives up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from celery import states  # type: ignore[import-untyped]

from bench.peers.peer import Outcome, process_tree_rss
from bench.peers.trace import TraceJob
from slotq import harness
from slotq.localredis import free_port

APP = "bench.peers.celery_app"
POLL_S = 0.05
HTTP_TIMEOUT_S = 30.0
GUNICORN_THREADS = 4  # a few: each request is one Redis round trip
WARM_UP = TraceJob(0.0, "warm-up", side=64, steps=1, priority="normal", seed=0)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class CeleryPeer:
    """A Celery worker (solo pool, one task at a time) behind a Flask app; no priorities, no limit."""

    name = "Celery"
    priorities = False

    def __init__(self, cache_dir: Path, threads: int) -> None:
        self.cache_dir, self.threads = cache_dir, threads
        self.processes: dict[str, harness.Process] = {}
        self.url = ""
        self.lock = threading.Lock()
        self.unended: set[str] = set()  # admitted, not given up, no end seen by its client

    def start(self, scratch: Path) -> None:
        """Redis, the worker and gunicorn, each in its own process group; returns once a job ran."""
        try:
            redis = harness.start_redis_server(scratch / "redis", new_session=True)
            self.processes["redis"] = redis
            env = self._env(redis.url)
            self.processes["worker"] = harness.spawn(
                ["-A", f"{APP}:celery_app", "worker", "--pool", "solo", "--concurrency", "1",
                 "--prefetch-multiplier", "1", "--loglevel", "INFO"],
                env, scratch / "celery-worker.log", module="celery", new_session=True)
            port = free_port()
            self.processes["gunicorn"] = harness.spawn(
                ["--worker-class", "gthread", "--workers", "1", "--threads", str(GUNICORN_THREADS),
                 # gunicorn 27's control socket sits at one path under ~ for every instance
                 "--no-control-socket", "--bind", f"127.0.0.1:{port}", f"{APP}:flask_app"],
                env, scratch / "gunicorn.log", module="gunicorn", new_session=True)
            self.url = f"http://127.0.0.1:{port}"
            self._warm_up()
        except BaseException:
            self.stop()
            raise

    def _env(self, redis_url: str) -> dict[str, str]:
        """This environment, with the app's configuration, as Flask's ``from_prefixed_env`` reads it."""
        root = str(Path(__file__).resolve().parents[2])
        return os.environ | {
            "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
            "FLASK_CELERY__broker_url": redis_url, "FLASK_CELERY__result_backend": redis_url,
            "FLASK_PIPELINE__cache_dir": str(self.cache_dir), "FLASK_PIPELINE__threads": str(self.threads),
        }

    def _warm_up(self) -> None:
        """Until the app answers and a first job has run (the worker loads the pipeline before it)."""
        harness.wait_for(lambda: self._running() and self._answers(), harness.API_TIMEOUT_S, "gunicorn")
        task_id = self._submit(WARM_UP)
        if task_id is None:
            raise harness.StartError("the Flask app did not take the warm-up job")
        state = harness.wait_for(lambda: self._running() and self._end(task_id), harness.WORKER_TIMEOUT_S,
                                 "the warm-up job")
        if state != states.SUCCESS:
            raise harness.StartError(f"the warm-up job ended {state}; see {self.processes['worker'].log}")

    def _running(self) -> bool:
        for what, process in self.processes.items():
            process.check_running(what)
        return True

    def _answers(self) -> bool:
        try:
            return self._request("GET", "/jobs/none")[0] == 200
        except OSError:
            return False

    def call(self, job: TraceJob, give_up_s: float, start_by_s: float | None = None) -> Outcome:
        """POST the job, poll it every 50 ms until it ends, fetch its PNG; revoke it on giving up."""
        started = time.perf_counter()
        task_id = self._submit(job)
        if task_id is None:
            return Outcome(admitted=True, failed=True)  # an error answer: Celery has no refusal
        with self.lock:
            self.unended.add(task_id)
        while (state := self._state(task_id)) not in states.READY_STATES:
            left = started + give_up_s - time.perf_counter()
            if left <= 0:
                self._forget(task_id)
                self._request("DELETE", f"/jobs/{task_id}")
                return Outcome(admitted=True, gave_up=True)
            time.sleep(min(POLL_S, left))
        self._forget(task_id)
        if state != states.SUCCESS:
            return Outcome(admitted=True, failed=True)
        code, png = self._request("GET", f"/jobs/{task_id}/image")
        if code != 200 or not png.startswith(PNG_SIGNATURE):
            return Outcome(admitted=True, failed=True)
        return Outcome(admitted=True, latency_s=time.perf_counter() - started)

    def _submit(self, job: TraceJob) -> str | None:
        """The task's id, or None on an error answer."""
        code, body = self._request("POST", "/jobs", {"side": job.side, "steps": job.steps, "seed": job.seed})
        return str(json.loads(body)["id"]) if code == 202 else None

    def _state(self, task_id: str) -> str:
        """Celery's state of the task (PENDING also for an id it does not know)."""
        code, body = self._request("GET", f"/jobs/{task_id}")
        return str(json.loads(body)["status"]) if code == 200 else ""

    def _end(self, task_id: str) -> str | None:
        """The task's state if it has ended (succeeded, failed or revoked), else None."""
        state = self._state(task_id)
        return state if state in states.READY_STATES else None

    def _forget(self, task_id: str) -> None:
        with self.lock:
            self.unended.discard(task_id)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        """One HTTP exchange with the app: its status and body (an error status is an answer too)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def lost(self, settle_s: float) -> int:
        """Admitted tasks, not given up, whose client saw no end and that have none ``settle_s`` later."""
        deadline = time.monotonic() + settle_s
        with self.lock:
            open_ids = list(self.unended)
        while open_ids and time.monotonic() < deadline:
            open_ids = [task_id for task_id in open_ids if self._end(task_id) is None]
            if open_ids:
                time.sleep(0.2)
        with self.lock:  # each counted once: the benchmark adds up its rounds
            self.unended.clear()
        return len(open_ids)

    def queue_rss(self) -> int:
        """gunicorn's arbiter and workers and the broker's Redis: all but the Celery worker."""
        return sum(process_tree_rss(self.processes[what].pid) for what in ("gunicorn", "redis"))

    def stop(self) -> None:
        """gunicorn, the worker, then Redis."""
        worker = self.processes.get("worker")
        if worker is not None and worker.popen.poll() is None:
            # Celery's cold shutdown: a warm one (SIGTERM) would first finish the task it runs, one
            # given up on included (the solo pool cannot terminate a running task).
            os.kill(worker.pid, signal.SIGQUIT)
        for what in ("gunicorn", "worker", "redis"):
            process = self.processes.pop(what, None)
            if process is not None:
                process.stop()
                with contextlib.suppress(ProcessLookupError):  # anything left in its group
                    os.killpg(process.pid, signal.SIGKILL)
