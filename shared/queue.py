"""The queue: atomic admission (limits, idempotency, deadlines), lookup and cancellation.

Both processes reach Redis through here and ``shared/records.py``; key names live in
``shared/keys.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from redis import Redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry
from redis.sentinel import Sentinel
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.job import JobStatus as RQStatus
from rq.serializers import JSONSerializer

from shared import keys, logs, waiting, webhooks
from shared.errors import (
    AlreadyFinishedError,
    IdempotencyConflictError,
    InvalidRequestError,
    JobNotFoundError,
    NotReplicatedError,
    QueueFullError,
    RateLimitedError,
    ResultExpiredError,
    TenantQueueFullError,
)
from shared.estimates import ESTIMATE_LUA, STARTS_IN_LUA
from shared.jobs import JobRequest
from shared.records import end_job, job_status
from shared.settings import Settings
from shared.tenants import Tenant, job_cost
from shared.waiting import LINE_LUA
from shared.webhooks import COMPLETED_LUA

log = logging.getLogger(__name__)
IDEMPOTENCY_TTL_S = 24 * 3600
RQ_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"

# Waiting jobs whose deadline has passed leave the line and end expired. Runs at the start of
# every admission, so an expired job never holds a place that a new one asks for. Each expired id
# is published on ``channel`` (shared/events.py), when one is given, counted in ``ended`` and gets
# its `completed` webhook in ``outbox`` when it asked for one.
EXPIRE_DUE_LUA = COMPLETED_LUA + """
local function expire_due(line, deadlines_key, job_prefix, ended_at, ttl, channel, outbox, ended)
  local now = redis_now()
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', deadlines_key, '-inf', now)) do
    redis.call('ZREM', deadlines_key, id)
    local key = job_prefix .. id
    if line_remove(line, key, id) then
      local meta = cjson.decode(redis.call('HGET', key, 'meta') or '{}')
      meta['expired'] = true
      redis.call('HSET', key, 'status', 'canceled', 'ended_at', ended_at, 'meta', cjson.encode(meta))
      redis.call('EXPIRE', key, ttl)
      if channel then redis.call('PUBLISH', channel, id) end
      redis.call('HINCRBY', ended, 'expired', 1)
      webhook_completed(outbox, key, id, now)
    end
  end
  return now
end
"""

# Admission in one script call: every check first, and only an admitted job writes anything, so
# a refusal costs one round trip and no writes however hard the service is flooded. Redis runs
# scripts one at a time, so the limits hold exactly however many API processes admit at once.
# KEYS: job, idempotency (or job), deadlines, issued, bucket, model, running.
# ARGV[1]: the parameters as JSON; ARGV[2..]: the RQ job's fields, as Job.save would write them.
ADMIT_SCRIPT = LINE_LUA + ESTIMATE_LUA + STARTS_IN_LUA + EXPIRE_DUE_LUA + """
local p = cjson.decode(ARGV[1])
local line, prefix = p.line, p.job_prefix
local now = expire_due(line, KEYS[3], prefix, p.ended_at, p.record_ttl, p.channel, p.outbox, p.ended)
local function frees_in(index) return num(starts_in(line, prefix, KEYS[6], KEYS[7], now, index)) end
if p.digest then
  local prior = redis.call('GET', KEYS[2])
  if prior then return {-2, prior} end
end
-- The tenant's token bucket, on Redis's clock: refilled at `rate` units a second up to `burst`.
local tokens = 0
if p.rate then
  local state = redis.call('HMGET', KEYS[5], 'tokens', 'at')
  local level, at = tonumber(state[1]) or p.burst, tonumber(state[2]) or now
  tokens = math.min(p.burst, level + math.max(0, now - at) * p.rate)
  if tokens < p.cost then return {-3, num((p.cost - tokens) / p.rate)} end
