"""Every Redis key slotq writes besides RQ's own, in one place."""

from __future__ import annotations

import re

TASK = "worker.tasks.generate"
PREFIX = "slotq"
# RQ's own names (rq.Queue.redis_queue_namespace_prefix and redis_queues_keys; worker/rq.py checks
# them): the waiting line is RQ's lists, so `rq info` and rq.Queue see every waiting job.
RQ_QUEUE_PREFIX = "rq:queue:"
RQ_QUEUES_KEY = "rq:queues"
# Each model has its own line, "<queue>:<model>", whose RQ queues are "<line>:<class>" and
# "<line>:<class>:<tenant>" (lua/lib/line.lua names them); no queue, model or tenant name can hold the
# separator (settings), so a name splits back. Jobs name the queue itself as their origin.
QUEUE_SEPARATOR = ":"
LOG_LENGTH = 512  # events a job's log keeps (about: XADD's MAXLEN ~); a job has a few dozen
PREVIEW_TTL_MS = 120_000  # a job's latest preview outlives the longest preview interval (60 s)
DOORBELL_TOKENS = 16  # enough to wake every idle worker of a host; more would only spin them
JOB_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # use with fullmatch: "$" allows a final newline


def line_name(queue: str, model: str) -> str:
    """The line of one model: its RQ queues, its order, deadlines, estimates and workers."""
    return f"{queue}{QUEUE_SEPARATOR}{model}"


def cancel_key(job_id: str) -> str:
    """Set when a client cancels a job that a worker may already hold."""
    return f"{PREFIX}:cancel:{job_id}"


def log_key(job_id: str) -> str:
    """A job's events as a Redis stream, in order, for GET /v1/jobs/<id>/events (shared/store/events.py)."""
    return f"{PREFIX}:log:{job_id}"


def checkpoint_key(job_id: str) -> str:
    """A running job's last step checkpoint: ``step``, ``attempt`` and its state's bytes (``data``) or
    their name in the result store (``blob``); deleted when the job ends (worker/resuming.py)."""
    return f"{PREFIX}:checkpoint:{job_id}"


def preview_key(job_id: str) -> str:
    """A running job's latest preview, ``{"step", "image"}`` as JSON, for a while (worker/previews.py)."""
    return f"{PREFIX}:preview:{job_id}"


def sweep_key(queue: str) -> str:
    """Whose turn it is to sweep the result store (worker/sweeper.py), for one interval."""
    return f"{PREFIX}:sweep:{queue}"


def queue_of(line: str) -> str:
    """The queue a line is under (the inverse of :func:`line_name`)."""
    return line.split(QUEUE_SEPARATOR)[0]


def line_changed(line: str) -> str:
    """What the lines channel carries when a line's order changed (a claim, a cancel, an expiry)."""
    return f"line{QUEUE_SEPARATOR}{line}"


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


def line_key(line: str) -> str:
    """Prefix of a line's bookkeeping: the order of each class, virtual times, the doorbell."""
    return f"{PREFIX}:line:{line}"


def events_channel(queue: str) -> str:
    """Pub/sub channel on which a job's id is published whenever its status changes."""
    return f"{PREFIX}:events:{queue}"


LINES_SUFFIX = ":lines"


def lines_channel(queue: str) -> str:
    """Pub/sub channel on which a line's :func:`line_changed` name is published when its order
    changed: apart from the jobs' channel, so that only a process watching a line hears of each claim."""
    return events_channel(queue) + LINES_SUFFIX


def preferences_key(queue: str, tenant: str) -> str:
    """Hash of one tenant's choices that outlast a request ('' without API keys): ``model``, the
    model of its jobs that name none."""
    return f"{PREFIX}:preferences:{queue}:{tenant}"


def listed_key(queue: str, tenant: str) -> str:
    """Sorted set of one tenant's jobs ('' without API keys: every job) by admission time."""
    return f"{PREFIX}:listed:{queue}:{tenant}"


def deadlines_key(line: str) -> str:
    """Sorted set of a line's waiting jobs by the time they expire."""
    return f"{PREFIX}:deadlines:{line}"


def model_key(line: str) -> str:
    """The job-time model (``a + b * cost``) fitted for a line, and its weighted sums."""
    return f"{PREFIX}:model:{line}"


def running_key(line: str) -> str:
    """Hash of worker name to "cost started-at" of the job it runs, for a line's workers ("cost
    started-at step total step-at" once it reports a step)."""
    return f"{PREFIX}:running:{line}"


def pausing_key(line: str) -> str:
    """Hash of worker name to "class seconds" for a line's workers whose running execution is a
    step-level loop that pauses for a higher class's job after that many seconds (the Lua derives it
    from :func:`running_key`)."""
    return f"{running_key(line)}:pausing"


def workers_key(line: str) -> str:
    """Set of the workers that hold (or held) claims on a line."""
    return f"{PREFIX}:workers:{line}"


def drain_key(worker: str) -> str:
    """Set by an operator (``POST /v1/admin/workers/<name>/drain``): the worker's next heartbeat takes
    it and the worker stops as after SIGTERM."""
    return f"{PREFIX}:drain:{worker}"


def hold_key(worker: str) -> str:
    """Set by an operator (``POST /v1/admin/workers/<name>/release``): while it lives (``hold_s``, or
    until ``.../resume`` deletes it) the worker keeps its device free and claims nothing."""
    return f"{PREFIX}:hold:{worker}"


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
