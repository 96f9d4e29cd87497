"""slotq as a peer: its own redis-server, ``slotq api`` and one ``slotq worker``, with its defaults or
with step-level scheduling and preemption; its client is slotq's own (``slotq.client``), which sends
each job's latest useful start as its ``deadline_s``, follows a job by long-polling and cancels it
when it gives up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.peers.peer import Outcome, process_tree_rss
from bench.peers.trace import TraceJob
from shared.contract.settings import Settings
from slotq import harness
from slotq.client import APIError, Client, QueueFullError, RateLimitedError
from slotq.localredis import free_port

PROMPT = "a lighthouse at dusk"
ENDED = ("succeeded", "failed", "canceled", "expired")
# The defaults before this benchmark decided them (issue 58): one job an execution, no batching, no
# joining at step boundaries, no preemption. slotq's defaults batch up to 8 jobs, which join a running
# batch at a step boundary and are paused for a job of a higher class (SLOTQ_PREEMPT_AFTER_S, 0).
ONE_AT_A_TIME: dict[str, Any] = {"max_batch": 1, "step_scheduling": False}


class SlotqPeer:
    """slotq, started as its README says, with ``overrides`` of its settings (none: its defaults)."""

    priorities = True

    def __init__(self, cache_dir: Path, threads: int, name: str = "slotq",
                 overrides: dict[str, Any] | None = None) -> None:
        self.name, self.cache_dir, self.threads = name, cache_dir, threads
        self.overrides = overrides or {}
        self.processes: list[harness.Process] = []
        self.client = Client()
        self.admitted: dict[str, bool] = {}  # each admitted job's id: whether its client gave up

    def start(self, scratch: Path) -> None:
        """Redis, the API and the worker, each in a process of its own; returns once a job can run."""
        redis = harness.start_redis_server(scratch / "redis")
        self.processes.append(redis)
        settings = Settings(redis_url=redis.url or "", cache_dir=self.cache_dir, torch_threads=self.threads,
                            queue_capacity=100, drain_s=0, **self.overrides)
        self.processes.append(harness.start_worker(settings, scratch / "worker.log"))
        api = harness.start_api(settings, scratch / "api.log", port=free_port())
        self.processes.append(api)
        self.client = Client(api.url or "", timeout=30.0, retries=0)

    def call(self, job: TraceJob, give_up_s: float, start_by_s: float | None = None) -> Outcome:
        """POST the job (``start_by_s`` as its ``deadline_s``), follow it with ``?wait=`` until it ends,
        fetch its image; cancel on giving up."""
        started = time.perf_counter()
        try:
            view = self.client.submit(PROMPT, width=job.side, height=job.side, steps=job.steps,
                                      seed=job.seed, priority=job.priority, deadline_s=start_by_s)
        except (QueueFullError, RateLimitedError) as refusal:
            return Outcome(admitted=False, refused_in_s=time.perf_counter() - started,
                           retry_after=refusal.retry_after is not None)
        job_id = view["id"]
        self.admitted[job_id] = False
        while view["status"] not in ENDED:
            left = started + give_up_s - time.perf_counter()
            if left <= 0:
                self.admitted[job_id] = True
                self.client.cancel(job_id)
                return Outcome(admitted=True, gave_up=True)
            view = self.client.get(job_id, wait=max(1.0, min(30.0, left)))
        if view["status"] != "succeeded":
            return Outcome(admitted=True, failed=True)
        self.client.image_bytes(job_id)
        return Outcome(admitted=True, latency_s=time.perf_counter() - started)

    def lost(self, settle_s: float) -> int:
        """Admitted jobs, not given up, not ended ``settle_s`` after the trace (or with no record)."""
        deadline = time.monotonic() + settle_s
        open_ids = [job_id for job_id, gave_up in self.admitted.items() if not gave_up]
        while open_ids and time.monotonic() < deadline:
            open_ids = [job_id for job_id in open_ids if not self._ended(job_id)]
            time.sleep(0.2)
        self.admitted.clear()  # each replay's jobs counted once
        return len(open_ids)

    def _ended(self, job_id: str) -> bool:
        try:
            return self.client.get(job_id)["status"] in ENDED
        except APIError:
            return False  # no record of an admitted job: lost

    def queue_rss(self) -> int:
        """The API's processes (gunicorn's arbiter and workers) and Redis: all but the worker."""
        api, redis = self.processes[2], self.processes[0]
        return sum(process_tree_rss(process.popen.pid) for process in (api, redis))

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()