end
local total = line_total(line)
if p.max_queued and line_tenant_count(line, p.tenant) >= p.max_queued then
  -- A place frees for this tenant when the first of its waiting jobs starts.
  for index, id in ipairs(line_head(line, total)) do
    if redis.call('HGET', prefix .. id, 'tenant') == p.tenant then return {-4, frees_in(index - 1)} end
  end
end
-- The class's share of the line: `limit` places for normal, fewer for low, more for high.
if total >= p.limit then return {-1, frees_in(total - p.limit)} end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
line_push(line, KEYS[1], p.id, p.priority, p.tenant, p.cost)
if p.rate then
  redis.call('HSET', KEYS[5], 'tokens', num(tokens - p.cost), 'at', num(now))
  redis.call('EXPIRE', KEYS[5], math.ceil(p.burst / p.rate) + 60)
end
if p.digest then redis.call('SET', KEYS[2], p.digest .. ' ' .. p.id, 'EX', p.idempotency_ttl) end
redis.call('SET', KEYS[4], p.tenant, 'EX', p.issued_ttl)
local deadline = false
if p.deadline_s then
  deadline = now + p.deadline_s
  redis.call('ZADD', KEYS[3], deadline, p.id)
  local meta = cjson.decode(redis.call('HGET', KEYS[1], 'meta') or '{}')
  meta['deadline_at'] = deadline
  redis.call('HSET', KEYS[1], 'meta', cjson.encode(meta))
