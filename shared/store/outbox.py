"""The webhook outbox: a sorted set of pending deliveries by due time (``keys.webhooks_key``).

Whoever changes a job's status queues its delivery here in the same round trip as the change;
``lua/lib/outbox.lua`` does the same for a job that ends inside a script.
"""

from __future__ import annotations

import time

from redis.client import Pipeline
from rq.job import Job

from shared.contract import keys
from shared.contract.webhooks import Entry, Event, message_id, wants


def schedule(pipe: Pipeline, queue_name: str, job: Job, event: Event) -> None:
    """Queue the outbox write for this event of the job, if its request asks for it."""
    if not wants((job.kwargs or {}).get("request") or {}, event):
        return
    # Each start of a job is an event of its own (a requeued job starts again); its end is one.
    attempt = int(job.meta.get("attempt", 0)) if event == "started" else 0
    now = time.time()
    entry = Entry(message_id(job.id, event, attempt), job.id, f"job.{event}", now)
    pipe.zadd(keys.webhooks_key(queue_name), {entry.encode(): now})
