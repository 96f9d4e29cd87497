"""Auto-pipelining: the script calls that requests of one process make at the same moment, sent
to Redis in one round trip.

Under load an API process has several requests admitting at once, and each script call paid a
round trip of its own: a pool checkout (with its readiness poll), a send that wakes Redis, a read.
On a small machine that round trip is the largest single cost of an admission. Here the first
caller sends; whoever calls while its round trip is out waits for it to come back, and the first
of them then sends all that gathered as one pipeline (``transaction=False``), then hands on. At
low load every call goes alone, at once; no call waits on a timer. (ioredis's
``enableAutoPipelining`` does the same; redis-py has no such switch.)

Nothing about a call changes: each is still one ``EVALSHA`` that Redis runs atomically, on its
own, in arrival order; a pipeline only shares the socket. A call's error is its own (a script's
refusal, NOSCRIPT); a connection error reaches every call of that round trip, as it would have
reached each alone. A caller gone before its call was sent (a greenlet killed while it waits) is
left out, and a lead handed to it passes on.

A round trip packs its calls with hiredis in one C call each, on a connection of the client's pool,
with the client's retry policy: redis-py's pipeline encodes each of an admission's many arguments
in Python and adds its own bookkeeping, several times the client's CPU a call that this takes.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import hiredis
from redis import Redis
from redis.connection import AbstractConnection
from redis.exceptions import NoScriptError, ResponseError

from shared.store import scripts

MAX_CALLS = 32  # a round trip's calls at most: bounds one send (a call may carry input images)


@dataclass(eq=False)
class _Call:
    """One caller's script call, and how it ended (or that it is to lead the next round trip)."""

    name: str
    keys: Sequence[str]
    args: Sequence[Any]
    # Looked up per call, not bound here: gevent patches threading after this module is imported.
    woken: threading.Event = field(default_factory=lambda: threading.Event())
    leads: bool = False
    finished: bool = False
    result: Any = None
    error: BaseException | None = None

    def end(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error, self.finished = result, error, True
        self.woken.set()


class AutoPipeline:
    """Script calls on one client; concurrent ones share round trips (threads or greenlets)."""

    def __init__(self, client: Redis) -> None:
        self._client = client
        self._lock = threading.Lock()
        self._gathered: list[_Call] = []
        self._out = False  # a round trip is out: new calls gather for the next one
        self.round_trips = 0  # how many were sent, for the tests and the benchmarks

    def run(self, name: str, keys: Sequence[str] = (), args: Sequence[Any] = ()) -> Any:
        """Run one script with EVALSHA and return its answer, as ``scripts.run`` does."""
        call = _Call(name, keys, args)
        with self._lock:
            self._gathered.append(call)
            call.leads = not self._out
            self._out = True
        while not call.finished:
            if call.leads:
                self._lead()
                continue
            try:
                call.woken.wait()
            except BaseException:  # a greenlet killed while it waits (gunicorn's graceful timeout)
                self._abandon(call)
                raise
            call.woken.clear()
        if call.error is not None:
            raise call.error
        return call.result

    def _abandon(self, call: _Call) -> None:
        """A caller gives up before its call was sent: it is not sent, and a lead handed to it
        passes on, so that no call waits behind a caller that is gone."""
        with self._lock:
            if call in self._gathered:
                self._gathered.remove(call)
                if call.leads:
                    self._hand_on()

    def _lead(self) -> None:
        """Send what gathered (the leader's own call among it), then hand the lead on."""
        with self._lock:
            batch, self._gathered = self._gathered[:MAX_CALLS], self._gathered[MAX_CALLS:]
            self.round_trips += 1
        try:
            self._send(batch)
        except BaseException as exc:
            for call in batch:
                if not call.finished:
                    call.end(error=exc)
        finally:
            with self._lock:
                self._hand_on()

    def _hand_on(self) -> None:
        """The lead to the first call gathered, or (none) the next call leads as it comes."""
        if self._gathered:
            successor = self._gathered[0]
            successor.leads = True
            successor.woken.set()
        else:
            self._out = False

    def _send(self, batch: list[_Call]) -> None:
        answers = self._pipelined(batch)
        missing = [index for index, answer in enumerate(answers) if isinstance(answer, NoScriptError)]
        if missing:  # a restarted or flushed Redis: load those scripts, then send their calls again
            for name in {batch[index].name for index in missing}:
                self._client.script_load(scripts.source(name))
            for index, answer in zip(missing, self._pipelined([batch[index] for index in missing]),
                                     strict=True):
                answers[index] = answer
        for call, answer in zip(batch, answers, strict=True):
            if isinstance(answer, BaseException):
                call.end(error=answer)
            else:
                call.end(result=answer)

    def _pipelined(self, batch: list[_Call]) -> list[Any]:
        """Each call's answer, or its error (a ``ResponseError``), in order: one round trip."""
        commands = [("EVALSHA", scripts.sha(call.name), len(call.keys), *call.keys, *call.args)
                    for call in batch]
        pool = self._client.connection_pool
        connection = pool.get_connection()
        try:
            packed = [_packed(connection, command) for command in commands]
            # As redis-py's pipeline does: on a dropped connection, reconnect and send it all again
            # (the admission script tells a call sent twice by its answer).
            return connection.retry.call_with_retry(lambda: _round_trip(connection, packed, len(commands)),
                                                    lambda error: connection.disconnect())
        except BaseException:
            connection.disconnect()  # replies may be left unread: nobody may borrow it in that state
            raise
        finally:
            pool.release(connection)


def _packed(connection: AbstractConnection, command: tuple[Any, ...]) -> bytes:
    """One command in Redis's protocol: hiredis's packing, or (an argument it does not take, such as
    a bool) redis-py's, which raises its ``DataError`` for what Redis cannot take either."""
    try:
        return hiredis.pack_command(command)
    except TypeError:
        return b"".join(connection.pack_command(*command))


def _round_trip(connection: AbstractConnection, packed: list[bytes], count: int) -> list[Any]:
    """Send the packed calls at once, then read their ``count`` replies, an error one as its error."""
    connection.send_packed_command(packed)
    answers: list[Any] = []
    for _ in range(count):  # every reply is read, an error among them or not: the socket stays in step
        try:
            answers.append(connection.read_response())
        except ResponseError as error:
            answers.append(error)
    return answers


_pipelines: weakref.WeakKeyDictionary[Redis, AutoPipeline] = weakref.WeakKeyDictionary()
_made = threading.Lock()


def of(client: Redis) -> AutoPipeline:
    """The auto-pipeline of this client (one a client, made on first use)."""
    pipeline = _pipelines.get(client)
    if pipeline is None:
        with _made:
            pipeline = _pipelines.setdefault(client, AutoPipeline(client))
    return pipeline
