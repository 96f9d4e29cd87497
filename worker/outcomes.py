"""Each run's outcome, on the worker's side: RQ's failure hooks decide it, the answers report it.

A job that raised in its GPU section ends here through RQ's own failure path, whose two hooks
decide how: failed with a classified error, stopped (canceled), put back (interrupted), or the
worker stops (a lost device). A job that rendered ends in the finishing process; its answer comes
back here to be counted, logged and let go of. The writes of every ending are
shared/store/endings.py's; the outcomes are :class:`~shared.contract.jobs.Outcome`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue

from shared.contract import logs
from shared.contract.errors import JobCanceledError, JobInterruptedError, WorkerFatalError
from shared.contract.jobs import JobStatus, Outcome
from shared.contract.settings import Settings
from shared.store import endings, records
from shared.store.claims import Claims
from shared.store.fencing import Fence, StaleAttemptError, holding
from worker.failures import classify, is_device_fatal
from worker.messages import Ended
from worker.metrics import WorkerMetrics
from worker.pipeline import loaded_pipeline
from worker.rq import RQWorker, run_seconds

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Member:
    """One job of a GPU execution, with RQ's record of this run of it and the attempt's fence."""

    job: Job
    execution: Execution
    fence: Fence


def ids_of(jobs: list[Job]) -> tuple[str, str | None]:
    """The ids a log line written while these jobs run is about (a batch: all of them)."""
    requests = [str(job.meta["request_id"]) for job in jobs if job.meta.get("request_id")]
    return ",".join(job.id for job in jobs), ",".join(requests) or None


class Outcomes(RQWorker):
    """The worker's half of ending jobs. Its subclass sets ``claims`` and ``metrics``."""

    claims: Claims
    metrics: WorkerMetrics

    def __init__(self, queue: Queue, settings: Settings, name: str | None) -> None:
        super().__init__(queue, settings, name)
        # How each job that raised ends, from handle_exception to handle_job_failure (by job id:
        # the main thread and the finisher's reader thread may both be ending a job).
        self._endings: dict[str, Outcome] = {}

    def on_finished(self, members: list[Member], ended: list[Ended]) -> None:
        """On the finisher's reader thread: the finishing process's answer for one execution."""
        for member, end in zip(members, ended, strict=True):
            job = member.job
            with logs.about_job(job.id, job.meta.get("request_id")):
                if end.outcome is Outcome.SUPERSEDED:
                    self.superseded(job.id, StaleAttemptError(end.error))
                elif end.outcome is Outcome.UNRECORDED:
                    # Its end not (fully) recorded: the claim stays and, no longer held, is recovered
                    # once Redis is back: the job runs again, or its claim is dropped if its end landed.
                    log.warning("could not store or record job %s (%s); it will run again", job.id, end.error)
                    self.claims.unhold(job.id)
                elif end.outcome is Outcome.REQUEUED:  # its images could not be stored: it runs again
                    self._ended(job, JobStatus.QUEUED, end.seconds)
                elif end.outcome is Outcome.UNFINISHED:
                    self.fail(member, RuntimeError(f"could not encode or store the images: {end.error}"))
                else:
                    self._ended(job, JobStatus(end.outcome.value), end.seconds)

    def on_lost(self, members: list[Member]) -> None:
        """The finishing process died holding these jobs: recovery runs them again or drops their
        claims, whichever their records call for."""
        for member in members:
            log.warning("job %s: its finishing was lost; it is left for recovery", member.job.id)
            self.claims.unhold(member.job.id)

    def fail(self, member: Member, error: Exception) -> None:
        """Record a job's failure through RQ's own failure path (our handle_exception and
        handle_job_failure decide the ending)."""
        with holding(member.fence), logs.about_job(member.job.id, member.job.meta.get("request_id")):
            try:
                if isinstance(error, StaleAttemptError):
                    raise error
                self.record_failure(member.job, member.execution, error)
                self._settled(member)
            except StaleAttemptError as exc:
                self.superseded(member.job.id, exc)

    def _settled(self, member: Member) -> None:
        """The job's end is recorded: settle it in Redis, then count and log it."""
        self._ended(member.job, self.settle(member.job, member.fence), run_seconds(member.job))

    def _ended(self, job: Job, status: JobStatus, seconds: float) -> None:
        """Let go of an ended job, count and log it (inside ``logs.about_job``, so the line names it)."""
        self.claims.unhold(job.id)
        self.metrics.ended(Outcome.of(status).value, seconds)
        log.info("%s in %.2f s", status.value if status.is_terminal else "put back", seconds)

    def superseded(self, job_id: str, error: StaleAttemptError) -> None:
        """This worker lost the job to a newer attempt (it was presumed dead): drop it, write nothing."""
        self.claims.unhold(job_id)
        self.metrics.jobs.labels(Outcome.SUPERSEDED.value).inc()
        log.warning("job %s: dropped, %s (this worker was cut off long enough to be presumed dead)",
                    job_id, error)

    def handle_exception(self, job: Job, *exc_info: Any) -> None:
        """Record why a job ended; decide whether it failed, was canceled or goes back to the queue."""
        error = exc_info[1]
        if isinstance(error, JobCanceledError):
            self._endings[job.id] = Outcome.CANCELED
            return
        if isinstance(error, JobInterruptedError):
            self._endings[job.id] = Outcome.REQUEUED  # interrupted: it runs again
            return
        if is_device_fatal(error):
            # Leave the claim in place: the next worker retries the job as after a crash.
            raise WorkerFatalError(str(error))
        code, message = classify(error, self.settings.weight_folders)
        if code == "out_of_memory" and (loaded := loaded_pipeline()) is not None:
            loaded.release_memory()
        job.meta["error"] = {"code": code, "message": message}
        records.save_meta(job)
        super().handle_exception(job, *exc_info)

    def handle_job_failure(self, job: Job, queue: Queue, started_job_registry: Any = None,
                           exc_string: str = "", execution: Any = None) -> None:
        """RQ marks a raised job failed; a canceled one is marked stopped, an interrupted one requeued."""
        ending = self._endings.pop(job.id, None)
        if ending is Outcome.CANCELED:
            # RQ's own stop-job command marks a job this way: STOPPED, never retried.
            self.mark_stopped(job)
        elif ending is Outcome.REQUEUED:
            job.meta["interrupted"] = int(job.meta.get("interrupted", 0)) + 1
            with self.connection.pipeline() as pipe:
                self.cleanup_execution(job, pipeline=pipe, execution=execution)
                endings.requeue_at_front(job, queue, pipe)
                pipe.lrem(self.claims.key, 1, job.id)
                pipe.execute()
            log.info("job %s interrupted and put back at the head of its class", job.id)
            return
        super().handle_job_failure(job, queue, started_job_registry, exc_string, execution)
