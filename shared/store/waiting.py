"""The waiting lines: RQ's own lists, one line per model, three priority classes, each shared
fairly between tenants.

Each model has its own line, ``<queue>:<model>`` (``slotq:default``), capped on its own, and a worker
claims only from its model's. Waiting job ids sit in RQ queues, that is Redis lists ``rq.Queue``
reads: one per priority class and tenant, named ``<line>:<class>`` (``slotq:default:normal``) or
``<line>:<class>:<tenant>`` (``slotq:default:high:acme``) with API keys on, so ``rq info`` and
rq-dashboard show exactly the jobs that wait, each with RQ status ``queued``. A worker always takes
from the highest class that has work. Inside a class, tenants share by start-time fair queueing
weighted by cost: a job's start tag is where its tenant's previous job finished, but never before
the class's virtual time (the tag of the job taken last), and a sorted set per class orders the
class's ids by tag. Tenants thus take turns by GPU work, and a tenant that arrives behind another's
500-job burst waits for at most one job of each other tenant.

Every change to the line is a script of ``lua/`` built on ``lua/lib/line.lua``, so the lists and
the order never disagree; a claim moves the chosen id from its list into the worker's claims list
in the same script, so the id is always in exactly one place.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, cast

from redis import Redis
from redis.client import Pipeline
from rq.job import Job
from rq.queue import Queue
from rq.utils import utcformat, utcparse

from shared.contract import keys
from shared.contract.jobs import PRIORITIES, Priority
from shared.contract.models import DEFAULT_MODEL_NAME
from shared.contract.settings import Settings
from shared.store import fencing, scripts
from shared.store.connection import text


@dataclass(frozen=True)
class Claimed:
    """A job id a worker has just claimed, with the job's record as it stood (empty: none), Redis's
    clock at the claim and the fence token of the attempt the claim started ('' for none)."""

    job_id: str
    record: dict[bytes, bytes]
    at: float
    token: str = ""
    line: str = ""  # the line it was claimed from (a worker serving several models claims from each)


@dataclass(frozen=True)
class Affinity:
    """What a worker holds, for its claim to prefer: the adapters it ran last (an adapters key,
    '' for the bare model) and those resident, and the lines of the models on its device (a worker
    serving several models; the one it ran last first); ``max_skip`` bounds how often a job is
    passed over."""

    max_skip: int = 0
    last: str = ""
    resident: tuple[str, ...] = ()
    on_device: tuple[str, ...] = ()


def job_model(job: Job) -> str:
    """The name of the model a job runs on (admission names it in the request)."""
    return job.kwargs.get("request", {}).get("model") or DEFAULT_MODEL_NAME


def line_of(job: Job) -> str:
    """The line a job waits in: its model's, under the queue it names as its origin."""
    return keys.line_name(job.origin, job_model(job))


def claim(connection: Redis, line: str | Sequence[str], claims_key: str,
          affinity: Affinity | None = None, fence_ttl_s: int = 0) -> Claimed | None:
    """Move the next job id into a worker's claims list, atomically; None when none waits. ``line``:
    a line, or the lines of the models a worker serves, that of the model it ran last first. With
    ``affinity``, a job of the model and adapters the worker holds may go first, within its bound. With a
    ``fence_ttl_s``, the claim also starts an attempt at the job: its fence holds the claim's token
    (shared/store/fencing.py), in the same script."""
    token, args = _claim_arguments(line, affinity, fence_ttl_s)
    return _claimed(scripts.run(connection, "claim", [claims_key], args), token)


def send_claim(connection: Redis, line: str | Sequence[str], claims_key: str,
               affinity: Affinity | None = None, fence_ttl_s: int = 0) -> SentClaim:
    """:func:`claim`, sent now and answered by :meth:`SentClaim.claimed` later: Redis moves the job
    while the caller goes on."""
    token, args = _claim_arguments(line, affinity, fence_ttl_s)
    return SentClaim(scripts.Sent(connection, "claim", [claims_key], args), token)


@dataclass(frozen=True)
class SentClaim:
    """A claim in flight (:func:`send_claim`)."""

    call: scripts.Sent
    token: str

    def claimed(self) -> Claimed | None:
        """The job claimed, as :func:`claim` answers."""
        return _claimed(self.call.reply(), self.token)


