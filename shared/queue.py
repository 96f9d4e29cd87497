"""Everything that touches Redis: admission, lookup, cancellation, progress and results.

Both processes go through this module, so key names and the RQ settings live in one place.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from typing import Any

from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.job import JobStatus as RQStatus
from rq.serializers import JSONSerializer
from rq.utils import utcformat

from shared.errors import (
    AlreadyFinishedError,
    JobNotFoundError,
    NotReadyError,
    QueueFullError,
    ResultExpiredError,
)
from shared.jobs import JobError, JobRequest, JobStatus, JobView, Progress
from shared.settings import Settings

TASK = "worker.tasks.generate"
KEY_PREFIX = "slotq"
CANCEL_KEY = KEY_PREFIX + ":cancel:{}"
IMAGES_KEY = KEY_PREFIX + ":images:{}"
JOB_SECONDS_KEY = KEY_PREFIX + ":stats:job_seconds"
JOB_ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Weight of the newest job in the moving average of job time behind Retry-After.
EWMA_WEIGHT = 0.2

STATUS_FROM_RQ = {
    RQStatus.QUEUED: JobStatus.QUEUED,
    RQStatus.CREATED: JobStatus.QUEUED,
    RQStatus.STARTED: JobStatus.RUNNING,
    RQStatus.FINISHED: JobStatus.SUCCEEDED,
    RQStatus.FAILED: JobStatus.FAILED,
    # RQ calls a job stopped when its worker ended it on request; to a client that is a cancel.
    RQStatus.STOPPED: JobStatus.CANCELED,
    RQStatus.CANCELED: JobStatus.CANCELED,
}

# RQ's enqueue writes the job and pushes its id inside our MULTI; this script runs last in the
# same transaction and undoes both when the push went over the cap. The whole transaction is
# atomic, so no client ever sees more than `capacity` ids in the list, however many API
# processes admit at once. Count-then-push from the client would race.
ADMIT_SCRIPT = """
local length = redis.call('LLEN', KEYS[1])
if length > tonumber(ARGV[1]) then
  redis.call('LREM', KEYS[1], -1, ARGV[2])
  redis.call('DEL', KEYS[2])
  return {-1, redis.call('GET', KEYS[3])}
end
return {length - 1, false}
"""


def connect(settings: Settings, *, blocking: bool = False) -> Redis:
    """A Redis client that fails fast; ``blocking`` lifts the read timeout for a worker's pop."""
    return Redis.from_url(
        settings.redis_url,
        socket_connect_timeout=settings.redis_timeout_s,
        socket_timeout=None if blocking else settings.redis_timeout_s,
        health_check_interval=30,
        # One immediate retry: a pooled connection that died with a Redis restart is replaced
        # transparently, while a Redis that is really down still answers within two timeouts.
        retry=Retry(NoBackoff(), 1),
    )


def job_queue(connection: Redis, settings: Settings) -> Queue:
    """The one RQ queue, JSON-serialised so that untrusted data never reaches pickle."""
    return Queue(settings.queue_name, connection=connection, serializer=JSONSerializer,
                 default_timeout=settings.job_timeout_s)


def enqueue_job(queue: Queue, settings: Settings, request: JobRequest) -> tuple[Job, int]:
    """Admit one job atomically, or raise ``QueueFullError``; returns the job and its position."""
    job = queue.create_job(
        TASK,
        kwargs={"request": request.model_dump(mode="json")},
        timeout=settings.job_timeout_s,
        result_ttl=settings.record_ttl_s,
        failure_ttl=settings.record_ttl_s,
    )
    admit = queue.connection.register_script(ADMIT_SCRIPT)
    with queue.connection.pipeline(transaction=True) as pipe:
        queue.enqueue_job(job, pipeline=pipe)
        admit(keys=[queue.key, job.key, JOB_SECONDS_KEY],
              args=[settings.queue_capacity, job.id], client=pipe)
        position, job_seconds = pipe.execute()[-1]
    if position < 0:
        raise QueueFullError(retry_after=retry_after(job_seconds))
    return job, position


def retry_after(job_seconds: bytes | None) -> int:
    """Whole seconds until a place is likely free: one job's average run time, at least 1."""
    return max(1, math.ceil(float(job_seconds or 1)))


def fetch_job(queue: Queue, job_id: str) -> Job:
    """The job with this id on our queue, or ``JobNotFoundError``."""
    if not JOB_ID_PATTERN.match(job_id):
        raise JobNotFoundError()
    try:
        job = Job.fetch(job_id, connection=queue.connection, serializer=queue.serializer)
    except NoSuchJobError:
        raise JobNotFoundError() from None
    if job.origin != queue.name or job.func_name != TASK:
        raise JobNotFoundError()
    return job


