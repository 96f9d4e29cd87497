"""Where a worker's claimed jobs start and leave its hands: restored under their claims' fences,
started, failed, or handed to the finishing process.

worker/main.py's loop and worker/joining.py's step-level loop both start and end jobs; this is the
one object they share for it, so that neither reaches into the other. How each ending is recorded
is worker/outcomes.py's; the finishing process is worker/finisher.py's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC
from typing import NamedTuple

from redis import Redis
from rq.job import Job

from shared.contract import logs
from shared.contract.jobs import Tier
from shared.store import endings, estimates, records, waiting
from shared.store.fencing import Fence, StaleAttemptError, holding
from shared.store.waiting import Claimed
from worker import lifecycle
from worker.finisher import Finisher
from worker.messages import Batch
from worker.outcomes import Member, Outcomes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Taken:
    """Jobs claimed for one GPU execution: the claims, those that may start (each with the fence its
    claim set), and when they were claimed, on Redis's clock and on this process's."""

    claims: list[Claimed]
    startable: list[tuple[Job, Fence]]
    at: float
    monotonic: float

    def starts_at(self) -> float:
        """Now, on Redis's clock: when the execution starts (later than the claim, if taken ahead)."""
        return self.at + time.monotonic() - self.monotonic


class Started(NamedTuple):
    """Jobs started together: their members, the worker's running entry, its cost, and the ids of
    those canceled by then."""

    members: list[Member]
    running: str
    cost: float
    canceled: set[str]


class JobDesk:
    """Starts a worker's claimed jobs, fails them, and hands them over; for its loops to share."""

    def __init__(self, worker: Outcomes) -> None:
        self.worker, self.claims, self.settings = worker, worker.claims, worker.settings
        self.name = worker.name
        self.connection: Redis = worker.connection
        # The finishing process, while the worker serves (it is started then, and closed as it stops).
        self.finisher: Finisher[list[Member]] | None = None

    def fenced(self, batch: list[Claimed]) -> list[tuple[Job, Fence]]:
        """The claimed jobs that may start, each with the fence its claim set."""
        startable = []
        for claimed in batch:
            fence = Fence(claimed.job_id, claimed.token)
            try:
                with holding(fence):
                    job = self._startable(claimed)
            except StaleAttemptError as exc:
                self.worker.superseded(claimed.job_id, exc)
                continue
            if job is not None:
                startable.append((job, fence))
        return startable

    def taken_with(self, first: Taken, claims: list[Claimed]) -> Taken:
        """Jobs claimed to join ``first``'s execution, those that may start restored (on Redis's clock,
        now as ``first`` reckons it)."""
        try:
            return Taken(claims, self.fenced(claims), first.starts_at(), time.monotonic())
        except BaseException:
            self.unhold(claims)
            raise

    def unhold(self, claims: list[Claimed]) -> None:
        """Let go of these claims, not handed over: leftovers, which recovery runs again."""
        for member in claims:
            self.claims.unhold(member.job_id)

    def begin(self, taken: Taken, line: str, running_cost: float = 0.0) -> Started:
        """Start the claimed jobs that may start, each under the fence its claim set: RQ's start
        bookkeeping, the attempt, the worker's running entry and step 0 in one fenced transaction.
        ``running_cost``: of the jobs running already, that these join (worker/joining.py)."""
        startable, at = taken.startable, taken.starts_at()
        if not startable:
            return Started([], "", 0.0, set())
        jobs = [job for job, _ in startable]
        cost, executions = running_cost + sum(records.cost_of(job) for job in jobs), []
        tier = self._tier(jobs[0], line)  # of the whole batch: its jobs asked the same speed
        try:
            with holding(*(fence for _, fence in startable)), \
                    self.connection.pipeline(transaction=False) as pipe:
                for job in jobs:
                    records.begin_attempt(job)
                    job.meta["tier"] = tier
                executions = self.worker.start(jobs, pipe)
                running = estimates.mark_running(pipe, line, self.name, cost, at)
                records.announce_start(jobs, pipe)  # step 0; its last answers: which were canceled
                flags = pipe.execute()[-len(jobs):]
                canceled = {job.id for job, flag in zip(jobs, flags, strict=True) if flag}
        except StaleAttemptError as exc:
            for job in jobs:
                self.worker.superseded(job.id, exc)
            for execution in executions:
                self.worker.executions.pop(execution.id, None)
            return Started([], "", 0.0, set())
        members = [Member(job, execution, fence)
                   for (job, fence), execution in zip(startable, executions, strict=True)]
        for member in members:
            self._started(member.job, at)
        return Started(members, running, cost, canceled)

    def fail(self, member: Member, error: Exception) -> None:
        """Record a started job's failure (or cancel) and let go of it (worker/outcomes.py)."""
        self.worker.fail(member, error)

    def let_go(self, member: Member) -> None:
        """This process is done with the job's run: the finishing process cleans up RQ's record of it."""
        self.worker.executions.pop(member.execution.id, None)

    def hand_over(self, members: list[Member], batch: Batch, wait: bool = True) -> bool:
        """Hand these jobs' ends to the finishing process; without ``wait``, only if it is free
        (see :meth:`Finisher.submit`). Whether they were handed over."""
        if self.finisher is None:
            raise RuntimeError("the worker is not serving: no finishing process takes its jobs")
        return self.finisher.submit(members, batch, wait=wait)

    def _tier(self, job: Job, line: str) -> Tier:
        """The tier a job runs in: the speed it asked, and for ``auto`` the fast tier while its line is
        deeper than SLOTQ_DEGRADE_AT (degrade before shedding)."""
        speed = job.kwargs["request"].get("speed", "normal")
        if job.kwargs["request"].get("frames") is not None:
            return "normal"  # a clip's families have no fast tier (admission refuses `fast` for them)
        if speed != "auto":
            return "fast" if speed == "fast" else "normal"
        at = self.settings.degrade_at
        deeper = at is not None and sum(waiting.counts(self.connection, line).values()) > at
        return "fast" if deeper else "normal"

    def _started(self, job: Job, at: float) -> None:
        """Count and log a job's start (its record says it runs from now)."""
        admitted = job.enqueued_at or job.created_at
        self.worker.metrics.queue_wait.observe(max(0.0, at - admitted.replace(tzinfo=UTC).timestamp()))
        request = job.kwargs["request"]
        prompt = logs.prompt_for_log(self.settings, str(request.get("prompt")))
        with logs.about_job(job.id, job.meta.get("request_id")):
            log.info("started: attempt %s, %sx%s, %s steps, %s image(s), prompt %s", job.meta.get("attempt"),
                     request.get("width"), request.get("height"), request.get("steps"),
                     request.get("num_images"), prompt)

    def _startable(self, claimed: Claimed) -> Job | None:
        """The claimed job, unless it must not start: then it is put back or ended here."""
        job_id, now = claimed.job_id, claimed.at
        if not claimed.record:
            self.claims.release(job_id)  # the record expired while the job waited
            return None
        job = Job(job_id, connection=self.connection, serializer=self.worker.serializer)
        job.restore(claimed.record)
        if lifecycle.stopping.is_set() or records.job_status(job).is_terminal:
            # Claimed as a stop came in, or canceled/expired meanwhile: put back or drop.
            self.claims.recover_now(job_id)
            return None
        if job.meta.get("deadline_at", now + 1) <= now:
            # Its deadline passed in the instant between the purge and the claim.
            endings.expire_claimed(job, self.worker.queue, self.settings, self.claims.key)
            self.claims.unhold(job.id)
            return None
        return job