end
local position = line_position(line, p.priority, p.id)
local own = job_seconds(KEYS[6], p.cost)
local start = own and starts_in(line, prefix, KEYS[6], KEYS[7], now, position)
return {position, own and num(start) or false, own and num(start + own) or false, deadline and num(deadline)}
"""

EXPIRE_SCRIPT = LINE_LUA + ESTIMATE_LUA + EXPIRE_DUE_LUA + """
return num(expire_due(KEYS[1], KEYS[2], ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5], ARGV[6]))
"""


@dataclass(frozen=True)
class Admission:
    """The outcome of a submit: the job, its place, and whether an earlier submit made it."""

    job: Job
    position: int | None
    eta: tuple[float, float] | None = None
    replayed: bool = False


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
        return redis_class.from_url(settings.redis_url, **options)
    # The URL's db, user, password and TLS options apply to the master; its host and port do not.
    url = {key: value for key, value in parse_url(settings.redis_url).items()
           if key not in ("host", "port", "connection_class")}
    sentinel = Sentinel(
        settings.sentinel_addresses,
        # No retries on a sentinel: discovery moves on to the next one, and redis-py's default
        # (three, with backoff) would hold a request for seconds behind one dead sentinel.
        sentinel_kwargs={"socket_connect_timeout": timeout, "socket_timeout": timeout,
                         "password": settings.redis_sentinel_password, "retry": Retry(NoBackoff(), 0)})
    return sentinel.master_for(settings.redis_master, redis_class=redis_class, **options, **url,
                               ssl=settings.redis_url.startswith("rediss://"))


def job_queue(connection: Redis, settings: Settings) -> Queue:
    """The one RQ queue, JSON-serialised so that untrusted data never reaches pickle."""
    return Queue(settings.queue_name, connection=connection, serializer=JSONSerializer,
                 default_timeout=settings.job_timeout_s)


def request_digest(request: JobRequest) -> str:
    """A stable hash of a request as the client sent it (before a seed is drawn)."""
    canonical = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def enqueue_job(queue: Queue, settings: Settings, request: JobRequest,
                idempotency_key: str | None = None, tenant: Tenant | None = None,
                request_id: str | None = None) -> Admission:
    """Admit one job atomically, replay an idempotent retry, or raise a typed refusal.

    With SLOTQ_MIN_REPLICAS_ACK set, either answer stands only once that many replicas have the job.

    ``request_id`` (the HTTP request's X-Request-ID) is kept with the job, for its log lines.
    """
    webhooks.check_target(settings, request)
    digest = request_digest(request)
    if tenant is not None:
        request = tenant.prioritised(request)
    cost = job_cost(request.width, request.height, request.steps, request.num_images)
    if tenant and tenant.burst is not None and cost > tenant.burst:
        raise InvalidRequestError(details=[{"loc": [], "msg": f"the job costs {cost:g} units, more than "
                                            f"this key's burst of {tenant.burst:g}"}])
    job = queue.create_job(
        keys.TASK,
        kwargs={"request": request.with_seed().model_dump(mode="json")},
        meta={key: value for key, value in (("tenant", tenant and tenant.name), ("request_id", request_id))
              if value},
        timeout=settings.job_timeout_s,
        result_ttl=settings.record_ttl_s,
        failure_ttl=settings.failure_ttl_s,
    )
    job.enqueued_at = datetime.now(UTC)
    name = tenant.name if tenant else ""
    idem = keys.idempotency_key(queue.name, _hashed(f"{name} {idempotency_key}")) if idempotency_key else ""
    limits = ({"rate": tenant.rate, "burst": tenant.burst, "max_queued": tenant.max_queued}
              if tenant else {})
    params = {
        "id": job.id, "line": keys.line_key(queue.name), "job_prefix": Job.redis_job_namespace_prefix,
        "priority": request.priority, "limit": settings.waiting_limit(request.priority),
        "tenant": name, "cost": cost, "digest": digest if idem else None,
        "idempotency_ttl": IDEMPOTENCY_TTL_S, "deadline_s": request.deadline_s, "ended_at": _rq_now(),
        "record_ttl": settings.record_ttl_s, "issued_ttl": settings.issued_ttl_s,
        "channel": keys.events_channel(queue.name), "outbox": keys.webhooks_key(queue.name),
        "ended": keys.ended_key(queue.name), **limits,
    }
    # RQ's fields, which jobs this one may share a GPU execution with (see worker/batching.py), and
    # whether its expiry in the line sends a webhook (the Lua cannot read the compressed request).
    fields = [item for pair in job.to_dict().items() for item in pair] + ["batch", request.batch_key]
    if webhooks.wants(job.kwargs["request"], "completed"):
        fields += ["webhook", "1"]
    answer = queue.connection.register_script(ADMIT_SCRIPT)(
        keys=[job.key, idem or job.key, keys.deadlines_key(queue.name), keys.issued_key(job.id),
              keys.bucket_key(queue.name, name), keys.model_key(queue.name), keys.running_key(queue.name)],
        # cjson reads JSON null as a truthy value: leave unset parameters out instead.
        args=[json.dumps({key: value for key, value in params.items() if value is not None}), *fields])
    admission = _admission(queue, job, answer, digest, tenant)
    if settings.min_replicas_ack:
        _await_replicas(queue.connection, settings, admission.job.id, name)
    log.info("%s job %s: priority %s, %dx%d, %d steps, prompt %s",
             "replayed" if admission.replayed else "admitted", admission.job.id, request.priority,
             request.width, request.height, request.steps, logs.prompt_for_log(settings, request.prompt))
    return admission


def _admission(queue: Queue, job: Job, answer: list[Any], digest: str, tenant: Tenant | None) -> Admission:
    outcome, detail = answer[0], answer[1] if len(answer) > 1 else None
    refusals = {-1: QueueFullError, -3: RateLimitedError, -4: TenantQueueFullError}
    if outcome in refusals:
        raise refusals[outcome](retry_after=_whole_seconds(detail))
    if outcome == -2:
        prior_digest, prior_id = detail.decode().split(" ")
        if prior_digest != digest:
            raise IdempotencyConflictError()
        return Admission(fetch_job(queue, prior_id, tenant), None, replayed=True)
    start, finish, deadline = (answer + [None] * 4)[1:4]
    if deadline is not None:
        job.meta["deadline_at"] = float(deadline)
    eta = (float(start), float(finish)) if start is not None else None
    return Admission(job, int(outcome), eta)


def _await_replicas(connection: Redis, settings: Settings, job_id: str, tenant: str) -> None:
    """Return once SLOTQ_MIN_REPLICAS_ACK replicas hold the job, or raise ``NotReplicatedError``.

    WAIT covers only the writes of the connection it runs on. The pool may lend another one than
    the script's, or a fresh one after a reconnect (WAIT would then have nothing to wait for), and
    a replay writes nothing at all. So a marker write goes first, on the connection that WAITs:
    the job's issued key, rewritten as it is. Replication is one ordered stream, so a replica
    that has the marker has the job; and a master without the key does not have the job.
    """
    with connection.pipeline(transaction=False) as pipe:
        # XX: no key where the job is missing (KEEPTTL would make one that never expires);
        # GET: the old value, None when missing. A pipeline retried after a reconnect sends both
        # again, on one connection.
        pipe.set(keys.issued_key(job_id), tenant, xx=True, keepttl=True, get=True)
        pipe.execute_command("WAIT", settings.min_replicas_ack, settings.replicas_ack_timeout_ms)
        present, acked = pipe.execute()
    if present is None or acked < settings.min_replicas_ack:
        log.warning("job %s: %s", job_id, "not on the master" if present is None else
                    f"{acked} of {settings.min_replicas_ack} replicas acknowledged it in time")
        raise NotReplicatedError(retry_after=1)


def _whole_seconds(seconds: bytes | None) -> int:
    return max(1, math.ceil(float(seconds or 1)))


def _hashed(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _rq_now() -> str:
    return datetime.now(UTC).strftime(RQ_TIME_FORMAT)


def expire_due(queue: Queue, settings: Settings) -> float:
    """End the waiting jobs whose deadline has passed; returns Redis's clock."""
    script = queue.connection.register_script(EXPIRE_SCRIPT)
    now = script(keys=[keys.line_key(queue.name), keys.deadlines_key(queue.name)],
                 args=[Job.redis_job_namespace_prefix, _rq_now(), settings.record_ttl_s,
                       keys.events_channel(queue.name), keys.webhooks_key(queue.name),
                       keys.ended_key(queue.name)])
    return float(now)


def fetch_job(queue: Queue, job_id: str, tenant: Tenant | None = None) -> Job:
    """The job with this id on our queue and of this tenant, or ``JobNotFoundError``."""
    if not keys.JOB_ID_PATTERN.fullmatch(job_id):
        raise JobNotFoundError()
    try:
        job = Job.fetch(job_id, connection=queue.connection, serializer=queue.serializer)
    except NoSuchJobError:
        issued_to = queue.connection.get(keys.issued_key(job_id))
        if issued_to is not None and (tenant is None or issued_to.decode() == tenant.name):
            raise ResultExpiredError("The job's record has expired.") from None
        raise JobNotFoundError() from None
    if job.origin != queue.name or job.func_name != keys.TASK:
        raise JobNotFoundError()
    if tenant is not None and job.meta.get("tenant") != tenant.name:
        raise JobNotFoundError()  # another tenant's job looks exactly like an unknown one
    return job


def cancel_job(queue: Queue, settings: Settings, job: Job) -> bool:
    """Cancel a job; True when it ended now, False when its worker will stop it at the next step."""
    if job_status(job).is_terminal:
        raise AlreadyFinishedError()
    connection = queue.connection
    # The flag first: if a worker takes the job after this point, it sees the flag at start.
    connection.set(keys.cancel_key(job.id), 1, ex=settings.record_ttl_s)
    # Removal decides ownership: either we take the id out of the line or a worker already has it.
    if not waiting.remove(connection, queue.name, job.id):
        return False
    with connection.pipeline() as pipe:
        end_job(job, queue, settings, pipe, RQStatus.CANCELED)
        pipe.zrem(keys.deadlines_key(queue.name), job.id)
        pipe.execute()
    return True


def waiting_counts(queue: Queue, settings: Settings) -> dict[str, int]:
    """Jobs waiting now in each priority class, after the expired ones have left."""
    expire_due(queue, settings)
    return waiting.counts(queue.connection, queue.name)
