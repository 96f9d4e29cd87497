"""Long polling: requests that wait for a job's status to change, and the one thread that wakes them.

A waiting request holds one gunicorn thread and sleeps on a ``threading.Event`` of its own. One
listener thread per process subscribes to the queue's events channel (``shared/store/events.py``)
and sets the events of the requests waiting on each announced job id, which then read the job again.
A request counts as waiting before its first read of the job, so that read needs no second look once
the listener is subscribed, and the read after a wake is the one the answer is made of: a held
request reads Redis twice, before the hold and after the wake. Delivery over pub/sub is at most
once, so every ``RECHECK_S`` the listener also reads the status of each job waited on, all in one
round trip, and wakes the requests whose job moved from what they last read: an announcement only
makes them answer sooner. (One read for all of them, rather than a round trip and a wake-up of the
process per request each second.) A line's changes (each claim) come on a channel of their own,
which the listener joins only while an event stream watches a line (and ``LINGER_S`` after), so that
no other process wakes for them. The listener starts on the first wait (gunicorn forks its workers
after import, and a thread does not survive a fork), ends after ``LINGER_S`` with nobody waiting or
once the process drains, and is a daemon thread, so it never keeps a process from exiting.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from redis import Redis
from redis.client import PubSub
from redis.exceptions import RedisError
from rq.job import Job

from api.slots import Slots, Taken
from shared.contract import keys
from shared.contract.errors import InvalidRequestError, TenantWaitShareError, TooManyWaitingError
from shared.contract.jobs import JobStatus
from shared.contract.settings import Settings
from shared.store import events, records

log = logging.getLogger(__name__)

MAX_WAIT_S = 60
RECHECK_S = 1.0  # the listener reads the waited jobs' statuses this often, in case an announcement was lost
TICK_S = 0.25  # the listener looks at the drain flag and its waiters at least this often
LINGER_S = 10.0  # the listener unsubscribes and ends after this long with nobody waiting
READY_S = 1.0  # the longest a first waiter waits for the subscription before relying on re-reads
BACKOFF_S, MAX_BACKOFF_S = 0.5, 5.0
# A plain decimal number ("2", "0.5", "1e1"); float() alone would also take "nan", "inf" and "1_0".
NUMBER = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
DIGITS = re.compile(r"[0-9]+")
Done = Callable[[JobStatus, JobStatus], bool]  # (the status first read, the status now)
LINE = keys.line_changed("")  # how the names of lines' changes begin (a job id never does)


def wait_query(value: str | None) -> float | None:
    """The ``wait`` query parameter in seconds (None when absent), or ``InvalidRequestError``."""
    if value is None:
        return None
    seconds = float(value) if NUMBER.fullmatch(value) else 0.0
    if not 0 < seconds <= MAX_WAIT_S:
        message = f"must be a number of seconds above 0 and at most {MAX_WAIT_S}"
        raise InvalidRequestError(details=[{"loc": ["query", "wait"], "msg": message}])
    return seconds


def preferred_wait(headers: list[str]) -> int | None:
    """RFC 7240's ``Prefer: wait=N`` in whole seconds, cut to MAX_WAIT_S; None when absent or malformed."""
    for preference in ",".join(headers).split(","):
        name, _, value = preference.split(";", 1)[0].partition("=")
        if name.strip().lower() != "wait":
            continue
        value = value.strip()
        if len(value) > 1 and value[0] == value[-1] == '"':
            value = value[1:-1]
        if not DIGITS.fullmatch(value):
            return None  # a preference the server does not understand is ignored (RFC 7240, 2)
        digits = value.lstrip("0")
        seconds = min(int(digits or "0"), MAX_WAIT_S) if len(digits) <= 3 else MAX_WAIT_S
        return seconds or None
    return None


def changed(first: JobStatus, now: JobStatus) -> bool:
    """Done once the job's status is no longer the one first read; at once when that one is final."""
    return now is not first or now.is_terminal


