"""Every way a job ends, in one place: the writes that record it, whoever ends it.

A job ends ``succeeded`` or ``failed`` through RQ's own paths in the worker (worker/rq.py), which
then calls :func:`settle`; ``canceled`` while waiting (:func:`cancel`), ``expired`` in the line
(``lua/lib/expiry.lua``) or at its claim (:func:`expire_claimed`), and ``lost`` when its worker
died (:func:`settle_abandoned`: run again, or failed ``worker_lost``). An interrupted or lost run
goes back to the head of its class (:func:`requeue_at_front`). Each end is counted by status and
sends its ``completed`` webhook in the same round trip as the status change. The writes of an end
are ``lua/lib/ending.lua``'s alone: the expiry calls it in its script, and :func:`end_job` and
:func:`ended` queue ``lua/end.lua`` on the caller's pipeline.
"""

from __future__ import annotations

from datetime import UTC, datetime

from redis import Redis
from redis.client import Pipeline
from rq.job import Job
from rq.job import JobStatus as RQStatus
from rq.queue import Queue
from rq.utils import utcformat

from shared.contract import keys
from shared.contract.errors import AlreadyFinishedError
from shared.contract.jobs import JobStatus, Outcome
from shared.contract.settings import Settings
from shared.store import events, outbox, scripts, waiting
from shared.store.connection import text
from shared.store.records import attempts_used, job_status, save_meta


def end_job(job: Job, queue: Queue, settings: Settings, pipe: Pipeline, status: RQStatus,
            error: dict[str, str] | None = None) -> None:
    """Queue the writes that end a job outside RQ's own worker path (canceled, lost, expired)."""
    if error:
        job.meta["error"] = error
    job.ended_at = datetime.now(UTC)
    job.set_status(status, pipeline=pipe)  # RQ's field, by RQ's call: the Job object follows
    _forget_executions(job, queue, pipe)
    ttl = settings.failure_ttl_s if status is RQStatus.FAILED else settings.record_ttl_s
    record = [utcformat(job.ended_at), job.serializer.dumps(job.meta), ttl, keys.events_channel(queue.name)]
    scripts.run(pipe, "end", [*_end_keys(queue.name), job.key],
                [*_end_args(job, settings.result_ttl_s), *record])


def ended(pipe: Pipeline, queue_name: str, job: Job, inputs_ttl_s: int) -> None:
    """Queue what follows a job's final status: its count by status, its `completed` webhook, its
    final event, and the expiry of its input images and event log, kept as long as its images."""
    scripts.run(pipe, "end", _end_keys(queue_name), _end_args(job, inputs_ttl_s))


def _end_keys(queue_name: str) -> list[str]:
    return [keys.ended_key(queue_name), keys.webhooks_key(queue_name)]


def _end_args(job: Job, inputs_ttl_s: int) -> list[str | int]:
    return [job.id, job_status(job).value, inputs_ttl_s, "1" if outbox.asks_for(job, "completed") else ""]


def ended_counts(queue: Queue) -> dict[str, int]:
    """How many jobs of the queue reached each final status (since its Redis began)."""
    counts = queue.connection.hgetall(keys.ended_key(queue.name))
    return {text(status): int(count) for status, count in counts.items()}


def cancel(queue: Queue, settings: Settings, job: Job) -> bool:
    """Cancel a job; True when it ended now, False when its worker will stop it at the next step."""
    if job_status(job).is_terminal:
        raise AlreadyFinishedError()
    connection = queue.connection
    # The flag first: if a worker takes the job after this point, it sees the flag at start.
    connection.set(keys.cancel_key(job.id), 1, ex=settings.record_ttl_s)
    # Removal decides ownership: either we take the id out of the line or a worker already has it.
    if not waiting.remove(connection, waiting.line_of(job), job.id):
        return False
    with connection.pipeline() as pipe:
        end_job(job, queue, settings, pipe, RQStatus.CANCELED)
        pipe.zrem(keys.deadlines_key(waiting.line_of(job)), job.id)
        events.announce_line(pipe, waiting.line_of(job))  # the others moved up
        pipe.execute()
    return True


