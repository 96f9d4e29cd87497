"""A tenant's jobs, newest first (``GET /v1/jobs``), paged by a cursor.

Admission adds each job to its tenant's sorted set by admission time (``lua/admit.lua``; without
API keys one set holds every job). A page walks the set from the cursor down, reads the jobs in
one round trip per chunk, drops the ids whose record has expired (from the set too) and those
not of the asked statuses, and stops at ``limit`` jobs or after ``SCAN_BUDGET`` ids, so a filter
that matches little still answers in bounded time: the page is then short, and ``next`` goes on.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import cast

from rq.job import Job
from rq.queue import Queue

from shared.contract import keys
from shared.contract.errors import InvalidRequestError
from shared.contract.jobs import JobStatus, JobView
from shared.contract.tenants import Tenant
from shared.store import records
from shared.store.connection import text

CHUNK = 50  # ids read per round trip
SCAN_BUDGET = 1000  # ids looked at per page, at most
# A cursor is the admission time (seconds) of the last job of its page; any such number is a place.
CURSOR = re.compile(r"[0-9]{1,16}(\.[0-9]{1,17})?")


@dataclass(frozen=True)
class Page:
    """One page of a listing: the views, and the cursor of the next page (None: this was the last)."""

    jobs: list[JobView]
    next: str | None


def list_jobs(queue: Queue, tenant: Tenant | None, limit: int, statuses: Collection[JobStatus] = (),
              cursor: str | None = None) -> Page:
    """The tenant's jobs (every job without API keys), newest first, of these statuses (any if none)."""
    key = keys.listed_key(queue.name, tenant.name if tenant else "")
    below = _decoded(cursor) if cursor is not None else "+inf"
    found: list[JobView] = []
    scanned = 0
    while scanned < SCAN_BUDGET:
        entries = cast(list[tuple[bytes, float]], queue.connection.zrange(
            key, below, "-inf", desc=True, byscore=True, offset=0, num=min(CHUNK, SCAN_BUDGET - scanned),
            withscores=True))
        if not entries:
            return Page(found, None)
        for (raw_id, score), job in zip(entries, _fetched(queue, entries), strict=True):
            scanned += 1
            below = f"({score!r}"  # the next read starts below this one (admission times are unique)
            if job is None:
                queue.connection.zrem(key, raw_id)  # its record expired
            elif not statuses or records.job_status(job) in statuses:
                found.append(records.standing_view(queue, job))
                if len(found) == limit:  # a next page while any id is left below this one
                    more = queue.connection.zcount(key, "-inf", below)
                    return Page(found, _encoded(score) if more else None)
    return Page(found, _encoded(float(below.lstrip("("))))


def _fetched(queue: Queue, entries: list[tuple[bytes, float]]) -> list[Job | None]:
    ids = [text(raw_id) for raw_id, _ in entries]
    return Job.fetch_many(ids, connection=queue.connection, serializer=queue.serializer)


def _encoded(score: float) -> str:
    return repr(score)  # the shortest text that reads back as the same float: no page repeats a job


def _decoded(cursor: str) -> str:
    """The exclusive upper bound a cursor stands for, or ``InvalidRequestError``."""
    if not CURSOR.fullmatch(cursor):
        raise InvalidRequestError(details=[{"loc": ["query", "cursor"],
                                            "msg": "not a cursor this service gave: use `next` as it is"}])
    return f"({cursor}"