def _claim_arguments(line: str | Sequence[str], affinity: Affinity | None, fence_ttl_s: int
                     ) -> tuple[str, list[Any]]:
    """The claim's fence token and its script's arguments."""
    affinity, token = affinity or Affinity(), fencing.new_token() if fence_ttl_s else ""
    lines = [line] if isinstance(line, str) else list(line)
    on_device = ",".join(str(index + 1) for index, each in enumerate(lines) if each in affinity.on_device)
    return token, [",".join(lines), Job.redis_job_namespace_prefix, affinity.max_skip,
                   keys.lines_channel(keys.queue_of(lines[0])), affinity.last, token, fence_ttl_s,
                   on_device, *affinity.resident]


def _claimed(answer: Any, token: str) -> Claimed | None:
    if not answer:
        return None
    job_id, flat, at, line = answer
    return Claimed(job_id.decode(), dict(zip(flat[::2], flat[1::2], strict=True)), float(at), token,
                   line.decode())


def claim_compatible(connection: Redis, line: str, claims_key: str, like: Claimed, count: int,
                     window: int, fence_ttl_s: int = 0, by: Literal["batch", "join"] = "batch",
                     max_skip: int | None = None) -> list[Claimed]:
    """Claim up to ``count`` more jobs that may share a batch with ``like``: of its class and key
    (``by``: its batch key, or its join key for the step-level loop), among the first ``window`` of
    that class (a bounded step out of line). With ``max_skip``, a job of another key is passed over
    at most that many times (counted on it), then nothing behind it is taken. With a
    ``fence_ttl_s``, each claim starts an attempt, as :func:`claim`'s does."""
    sent = send_claim_compatible(connection, line, claims_key, like, count, window, fence_ttl_s, by, max_skip)
    return [] if sent is None else sent.claimed()


def send_claim_compatible(connection: Redis, line: str, claims_key: str, like: Claimed, count: int,
                          window: int, fence_ttl_s: int = 0, by: Literal["batch", "join"] = "batch",
                          max_skip: int | None = None) -> SentCompatible | None:
    """:func:`claim_compatible`, sent now and answered by :meth:`SentCompatible.claimed` later (the
    step-level loop reads it after a step's compute); None when there is nothing to send."""
    priority, key = like.record.get(b"priority", b"normal"), like.record.get(by.encode(), b"")
    if not key or not count:
        return None
    tokens = [fencing.new_token() for _ in range(count)] if fence_ttl_s else []
    args = [like.line or line, Job.redis_job_namespace_prefix, priority, key, count, window, fence_ttl_s, by,
            "" if max_skip is None else max_skip, *tokens]
    return SentCompatible(scripts.Sent(connection, "claim_compatible", [claims_key], args), tokens, like,
                          like.line or line)


@dataclass(frozen=True)
class SentCompatible:
    """A :func:`send_claim_compatible` in flight."""

    call: scripts.Sent
    tokens: list[str]
    like: Claimed
    line: str

    def claimed(self) -> list[Claimed]:
        """The jobs claimed, as :func:`claim_compatible` answers."""
        return [Claimed(job_id.decode(), dict(zip(flat[::2], flat[1::2], strict=True)), self.like.at,
                        self.tokens[index] if self.tokens else "", self.line)
                for index, (job_id, flat) in enumerate(self.call.reply())]


def wait_for_work(connection: Redis, line: str | Sequence[str], timeout: float) -> None:
    """Block until a job may be waiting in the line, or any of the lines (each admission rings its
    line's doorbell), or the timeout passes."""
    lines = [line] if isinstance(line, str) else line
    connection.blpop([f"{keys.line_key(each)}:doorbell" for each in lines], timeout=timeout)


def requeue(client: Redis | Pipeline, line: str, job_id: str) -> None:
    """Put a job back at the head of its class (in a pipeline: when it executes)."""
    scripts.run(client, "requeue", [Job.key_for(job_id)], [line, job_id])


def remove(connection: Redis, line: str, job_id: str) -> bool:
    """Take a waiting job out of the line; False when it was not waiting (a worker has it)."""
    return bool(scripts.run(connection, "remove", [Job.key_for(job_id)], [line, job_id]))


def recount_costs(connection: Redis, line: str) -> dict[str, float]:
    """Set each class's waiting-cost sum (which ETAs read) to what its waiting jobs cost; the sums."""
    flat = scripts.run(connection, "recount_costs", [], [line, Job.redis_job_namespace_prefix])
    return {name.decode(): float(value) for name, value in zip(flat[::2], flat[1::2], strict=True)}