def expire_claimed(job: Job, queue: Queue, settings: Settings, claims_key: str) -> None:
    """End a job a worker has just claimed whose deadline passed meanwhile, and drop the claim."""
    job.meta["expired"] = True
    with queue.connection.pipeline() as pipe:
        end_job(job, queue, settings, pipe, RQStatus.CANCELED)
        pipe.zrem(keys.deadlines_key(waiting.line_of(job)), job.id)
        pipe.lrem(claims_key, 1, job.id)
        pipe.execute()


def settle(connection: Redis, queue_name: str, claims_key: str, job: Job, fence_key: str,
           inputs_ttl_s: int) -> JobStatus:
    """A run's end is recorded (RQ's success or failure path): drop the claim and the attempt's
    fence, count it and tell whoever waits on it; its status."""
    with connection.pipeline(transaction=False) as pipe:
        status = settle_in(pipe, queue_name, claims_key, job, fence_key, inputs_ttl_s)
        pipe.execute()
    return status


def settle_in(pipe: Pipeline, queue_name: str, claims_key: str, job: Job, fence_key: str,
              inputs_ttl_s: int) -> JobStatus:
    """Queue :func:`settle`'s writes, after those that record the run's end; the job's status."""
    status = job_status(job)
    if status is JobStatus.SUCCEEDED:  # the last step, which the GPU section leaves to the end
        events.log(pipe, job.id, "progress", job.meta.get("progress"))
    if status.is_terminal:  # not an interrupted job, which runs again
        ended(pipe, queue_name, job, inputs_ttl_s)
    let_go(pipe, queue_name, claims_key, job.id, fence_key)
    return status


def let_go(pipe: Pipeline, queue_name: str, claims_key: str, job_id: str, fence_key: str) -> None:
    """Queue the writes that end an attempt whose job's end (or requeue) is already queued: drop the
    claim, tell whoever waits on the job, and drop the fence, the last write the attempt makes."""
    pipe.lrem(claims_key, 1, job_id)
    events.announce(pipe, queue_name, job_id)
    pipe.delete(fence_key)


def settle_abandoned(job: Job, queue: Queue, settings: Settings, pipe: Pipeline) -> Outcome:
    """Queue the writes that settle a job whose worker died holding it; what happened to it."""
    status = job_status(job)
    if status.is_terminal:
        return Outcome.of(status)
    if queue.connection.exists(keys.cancel_key(job.id)):
        end_job(job, queue, settings, pipe, RQStatus.STOPPED)
        return Outcome.CANCELED
    return again_or_failed(job, queue, settings, pipe, "worker_lost",
                           f"The worker died while running this job, {attempts_used(job)} times")


def again_or_failed(job: Job, queue: Queue, settings: Settings, pipe: Pipeline, code: str,
                    why: str) -> Outcome:
    """Queue the writes that run a job again, at the head of its class, while it has attempts left
    (SLOTQ_MAX_ATTEMPTS), or else end it failed with ``code``; which of the two."""
    if attempts_used(job) >= settings.max_attempts:
        error = {"code": code, "message": f"{why}; it is not retried again."}
        end_job(job, queue, settings, pipe, RQStatus.FAILED, error)
        return Outcome.FAILED
    requeue_at_front(job, queue, pipe)
    return Outcome.REQUEUED


def requeue_at_front(job: Job, queue: Queue, pipe: Pipeline) -> None:
    """Queue the writes that put a job back at the head of its class, to run next."""
    job.meta["progress"] = None
    job.set_status(RQStatus.QUEUED, pipeline=pipe)
    save_meta(job, pipe)
    _forget_executions(job, queue, pipe)
    waiting.requeue(pipe, waiting.line_of(job), job.id)
    events.log(pipe, job.id, "queued")
    events.announce(pipe, queue.name, job.id)


def _forget_executions(job: Job, queue: Queue, pipe: Pipeline) -> None:
    executions = [execution.composite_key for execution in job.get_executions()]
    if executions:
        pipe.zrem(queue.started_job_registry.key, *executions)
