"""The webhook outbox: a sorted set of pending deliveries by due time (``keys.webhooks_key``).

Whoever changes a job's status queues its delivery here in the same round trip as the change: a
start by :func:`schedule`, an end by the script that writes it (``lua/lib/ending.lua``). A sender
(worker/webhooks.py) takes one due entry at a time under a lease, then drops it or puts it back for
a retry.
"""

from __future__ import annotations

import time
from dataclasses import replace

from redis import Redis
from redis.client import Pipeline
from rq.job import Job

from shared.contract import keys
from shared.contract.jobs import WebhookEvent
from shared.contract.webhooks import Entry, started_id, wants
from shared.store import scripts


def schedule_started(pipe: Pipeline, queue_name: str, job: Job) -> None:
    """Queue the outbox write for this start of the job, if its request asks for it."""
    if not asks_for(job, "started"):
        return
    now = time.time()
    entry = Entry(started_id(job.id, int(job.meta.get("attempt", 0))), job.id, "job.started", now)
    pipe.zadd(keys.webhooks_key(queue_name), {entry.encode(): now})


def asks_for(job: Job, event: WebhookEvent) -> bool:
    """Whether the job's stored request asks for deliveries of this event."""
    return wants((job.kwargs or {}).get("request") or {}, event)


def take_due(connection: Redis, queue_name: str, lease_s: float) -> bytes | None:
    """The first due entry, moved a lease ahead so that no other sender takes it meanwhile."""
    raw = scripts.run(connection, "outbox_claim", [keys.webhooks_key(queue_name)], [time.time(), lease_s])
    return raw if raw is None or isinstance(raw, bytes) else str(raw).encode()


def retry_later(connection: Redis, queue_name: str, raw: bytes, entry: Entry, delay_s: float) -> None:
    """Put a failed delivery back, its attempt counted, due in ``delay_s``."""
    outbox = keys.webhooks_key(queue_name)
    with connection.pipeline() as pipe:  # MULTI: the entry is replaced, never lost
        pipe.zrem(outbox, raw)
        pipe.zadd(outbox, {replace(entry, attempt=entry.attempt + 1).encode(): time.time() + delay_s})
        pipe.execute()


def drop(connection: Redis, queue_name: str, raw: bytes) -> None:
    """A delivery done, refused or given up on: out of the outbox."""
    connection.zrem(keys.webhooks_key(queue_name), raw)
