"""Connecting to Redis (one server, or the master that Sentinel names) and RQ's queue object."""

from __future__ import annotations

from typing import Any

from redis import BlockingConnectionPool, Redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel
from rq import Queue
from rq.serializers import JSONSerializer

from shared.contract.settings import Settings


def text(value: bytes | str) -> str:
    """A Redis reply as text (the clients here do not decode replies: images stay bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def connect(settings: Settings, *, blocking: bool = False, redis_class: type[Redis] = Redis) -> Redis:
    """A Redis client that fails fast; ``blocking`` allows for a worker's blocking pop, and
    ``redis_class`` names the client class (the worker's fences its writes).

    With SLOTQ_REDIS_SENTINELS the client asks the sentinels for the master before each new
    connection, so after a failover it reaches the new master by itself (redis-py's
    SentinelConnectionPool); SLOTQ_REDIS_URL then gives only the db, user, password and TLS.
    """
    timeout = settings.redis_timeout_s
    options: dict[str, Any] = {
        "socket_connect_timeout": timeout,
        "socket_timeout": timeout + 10 if blocking else timeout,
        "health_check_interval": 30,
        # One immediate retry: a pooled connection that died with a Redis restart (or with the
        # old master) is replaced transparently, while a Redis that is really down still answers
        # within two timeouts.
        "retry": Retry(NoBackoff(), 1),
    }
    if not settings.redis_sentinels:
        # A pool that makes a caller wait for a free connection (up to the timeout) rather than
        # fail: under gevent hundreds of requests and event streams may each want one at once.
        pool = BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=settings.redis_max_connections, timeout=timeout, **options)
        # The client owns its pool, as master_for's below does: closing it closes the pool's sockets
        # (a client made on a pool it was given leaves them open until the collector finds them).
        return redis_class.from_pool(pool)
    # The URL's db, user, password and TLS options apply to the master; its host and port do not.
    url = {key: value for key, value in parse_url(settings.redis_url).items()
           if key not in ("host", "port", "connection_class")}
    sentinel = Sentinel(
        settings.sentinel_addresses,
        # No retries on a sentinel: discovery moves on to the next one, and redis-py's default
        # (three, with backoff) would hold a request for seconds behind one dead sentinel.
        sentinel_kwargs={"socket_connect_timeout": timeout, "socket_timeout": timeout,
                         "password": settings.redis_sentinel_password, "retry": Retry(NoBackoff(), 0)})
    # redis-py has no blocking pool for Sentinel: past max_connections a command fails at once.
    return sentinel.master_for(settings.redis_master, redis_class=redis_class, **options, **url,
                               ssl=settings.redis_url.startswith("rediss://"),
                               max_connections=settings.redis_max_connections)


def job_queue(connection: Redis, settings: Settings) -> Queue:
    """The RQ queue whose name jobs carry as their origin (its registries hold running and ended
    jobs; the waiting ones sit in the line's lists, shared/store/waiting.py), JSON-serialised so
    that untrusted data never reaches pickle."""
    return Queue(settings.queue_name, connection=connection, serializer=JSONSerializer,
                 default_timeout=settings.job_timeout_s)
