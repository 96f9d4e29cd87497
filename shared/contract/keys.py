"""Every Redis key slotq writes besides RQ's own, in one place."""

from __future__ import annotations

import re

TASK = "worker.tasks.generate"
PREFIX = "slotq"
# RQ's own names (rq.Queue.redis_queue_namespace_prefix and redis_queues_keys; worker/rq.py checks
# them): the waiting line is RQ's lists, so `rq info` and rq.Queue see every waiting job.
RQ_QUEUE_PREFIX = "rq:queue:"
RQ_QUEUES_KEY = "rq:queues"
# The line's RQ queues are "<queue>:<class>" and "<queue>:<class>:<tenant>" (lua/lib/line.lua names
# them); neither a queue name nor a tenant can hold the separator (settings), so a name splits back.
QUEUE_SEPARATOR = ":"
DOORBELL_TOKENS = 16  # enough to wake every idle worker of a host; more would only spin them
JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # use with fullmatch: "$" allows a final newline


def cancel_key(job_id: str) -> str:
    """Set when a client cancels a job that a worker may already hold."""
    return f"{PREFIX}:cancel:{job_id}"


def issued_key(job_id: str) -> str:
    """Outlives a job's record: an id once issued answers 410 expired, never 404."""
    return f"{PREFIX}:issued:{job_id}"


def images_key(job_id: str) -> str:
    """Hash of a finished job's PNGs by index."""
    return f"{PREFIX}:images:{job_id}"


def inputs_key(job_id: str) -> str:
    """Hash of a job's input images (``image``, ``mask``) as the client sent them."""
    return f"{PREFIX}:inputs:{job_id}"


def idempotency_key(queue: str, digest: str) -> str:
    """The job admitted for one Idempotency-Key (stored hashed)."""
    return f"{PREFIX}:idempotency:{queue}:{digest}"


def bucket_key(queue: str, tenant: str) -> str:
    """One tenant's token bucket: its tokens and when they were counted."""
    return f"{PREFIX}:bucket:{queue}:{tenant}"


def line_key(queue: str) -> str:
    """Prefix of the line's bookkeeping: the order of each class, virtual times, the doorbell."""
    return f"{PREFIX}:line:{queue}"


def events_channel(queue: str) -> str:
    """Pub/sub channel on which a job's id is published whenever its status changes."""
    return f"{PREFIX}:events:{queue}"


def deadlines_key(queue: str) -> str:
    """Sorted set of waiting jobs by the time they expire."""
    return f"{PREFIX}:deadlines:{queue}"


def model_key(queue: str) -> str:
    """The fitted job-time model (``a + b * cost``) and its weighted sums."""
    return f"{PREFIX}:model:{queue}"


def running_key(queue: str) -> str:
    """Hash of worker name to "cost started-at" of the job it runs."""
    return f"{PREFIX}:running:{queue}"


def workers_key(queue: str) -> str:
    """Set of the workers that hold (or held) claims on a queue."""
    return f"{PREFIX}:workers:{queue}"


def claims_key(worker: str) -> str:
    """List of the job ids one worker has taken from the queue and not yet finished."""
    return f"{PREFIX}:claims:{worker}"


def alive_key(worker: str) -> str:
    """Exists while a worker's heartbeat is fresh."""
    return f"{PREFIX}:alive:{worker}"


def ended_key(queue: str) -> str:
    """Hash of final status to how many jobs of a queue reached it (the jobs-ended metric)."""
    return f"{PREFIX}:ended:{queue}"


def webhooks_key(queue: str) -> str:
    """The outbox: sorted set of pending webhook deliveries by the time each is due."""
    return f"{PREFIX}:webhooks:{queue}"


def fence_key(job_id: str) -> str:
    """The token of the attempt now allowed to write a job's record (see shared/store/fencing.py)."""
    return f"{PREFIX}:fence:{job_id}"