def finished(first: JobStatus, now: JobStatus) -> bool:
    """Done once the job has ended."""
    return now.is_terminal


class Waits:
    """The requests of one API process that wait on jobs, and the listener thread that wakes them."""

    def __init__(self, connection: Redis, queue_name: str, draining: threading.Event, capacity: int,
                 tenant_share: float = 1.0) -> None:
        self._connection = connection
        self._queue_name = queue_name
        self._draining = draining
        # Past this many waiting requests a wait is not held: threads stay free for submits and reads.
        # And a tenant holds at most its share of them.
        self.slots = Slots(capacity, tenant_share)
        self._lock = threading.Lock()
        self._waiters: dict[str, set[threading.Event]] = {}
        self._seen: dict[threading.Event, tuple[str, JobStatus]] = {}  # each held request's job, as last read
        self._looked = time.monotonic()  # when the listener last read the statuses of the jobs waited on
        self._listener: threading.Thread | None = None
        self._last_listener: threading.Thread | None = None  # the latest started, retired or not
        self._subscribed = threading.Event()
        self._last_wait = time.monotonic()  # when a request last began or stopped waiting
        self._lines_channel = keys.lines_channel(queue_name)
        self._lines = threading.Event()  # subscribed to the lines channel too
        self._line_waits, self._last_line_wait = 0, -LINGER_S  # those watching a line; when one last did

    @classmethod
    def for_settings(cls, connection: Redis, settings: Settings, draining: threading.Event) -> Waits:
        """Waits for this API process: half its threads may wait, the other half stay free."""
        return cls(connection, settings.queue_name, draining, max(1, settings.api_threads // 2),
                   settings.tenant_wait_share)

    @property
    def waiting(self) -> int:
        """How many requests wait now."""
        with self._lock:
            return sum(len(events) for events in self._waiters.values())

    @contextmanager
    def reserved(self, tenant: str | None = None) -> Iterator[None]:
        """A waiting slot taken before the job is admitted, for a call that must wait (the
        compatibility surfaces' synchronous calls): ``TooManyWaitingError`` where none is free,
        ``TenantWaitShareError`` where the tenant holds its share, so that a refused call leaves no
        job behind. ``hold(..., reserved=True)`` uses it."""
        taken = self.slots.take(tenant)
        if taken is Taken.OVER_SHARE:
            raise TenantWaitShareError(retry_after=1)
        if taken is Taken.FULL:
            raise TooManyWaitingError(retry_after=1)
        try:
            yield
        finally:
            self.slots.give(tenant)

    def hold(self, job_id: str, read: Callable[[], Job], seconds: float, done: Done,
             reserved: bool = False, tenant: str | None = None, refuse: bool = False) -> Job | None:
        """The job as ``read`` gives it once ``done``, ``seconds`` pass or the process drains (at once
        where it is done already); None when not held: the process drains, or every waiting slot is
        taken, or the tenant holds its share of them (``refuse``: ``TenantWaitShareError`` then).
        ``reserved``: the caller holds a slot already (:meth:`reserved`)."""
        if self._draining.is_set():
            return None
        if not reserved:
            taken = self.slots.take(tenant)
            if taken is Taken.OVER_SHARE and refuse:
                raise TenantWaitShareError(retry_after=1)
            if taken is not Taken.TAKEN:
                log.info("too many requests waiting (%s); job %s answered at once", taken.value, job_id)
                return None
        wake = threading.Event()
        try:
            # Waiting before the first read: whatever is announced after that read wakes this one.
            self._enter(job_id, wake)
            subscribed = self._subscribed.is_set()
            job = read()
            first = records.job_status(job)
            if done(first, first):
                return job
            until = time.monotonic() + seconds
            if not subscribed:
                # Announcements count from the subscription on: read again once it is in place. The
                # listener wakes every waiter when it subscribes, and when the process drains (a
                # wait on the subscription alone held a drained request for READY_S).
                wake.wait(max(0.0, min(READY_S, until - time.monotonic())))
                wake.clear()  # before the read: the next wait sees whatever is announced after it
                job = read()
            return self._watch(job, first, until, done, wake, read)
        finally:
            self._leave(job_id, wake)
            if not reserved:
                self.slots.give(tenant)

    @contextmanager
    def watching(self, *names: str) -> Iterator[threading.Event]:
        """An event set whenever any of these names (job ids, ``keys.line_changed``) is announced,
        or the process drains; once subscribed, so that nothing announced after it is missed."""
        wake = threading.Event()
        for name in names:
            self._enter(name, wake)
        try:
            # After entering: the listener leaves the channel only under the lock, clearing the flag.
            if any(name.startswith(LINE) for name in names) and not self._lines.is_set():
                self._nudge()
                self._lines.wait(READY_S)
            self._subscribed.wait(READY_S)
            yield wake
        finally:
            for name in names:
                self._leave(name, wake)

    @property
    def draining(self) -> bool:
        """Whether the process is shutting down: whoever waits answers now."""
        return self._draining.is_set()

    def _watch(self, job: Job, first: JobStatus, until: float, done: Done, wake: threading.Event,
               read: Callable[[], Job]) -> Job:
        deadline = job.meta.get("deadline_at")  # seconds since the epoch, on Redis's clock
        while not self._draining.is_set():
            status = records.job_status(job)
            if done(first, status):
                return job
            remaining = until - time.monotonic()
            if status is JobStatus.QUEUED and deadline is not None:
                # Nothing announces a deadline passing until something expires the job: answer
                # then, and the view expires it.
                remaining = min(remaining, deadline - time.time())
            if remaining <= 0:
                return read()  # as a request without ``wait`` would read it now
            with self._lock:
                self._seen[wake] = (job.id, status)  # for the listener's look (_look_if_due)
            # Announced, or the listener's look saw the job move: read it again.
            if wake.wait(remaining):
                wake.clear()  # before the read: the next wait sees whatever is announced after it
                job = read()
        return read()  # the process drains: the job as it stands now

    def stop(self, timeout: float = 5.0) -> None:
        """Wait until the listener thread has ended and let go of its subscription, once ``draining``
        is set (it looks every TICK_S)."""
        listener = self._last_listener
        if listener is not None:
            listener.join(timeout)

    def _nudge(self) -> None:
        """Have the listener look at its channels now (an empty announcement), not at its next tick."""
        try:
            events.announce(self._connection, self._queue_name, "")
        except RedisError:
            pass  # the listener looks within TICK_S anyway

    def _enter(self, job_id: str, wake: threading.Event) -> None:
        with self._lock:
            self._waiters.setdefault(job_id, set()).add(wake)
            self._last_wait = time.monotonic()
            if job_id.startswith(LINE):
                self._line_waits += 1
                self._last_line_wait = self._last_wait
            if self._listener is None or not self._listener.is_alive():
                self._subscribed.clear()
                self._listener = threading.Thread(target=self._listen, name="slotq-longpoll", daemon=True)
                self._last_listener = self._listener
                self._listener.start()

    def _leave(self, job_id: str, wake: threading.Event) -> None:
        with self._lock:
            self._seen.pop(wake, None)
            events = self._waiters.get(job_id, set())
            events.discard(wake)
            if not events:
                self._waiters.pop(job_id, None)
            self._last_wait = time.monotonic()
            if job_id.startswith(LINE):
                self._line_waits -= 1
                self._last_line_wait = self._last_wait

    def _wake(self, job_id: str | None = None) -> None:
        """Wake the requests waiting on this job, or all of them."""
        with self._lock:
            waiting = [self._waiters.get(job_id, set())] if job_id else list(self._waiters.values())
            for event in (event for events in waiting for event in events):
                event.set()

    def _listen(self) -> None:
        """The listener thread: relay announcements; after a Redis error, subscribe again with backoff."""
        backoff = BACKOFF_S
        while not self._draining.is_set():
            pubsub: PubSub | None = None
            try:
                pubsub = events.subscribe(self._connection, self._queue_name)
                self._relay(pubsub)
                break
            except RedisError as exc:
                if self._subscribed.is_set():
                    backoff = BACKOFF_S  # it worked until now: a fresh drop
                log.warning("long-poll listener lost Redis (%s); subscribing again in %.1fs", exc, backoff)
            except Exception:  # a bug here must not end the thread: waiters would fall back to re-reads
                log.exception("long-poll listener failed; subscribing again in %.1fs", backoff)
            finally:
                if pubsub is not None:
                    pubsub.close()
            self._subscribed.clear()
            self._lines.clear()
            self._wake()  # announcements may have been lost meanwhile: let every waiter read again
            if self._draining.wait(backoff) or self._retire_if_idle():
                break  # with nobody waiting, a Redis that is down is not worth retrying
            backoff = min(backoff * 2, MAX_BACKOFF_S)
        self._wake()  # draining: every waiting request answers now (after retiring: nobody waits)

    def _relay(self, pubsub: PubSub) -> None:
        """Wake the waiters of each announced job until the process drains or nobody waited for a while."""
        lines = False  # whether this subscription asked for the lines channel
        while not self._draining.is_set() and not self._retire_if_idle():
            lines = self._follow_lines(pubsub, lines)
            self._receive(pubsub.get_message(timeout=TICK_S))
            self._look_if_due()

    def _follow_lines(self, pubsub: PubSub, asked: bool) -> bool:
        """Join the lines channel while a stream watches a line or did within LINGER_S, leave it
        after; whether it is asked for now."""
        with self._lock:
            wanted = self._line_waits > 0 or time.monotonic() - self._last_line_wait < LINGER_S
            if asked and not wanted:
                # Under the lock: a stream that begins to watch now finds it cleared, and waits for
                # the next subscription rather than trusting this one.
                self._lines.clear()
        if wanted and not asked:
            pubsub.subscribe(self._lines_channel)
        elif asked and not wanted:
            pubsub.unsubscribe(self._lines_channel)
        return wanted

    def _retire_if_idle(self) -> bool:
        """End this listener once nobody has waited for LINGER_S; the next waiter starts another."""
        with self._lock:
            if self._waiters or time.monotonic() - self._last_wait < LINGER_S:
                return False
            self._listener = None
            self._subscribed.clear()
            self._lines.clear()
            return True

    def _look_if_due(self) -> None:
        """Every RECHECK_S, read the status in the hash of each job a request waits on (one round
        trip for all) and wake the requests whose job's status differs from the one they last read.
        The hash and a view differ only for an expired job (the hash says canceled), and a request
        whose job has ended has answered: what it last read is never a final status."""
        now = time.monotonic()
        if now - self._looked < RECHECK_S:
            return
        self._looked = now
        with self._lock:
            seen = list(self._seen.items())
        if not seen:
            return
        ids = list({job_id for _, (job_id, _) in seen})
        stored = dict(zip(ids, records.stored_statuses(self._connection, ids), strict=True))
        for wake, (job_id, status) in seen:
            if stored[job_id] is not status:
                wake.set()

    def _receive(self, message: dict[str, Any] | None) -> None:
        if message is None:
            return
        if message["type"] == "subscribe":
            # Subscribed, perhaps again after redis-py reconnected on its own: what was announced
            # before may be lost, so every waiter reads again.
            lines = message["channel"].decode() == self._lines_channel
            (self._lines if lines else self._subscribed).set()
            self._wake()
        elif message["type"] == "message" and (name := message["data"].decode()):
            self._wake(name)  # (an empty one only nudged the listener)
