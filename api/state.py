"""The API's state: what ``create_app`` builds onto ``app.extensions``, and the caller's tenant on ``g``.

Every reader goes through these accessors, each typed. Without an ``app`` they read the current one
(``current_app``); the server's signal hooks, outside any request, name theirs.
"""

from __future__ import annotations

import threading
from typing import Any

from flask import Flask, current_app, g
from rq import Queue

from api.jobs import Jobs
from api.longpoll import Waits
from api.metrics import ApiMetrics
from api.streams import Streams
from shared.contract.settings import Settings
from shared.contract.tenants import KeyPolicy, Tenant, policies
from shared.store.connection import connect, job_queue

# The keys of ``app.extensions``: tests and benchmarks read and set them too, so they keep these names.
SETTINGS = "slotq.settings"
QUEUE = "slotq.queue"
DRAINING = "slotq.draining"
WAITS = "slotq.waits"
JOBS = "slotq.jobs"
STREAMS = "slotq.streams"
KEY_POLICIES = "slotq.keys"
METRICS = "slotq.metrics"


def install(app: Flask, settings: Settings) -> None:
    """Build this app's state for these settings: one Redis connection, the queue, and what reads it."""
    queue = job_queue(connect(settings), settings)
    draining = threading.Event()  # set by the server on SIGTERM (api/server.py)
    waits = Waits.for_settings(queue.connection, settings, draining)
    app.extensions.update({
        SETTINGS: settings,
        QUEUE: queue,
        DRAINING: draining,
        WAITS: waits,
        JOBS: Jobs(queue, settings, waits),
        STREAMS: Streams(queue, waits, settings.max_streams, settings.tenant_wait_share),
        KEY_POLICIES: policies(settings),  # empty for an open service
        METRICS: ApiMetrics(settings, queue),
    })


def close(app: Flask) -> None:
    """End an app's background work and close its Redis connections: for an app made in-process
    (tests, benchmarks); a server's ends with its process. The listener is stopped first, or it would
    subscribe again on a fresh connection that nothing closes."""
    draining(app).set()
    waits(app).stop()
    queue(app).connection.close()


def _extensions(app: Flask | None) -> dict[str, Any]:
    return (app if app is not None else current_app).extensions


def settings(app: Flask | None = None) -> Settings:
    """The app's settings."""
    return _extensions(app)[SETTINGS]


def queue(app: Flask | None = None) -> Queue:
    """The app's RQ queue, on its one Redis connection (``queue.connection``)."""
    return _extensions(app)[QUEUE]


def draining(app: Flask | None = None) -> threading.Event:
    """Set once the process drains: ``/readyz`` answers 503 and held requests answer at once."""
    return _extensions(app)[DRAINING]


def waits(app: Flask | None = None) -> Waits:
    """The process's waiting requests and their slots (``api/longpoll.py``)."""
    return _extensions(app)[WAITS]


def jobs(app: Flask | None = None) -> Jobs:
    """The operations on jobs that every route calls (``api/jobs.py``)."""
    return _extensions(app)[JOBS]


def streams(app: Flask | None = None) -> Streams:
    """The process's event streams and their slots (``api/streams.py``)."""
    return _extensions(app)[STREAMS]


def key_policies(app: Flask | None = None) -> dict[str, KeyPolicy]:
    """Each API key with its policy; empty where the service is open."""
    return _extensions(app)[KEY_POLICIES]


def metrics(app: Flask | None = None) -> ApiMetrics:
    """The process's metrics (``api/metrics.py``)."""
    return _extensions(app)[METRICS]


def tenant() -> Tenant | None:
    """The caller's tenant, from its key; None where the service is open."""
    return g.get("tenant")


def set_tenant(caller: Tenant | None) -> None:
    """Name the caller's tenant for the rest of the request (an authentication hook does)."""
    g.tenant = caller
