"""Event streams: ``GET /v1/jobs/<id>/events`` as server-sent events, from the job's event log.

Every writer of a job's record appends to its log in the same round trip (a Redis stream,
``shared/store/events.py``): ``queued``, ``started``, ``progress``, ``preview`` and the final
status. A stream sends the log's entries after the client's ``Last-Event-ID``, each once, then
waits on the process's one pub/sub listener (``api/longpoll.py``), which wakes it when the job or
its line is announced; it reads the log again only then. The data of ``queued``, ``started`` and
the final event is the job's view when it is sent, so a ``queued`` or ``started`` the job has
moved past by then is left out (what it is now follows). A ``preview`` entry holds only its step:
the picture is the job's latest preview (one key, ``shared/store/records.py``), so of several
unsent previews only the last goes out, with the newest picture. Between entries it sends the job's place
in the line each time it changes (a claim or a cancel ahead of it moved it up), with an id that
names the place, so a client that reconnects is told again only if it moved. A comment goes out
every ``KEEPALIVE_S`` so that proxies keep the stream open; the stream ends after the final event,
or when the process drains (the client reconnects to another).

A stream holds one of the process's SLOTQ_MAX_STREAMS slots while it is open; past them a request
is refused with 503 and ``Retry-After``, and past its tenant's share of them (SLOTQ_TENANT_WAIT_SHARE)
with 429.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import cast

from redis import Redis
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job

from api.longpoll import Waits
from api.slots import Slots, Taken
from shared.contract import keys
from shared.contract.errors import InvalidRequestError, TenantStreamShareError, TooManyStreamsError
from shared.contract.jobs import JobStatus, JobView
from shared.contract.tenants import Tenant
from shared.store import records, waiting
from shared.store.connection import text

KEEPALIVE_S = 15.0
READ_COUNT = 100  # log entries read per round trip
# A log entry's id ("1764604012345-0"), with the place the client was last told ("…/q3"), or
# marking the final event ("…/end").
EVENT_ID = re.compile(r"(?P<entry>[0-9]{1,20}-[0-9]{1,20})(?:/q(?P<position>[0-9]{1,9})|(?P<end>/end))?")
TERMINAL = {status.value for status in JobStatus if status.is_terminal}
# The events whose view is sent only while the job is still as the event says.
CURRENT = {"queued": JobStatus.QUEUED, "started": JobStatus.RUNNING}


@dataclass
class Cursor:
    """Where a stream is: the last log entry sent, and the last place it told."""

    entry: str = "0-0"
    position: int | None = None
    ended: bool = False

    @classmethod
    def parse(cls, last_event_id: str | None) -> Cursor:
        """The cursor a ``Last-Event-ID`` names, or ``InvalidRequestError``."""
        if not last_event_id:
            return cls()
        match = EVENT_ID.fullmatch(last_event_id)
        if match is None:
            raise InvalidRequestError(details=[{"loc": ["header", "Last-Event-ID"],
                                                "msg": "not an event id this service sent"}])
        position = match["position"]
        return cls(match["entry"], int(position) if position is not None else None, match["end"] is not None)


class Streams:
    """The event streams of one API process, at most ``capacity`` open at once, at most
    ``tenant_share`` of them a tenant's."""

    def __init__(self, queue: Queue, waits: Waits, capacity: int, tenant_share: float = 1.0) -> None:
        self.queue, self.waits = queue, waits
        self.slots = Slots(capacity, tenant_share)

    def open(self, job_id: str, tenant: Tenant | None, last_event_id: str | None) -> Opened | None:
        """The stream of a job this tenant may read (else ``JobNotFoundError``), as SSE text; None
        for a client that already had the final event (204 tells EventSource to stop)."""
        job = records.fetch_job(self.queue, job_id, tenant)
        cursor = Cursor.parse(last_event_id)
        if cursor.ended:
            return None
        caller = tenant.name if tenant else None
        taken = self.slots.take(caller)
        if taken is Taken.OVER_SHARE:
            raise TenantStreamShareError(retry_after=2)
        if taken is Taken.FULL:
            raise TooManyStreamsError(retry_after=2)
        return Opened(self._events(job, cursor), lambda: self.slots.give(caller))

    def _events(self, job: Job, cursor: Cursor) -> Iterator[str]:
        line = keys.line_changed(waiting.line_of(job))
        with self.waits.watching(job.id, line) as wake:
            yield "retry: 1000\n\n"  # EventSource reconnects after a second
            while not self.waits.draining:
                wake.clear()  # before the reads: an announcement during them wakes the next wait
                ended = yield from self._pending(job, cursor)
                if ended:
                    return
                if not wake.wait(KEEPALIVE_S):
                    yield ": keep-alive\n\n"

    def _pending(self, job: Job, cursor: Cursor) -> Generator[str, None, bool]:
        """What the client has not had yet; returns whether the job's stream is over."""
        if (yield from self._logged(job, cursor)):
            return True
        view = self._view(job)
        if view is not None and view.status.is_terminal and self._entries(job, cursor, 1):
            # It ended after its log was read: what it logged meanwhile (a last step's progress, then
            # its end) comes first, in order, as it would have to a stream that read a moment later.
            return (yield from self._pending(job, cursor))
        if view is None or view.status.is_terminal:  # ended, but its log is gone (or never had it)
            if view is not None:
                yield _frame(f"{cursor.entry}/end", view.status.value, view.model_dump_json())
            return True
        if view.status is JobStatus.QUEUED and view.position != cursor.position:
            cursor.position = view.position
            yield _frame(f"{cursor.entry}/q{view.position}", "queued", view.model_dump_json())
        return False

    def _logged(self, job: Job, cursor: Cursor) -> Generator[str, None, bool]:
        """The job's log after the cursor, as events; returns whether it reached the job's end."""
        while True:
            entries = self._entries(job, cursor, READ_COUNT)
            # A preview's picture is the job's latest (one key): of a run of them, send the last.
            previews = [index for index, (_, fields) in enumerate(entries) if fields[b"event"] == b"preview"]
            for index, (entry_id, fields) in enumerate(entries):
                cursor.entry = text(entry_id)
                event = text(fields[b"event"])
                if event == "preview":
                    if index == previews[-1]:
                        yield from self._preview(job, cursor)
                    continue
                yield from self._sent(job, cursor, event, fields.get(b"data"))
                if event in TERMINAL:
                    return True
            if len(entries) < READ_COUNT:
                return False

    def _entries(self, job: Job, cursor: Cursor, count: int) -> list[tuple[bytes, dict[bytes, bytes]]]:
        """Up to ``count`` entries of the job's log after the cursor."""
        connection: Redis = self.queue.connection
        return cast(list[tuple[bytes, dict[bytes, bytes]]],
                    connection.xrange(keys.log_key(job.id), f"({cursor.entry}", "+", count=count))

    def _sent(self, job: Job, cursor: Cursor, event: str, data: bytes | None) -> Iterator[str]:
        """One logged event as the client gets it."""
        if data is not None:  # progress: what the writer logged
            yield _frame(cursor.entry, event, text(data))
            return
        view = self._view(job)  # queued, started, the final status: the job's view as it is now
        if view is None or CURRENT.get(event, view.status) is not view.status:
            return  # queued or started, but no longer: what it is now comes next
        if event in TERMINAL:
            yield _frame(f"{cursor.entry}/end", event, view.model_dump_json())
        elif view.status is JobStatus.QUEUED:
            cursor.position = view.position
            yield _frame(f"{cursor.entry}/q{view.position}", event, view.model_dump_json())
        else:
            yield _frame(cursor.entry, event, view.model_dump_json())

    def _preview(self, job: Job, cursor: Cursor) -> Iterator[str]:
        preview = records.latest_preview(job)
        if preview is not None:  # gone once the job has ended a while: its images say more
            yield _frame(cursor.entry, "preview", json.dumps(preview, separators=(",", ":")))

    def _view(self, job: Job) -> JobView | None:
        try:
            fresh = Job.fetch(job.id, connection=self.queue.connection, serializer=self.queue.serializer)
        except NoSuchJobError:  # its record expired: nothing more to say
            return None
        return records.standing_view(self.queue, fresh)


class Opened:
    """An open stream as the WSGI server iterates it; closing it (the server does, however the
    stream ends, even unread) gives its slot back once."""

    def __init__(self, events: Iterator[str], give_back: Callable[[], None]) -> None:
        self._events, self._give_back, self._open = events, give_back, True

    def __iter__(self) -> Iterator[str]:
        return self._events

    def close(self) -> None:
        if self._open:
            self._open = False
            getattr(self._events, "close", lambda: None)()  # the watch ends with the generator
            self._give_back()


def _frame(event_id: str, event: str, data: str) -> str:
    """One server-sent event; ``data`` is one line of JSON (both writers' JSON holds no newline)."""
    return f"id: {event_id}\nevent: {event}\ndata: {data}\n\n"