def waited_above(connection: Redis, line: str, priority: str) -> float | None:
    """How long the first job of the highest class above ``priority`` that has work has waited, in
    seconds; None when no job of a higher class waits."""
    answer = scripts.run(connection, "waiting_above", [], [line, priority, Job.redis_job_namespace_prefix])
    if not answer:
        return None
    _, admitted, now = answer
    if not admitted:
        return 0.0
    return max(0.0, float(now) - utcparse(admitted.decode()).replace(tzinfo=UTC).timestamp())


def pause(connection: Redis, line: str) -> int:
    """Pause a line (an operator's): it admits, and no worker claims from it, a running job finishing
    as ever; how many jobs wait in it."""
    return _pausing(connection, line, "pause")


def resume(connection: Redis, line: str) -> int:
    """Resume a paused line: its jobs start in their order again; how many wait in it."""
    return _pausing(connection, line, "resume")


def _pausing(connection: Redis, line: str, mode: str) -> int:
    return int(scripts.run(connection, "pause", [], [line, mode, keys.lines_channel(keys.queue_of(line))]))


def to_front(connection: Redis, line: str, job_id: str) -> int | None:
    """Move a waiting job to the front of its class (an operator's); its place before the move, None
    when it does not wait in the line."""
    answer = scripts.run(connection, "front", [Job.key_for(job_id)],
                         [line, job_id, keys.lines_channel(keys.queue_of(line))])
    return None if answer is None else int(answer)


def waiting_ids(connection: Redis, line: str, limit: int) -> list[str]:
    """The first ``limit`` ids of a line in the order workers take them: class by class, fair share
    inside each (without affinity, which a claim applies at its own moment)."""
    ids: list[str] = []
    for name in PRIORITIES:
        if len(ids) >= limit:
            break
        order = f"{keys.line_key(line)}:{name}"  # lua/lib/line.lua's order_key
        ids += [text(raw) for raw in cast(list[bytes], connection.zrange(order, 0, limit - len(ids) - 1))]
    return ids


def reclass(connection: Redis, job: Job, priority: Priority) -> int | None:
    """Move a waiting job to another priority class, its stored request naming it; its place in the
    line now, None when it does not wait."""
    request = {**job.kwargs.get("request", {}), "priority": priority}
    job.kwargs = {**job.kwargs, "request": request}
    data = zlib.compress(job.data)  # as RQ stores a job's call
    answer = scripts.run(connection, "reclass", [job.key],
                         [line_of(job), job.id, priority, data, keys.lines_channel(job.origin)])
    return None if answer is None else int(answer)


def counts(connection: Redis, line: str) -> dict[str, int]:
    """How many jobs wait in each class."""
    return line_state(connection, line)[0]


def line_state(connection: Redis, line: str) -> tuple[dict[str, int], bool]:
    """How many jobs wait in each class, and whether an operator paused the line: one round trip."""
    *classes, paused = scripts.run(connection, "counts", [], [line])
    return dict(zip(PRIORITIES, (int(n) for n in classes), strict=True)), paused == 1


def position(connection: Redis, line: str, job_id: str) -> int | None:
    """How many jobs a worker takes before this one; None when it is not waiting."""
    answer = scripts.run(connection, "position", [Job.key_for(job_id)], [line, job_id])
    return None if answer is None else int(answer)


def expire_due(queue: Queue, settings: Settings, line: str) -> float:
    """End the waiting jobs of a line whose deadline has passed; returns Redis's clock."""
    now = scripts.run(queue.connection, "expire", [keys.deadlines_key(line)],
                      [line, Job.redis_job_namespace_prefix, utcformat(datetime.now(UTC)),
                       settings.record_ttl_s, keys.events_channel(queue.name),
                       keys.webhooks_key(queue.name), keys.ended_key(queue.name), settings.result_ttl_s])
    return float(now)


def waiting_counts(queue: Queue, settings: Settings, line: str) -> dict[str, int]:
    """Jobs waiting now in each priority class of a line, after the expired ones have left."""
    return waiting_state(queue, settings, line)[0]


def waiting_state(queue: Queue, settings: Settings, line: str) -> tuple[dict[str, int], bool]:
    """:func:`waiting_counts`, and whether the line is paused."""
    expire_due(queue, settings, line)
    return line_state(queue.connection, line)
