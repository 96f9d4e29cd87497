"""Fencing: a worker that lost its claim on a job can no longer write to that job's record.

A worker cut off from Redis (a partition, a long pause) keeps running; meanwhile its heartbeat
lapses and another worker recovers and reruns its jobs. When the first one comes back, its stale
attempt must not touch the new attempt's status, progress or result. So each attempt holds a
token: claiming a job starts an attempt, the claim's script setting the job's fence key to a fresh
token (shared/store/waiting.py); recovering a claim deletes the key.

While a thread works on an attempt (``with holding(fence):``), every write it makes through a
:class:`FencedRedis` connection, RQ's own bookkeeping included, is checked against the token
first: if the token changed, nothing is written and :class:`StaleAttemptError` is raised. A write
or a pipeline of writes goes as one script call that checks the tokens and runs the commands (one
round trip); a transaction that WATCHes keys of its own (RQ's way) WATCHes the fence keys with
them and checks the tokens (WATCH and GET in one round trip, then MULTI … EXEC). Reads pass through.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

from redis import Redis, WatchError
from redis.client import EMPTY_RESPONSE, Pipeline
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.contract import keys
from shared.contract.settings import Settings
from shared.store import connection, scripts


class StaleAttemptError(Exception):
    """The attempt was superseded: another worker recovered the job, so this one must drop it."""


@dataclass(frozen=True)
class Fence:
    """The token of one attempt at one job."""

    job_id: str
    token: str

    @property
    def key(self) -> str:
        return keys.fence_key(self.job_id)


# Commands that never write: they run as they are, without the fence's round trips.
READS = frozenset({
    "DBSIZE", "ECHO", "EXISTS", "GET", "HEXISTS", "HGET", "HGETALL", "HKEYS", "HLEN", "HMGET", "HSCAN",
    "HVALS", "INFO", "LINDEX", "LLEN", "LPOS", "LRANGE", "MGET", "PING", "PTTL", "SCAN", "SCARD",
    "SCRIPT", "SISMEMBER", "SMEMBERS", "SMISMEMBER", "SSCAN", "STRLEN", "TIME", "TTL", "TYPE", "XLEN",
    "XRANGE", "XREVRANGE", "ZCARD", "ZCOUNT", "ZMSCORE", "ZRANGE", "ZRANGEBYSCORE", "ZRANK",
    "ZREVRANGE", "ZREVRANGEBYSCORE", "ZSCAN", "ZSCORE",
})

# Commands a script may not run (or would run otherwise): a pipeline holding one is fenced with WATCH.
UNSCRIPTABLE = frozenset({
    "BLMOVE", "BLMPOP", "BLPOP", "BRPOP", "BRPOPLPUSH", "BZMPOP", "BZPOPMAX", "BZPOPMIN", "CLIENT",
    "DISCARD", "EVAL", "EVAL_RO", "EVALSHA", "EVALSHA_RO", "EXEC", "FCALL", "FCALL_RO", "FUNCTION",
    "MONITOR", "MULTI", "PSUBSCRIBE", "PSYNC", "SCRIPT", "SSUBSCRIBE", "SUBSCRIBE", "SYNC", "UNWATCH",
    "WAIT", "WAITAOF", "WATCH", "XREAD", "XREADGROUP",
})
STALE = "STALE"  # fenced.lua's error: the places of the fences that changed follow

_held: ContextVar[tuple[Fence, ...]] = ContextVar("slotq_fences", default=())


def new_token() -> str:
    """A fresh attempt's fence token."""
    return secrets.token_hex(8)


def held() -> tuple[Fence, ...]:
    """The fences this thread's writes are held to now (none outside ``holding``)."""
    return _held.get()


def revoke(pipe: Pipeline, job_id: str) -> None:
    """Queue the write that ends every attempt at a job: the next write of any of them is refused."""
    pipe.delete(keys.fence_key(job_id))


@contextmanager
def holding(*fences: Fence) -> Iterator[None]:
    """Fence this thread's writes with these attempts' tokens (replacing any outer ones)."""
    reset = _held.set(fences)
    try:
        yield
    finally:
        _held.reset(reset)