def job_status(job: Job) -> JobStatus:
    """The client-facing status of an RQ job."""
    return STATUS_FROM_RQ.get(job.get_status(refresh=False), JobStatus.QUEUED)


def job_view(job: Job, position: int | None = None) -> JobView:
    """What a client sees of a job; pass ``position`` when it is already known."""
    status = job_status(job)
    meta: dict[str, Any] = job.meta or {}
    if status is not JobStatus.QUEUED:
        position = None
    elif position is None:
        # None here means a worker popped it a moment ago: it is next, about to run.
        position = job.get_position() or 0
    progress = meta.get("progress")
    error = meta.get("error")
    images = meta.get("images", 0) if status is JobStatus.SUCCEEDED else 0
    return JobView(
        id=job.id,
        status=status,
        position=position,
        progress=Progress(**progress) if progress else None,
        created_at=_aware(job.created_at),
        started_at=_aware(job.started_at),
        finished_at=_aware(job.ended_at),
        error=JobError(**error) if error else _default_error(status),
        images=[f"/v1/jobs/{job.id}/images/{index}" for index in range(images)],
        request=JobRequest.model_validate(job.kwargs["request"], strict=False),
    )


def _aware(moment: datetime | None) -> datetime | None:
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def _default_error(status: JobStatus) -> JobError | None:
    if status is JobStatus.FAILED:
        return JobError(code="job_failed", message="The job failed.")
    return None


def cancel_job(queue: Queue, settings: Settings, job: Job) -> bool:
    """Cancel a job; True when it ended now, False when its worker will stop it at the next step."""
    if job_status(job).is_terminal:
        raise AlreadyFinishedError()
    connection = queue.connection
    # The flag first: if a worker pops the job after this point, it sees the flag at start.
    connection.set(CANCEL_KEY.format(job.id), 1, ex=settings.record_ttl_s)
    # LREM decides ownership: either we take the id out of the list or a worker already has it.
    if not connection.lrem(queue.key, 0, job.id):
        return False
    with connection.pipeline() as pipe:
        job.cancel(pipeline=pipe)
        pipe.hset(job.key, "ended_at", utcformat(datetime.now(UTC)))
        pipe.expire(job.key, settings.record_ttl_s)
        pipe.execute()
    return True


def cancel_requested(connection: Redis, job_id: str) -> bool:
    """Whether a client asked to cancel this job."""
    return bool(connection.exists(CANCEL_KEY.format(job_id)))


def report_progress(job: Job, step: int, total: int) -> bool:
    """Record step progress on the job; returns whether cancellation was requested."""
    job.meta["progress"] = {"step": step, "total": total}
    with job.connection.pipeline(transaction=False) as pipe:
        pipe.hset(job.key, "meta", job.serializer.dumps(job.meta))
        pipe.exists(CANCEL_KEY.format(job.id))
        return bool(pipe.execute()[-1])


def store_images(job: Job, settings: Settings, pngs: list[bytes], seconds: float) -> None:
    """Keep a finished job's images for the result TTL and feed the job-time average."""
    job.meta["images"] = len(pngs)
    key = IMAGES_KEY.format(job.id)
    with job.connection.pipeline() as pipe:
        pipe.delete(key)
        pipe.hset(key, mapping={str(index): png for index, png in enumerate(pngs)})
        pipe.expire(key, settings.result_ttl_s)
        pipe.hset(job.key, "meta", job.serializer.dumps(job.meta))
        pipe.execute()
    _record_job_seconds(job.connection, seconds)


def _record_job_seconds(connection: Redis, seconds: float) -> None:
    previous = connection.get(JOB_SECONDS_KEY)
    average = seconds if previous is None else (1 - EWMA_WEIGHT) * float(previous) + EWMA_WEIGHT * seconds
    connection.set(JOB_SECONDS_KEY, f"{average:.3f}")


def record_error(job: Job, code: str, message: str) -> None:
    """Record why a job failed, for its view."""
    job.meta["error"] = {"code": code, "message": message}
    job.connection.hset(job.key, "meta", job.serializer.dumps(job.meta))


def fetch_image(job: Job, index: int) -> bytes:
    """The index-th PNG of a job, or the error that explains why there is none."""
    status = job_status(job)
    if status is not JobStatus.SUCCEEDED:
        raise NotReadyError(f"The job is {status.value}; it has no images.")
    if not 0 <= index < job.meta.get("images", 0):
        raise JobNotFoundError("No image with this index.")
    png = job.connection.hget(IMAGES_KEY.format(job.id), str(index))
    if png is None:
        raise ResultExpiredError()
    return bytes(png)
