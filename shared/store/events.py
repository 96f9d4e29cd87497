"""Announcing that a job's status changed, so that requests waiting on it wake at once.

Redis pub/sub: the id of the job is published on the queue's channel by whoever changes its
status (the worker, an API process cancelling it, the scripts that expire or recover it). Delivery
is at most once, so a waiter also looks again on its own now and then; an announcement only makes
it answer sooner.
"""

from __future__ import annotations

import json
from typing import Any

from redis import Redis
from redis.client import Pipeline, PubSub

from shared.contract import keys


def announce(client: Redis | Pipeline, queue_name: str, job_id: str) -> None:
    """Publish that this job's status changed (in a pipeline: when it executes)."""
    client.publish(keys.events_channel(queue_name), job_id)


def announce_line(client: Redis | Pipeline, line: str) -> None:
    """Publish that the order of this line changed (in a pipeline: when it executes)."""
    client.publish(keys.lines_channel(keys.queue_of(line)), keys.line_changed(line))


def log(client: Redis | Pipeline, job_id: str, event: str, data: Any = None) -> None:
    """Append an event to the job's log (in a pipeline: when it executes); announce it separately."""
    fields: dict[Any, Any] = {"event": event, **({"data": json.dumps(data)} if data is not None else {})}
    client.xadd(keys.log_key(job_id), fields, maxlen=keys.LOG_LENGTH, approximate=True)


def subscribe(connection: Redis, queue_name: str) -> PubSub:
    """A subscription to the queue's announcements; each message's data is a job id. Close it."""
    pubsub = connection.pubsub()
    try:
        pubsub.subscribe(keys.events_channel(queue_name))
    except BaseException:
        pubsub.close()
        raise
    return pubsub