class FencedPipeline(Pipeline):
    """A transaction that writes only if the fences held by this thread are still current."""

    def __init__(self, *args: Any, fences: tuple[Fence, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The check and the writes must be one transaction (redis-py names the flag like its method).
        self.transaction = True  # type: ignore[method-assign, assignment]
        self.fences = fences

    def watch(self, *names: Any) -> bool:  # type: ignore[override]
        """WATCH these keys and the fence keys and check the tokens, in one round trip."""
        if self.explicit_transaction:
            raise RedisError("Cannot issue a WATCH after a MULTI")
        fence_keys = [fence.key for fence in self.fences]
        connection = self.connection or self.connection_pool.get_connection()
        self.connection = connection

        def watch_and_read() -> list[Any]:
            connection.send_packed_command(connection.pack_commands([("WATCH", *names, *fence_keys),
                                                                     ("MGET", *fence_keys)]))
            self.parse_response(connection, "WATCH")
            return list(self.parse_response(connection, "MGET"))

        # Nothing is watched before this succeeds, so a dead pooled connection may be replaced.
        current = connection.retry.call_with_retry(watch_and_read, lambda error: connection.disconnect())
        self.watching = True
        tokens = [value.decode() if isinstance(value, bytes) else value for value in current]
        stale = [fence.job_id for fence, token in zip(self.fences, tokens, strict=True)
                 if token != fence.token]
        if stale:
            self.reset()
            raise StaleAttemptError(f"a newer attempt took over job(s) {', '.join(stale)}")
        return True

    def multi(self) -> None:
        if not self.watching:
            self.watch()
        super().multi()

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        if not self.command_stack:
            return super().execute(raise_on_error)
        if not self.watching and self._scriptable():  # no WATCH of the caller's own
            return self._execute_in_script(raise_on_error)
        own_watch = not self.watching
        if own_watch:
            self.watch()
        try:
            return super().execute(raise_on_error)
        except WatchError:
            if own_watch:  # only the fence was watched: it changed since the check
                raise StaleAttemptError("a newer attempt took over this job") from None
            raise  # the caller's own WATCH: it retries, and its next watch() checks the fence

    def _scriptable(self) -> bool:
        return all(EMPTY_RESPONSE not in options and
                   (_words(args)[0].upper() not in UNSCRIPTABLE or _ends_a_job(args))
                   for args, options in self.command_stack)

    def _execute_in_script(self, raise_on_error: bool) -> list[Any]:
        """Check the tokens and run the commands in one script call (fenced.lua): one round trip
        where WATCH, then MULTI … EXEC, take two; the replies parsed as EXEC's would be."""
        commands, fences = self.command_stack, self.fences
        queued = [_inlined(args) for args, _ in commands]
        words = [word for command in queued for word in (len(command), *command)]
        try:
            replies = self._send_once([fence.key for fence in fences],
                                      [*(fence.token for fence in fences), *words])
        except ResponseError as error:
            places = str(error).split()
            if not places or places[0] != STALE:
                raise
            stale = [fences[int(place) - 1].job_id for place in places[1:]]
            raise StaleAttemptError(f"a newer attempt took over job(s) {', '.join(stale)}") from None
        finally:
            self.reset()
        if raise_on_error:
            self.raise_first_error(commands, replies)
        return [reply if isinstance(reply, Exception) else self._parsed(reply, args, options)
                for reply, (args, options) in zip(replies, commands, strict=True)]

    def _send_once(self, fence_keys: list[str], args: list[Any]) -> Any:
        """fenced.lua's answer, the script sent once: a reply lost to a timeout or a dropped link is
        not followed by the writes sent again, which might then land twice (redis-py's retry would;
        the pool replaces a connection the server closed before lending it)."""
        connection = self.connection_pool.get_connection()
        try:
            try:
                connection.send_command("EVALSHA", scripts.sha("fenced"), len(fence_keys), *fence_keys, *args)
                return connection.read_response()
            except NoScriptError:  # not run: EVAL runs it and caches it
                connection.send_command("EVAL", scripts.source("fenced"), len(fence_keys), *fence_keys, *args)
                return connection.read_response()
        except (RedisConnectionError, RedisTimeoutError):
            connection.disconnect()
            raise
        finally:
            self.connection_pool.release(connection)

    def _parsed(self, reply: Any, args: tuple[Any, ...], options: dict[str, Any]) -> Any:
        callback = _script_callbacks().get(args[0])
        if callback is None:
            return reply
        return callback(reply, **{name: value for name, value in options.items() if name != "keys"})


@cache
def _script_callbacks() -> Any:
    """redis-py's parsers for replies as a script receives them: RESP2's, whatever protocol the
    client speaks (a RESP3 client's parsers expect maps, doubles and pairs where a script has
    flat arrays and strings). A client made for RESP2 (not connected) holds them."""
    return Redis(protocol=2).response_callbacks


def _ends_a_job(args: tuple[Any, ...]) -> bool:
    """Whether a queued command is end.lua's EVALSHA (shared/store/endings.py)."""
    return str(args[0]).upper() == "EVALSHA" and args[1] == scripts.sha("end")


def _inlined(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A queued command as fenced.lua runs it: a job's end by its own word, other commands as they are."""
    if _ends_a_job(args):
        return (scripts.CONSTANTS["END_COMMAND"], *args[2:])
    return _words(args)


def _words(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A queued command as Redis reads it: a name of two words ("CLIENT SETNAME") is two."""
    return (*str(args[0]).split(), *args[1:])


class FencedRedis(Redis):
    """The worker's Redis client: under :func:`holding`, its writes are fenced; otherwise plain."""

    @cached_property
    def unfenced(self) -> Redis:
        """A plain client on the same connections, for a script that checks the fence itself."""
        return Redis(connection_pool=self.connection_pool)

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        fences = _held.get()
        if not fences:
            return super().pipeline(transaction, shard_hint)
        return FencedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint,
                              fences=fences)

    def execute_command(self, *args: Any, **options: Any) -> Any:
        if not _held.get() or str(args[0]).split()[0].upper() in READS:
            return super().execute_command(*args, **options)
        with self.pipeline() as pipe:  # one write alone, fenced like any other
            pipe.execute_command(*args, **options)
            return pipe.execute()[0]


def connect_worker(settings: Settings) -> Redis:
    """The worker's Redis client: blocking pops allowed, and writes fenced by attempt."""
    return connection.connect(settings, blocking=True, redis_class=FencedRedis)
