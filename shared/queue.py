"""The queue: atomic admission (cap, idempotency, deadlines), lookup and cancellation.

Both processes reach Redis through here and ``shared/records.py``; key names live in
``shared/keys.py``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime

from redis import Redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from rq import Queue
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.job import JobStatus as RQStatus
from rq.serializers import JSONSerializer

from shared import keys
from shared.errors import (
    AlreadyFinishedError,
    IdempotencyConflictError,
    InvalidRequestError,
    JobNotFoundError,
    QueueFullError,
    RateLimitedError,
    ResultExpiredError,
    TenantQueueFullError,
)
from shared.estimates import ESTIMATE_LUA, PLACE_FREES_LUA
from shared.jobs import JobRequest
from shared.records import end_job, job_status
from shared.settings import Settings
from shared.tenants import Tenant, job_cost

IDEMPOTENCY_TTL_S = 24 * 3600
RQ_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"

# Waiting jobs whose deadline has passed leave the list and end expired. Runs at the start of
# every admission, so an expired job never holds a place that a new one asks for.
EXPIRE_DUE_LUA = """
local function expire_due(queue_key, deadlines_key, job_prefix, ended_at, ttl)
  local clock = redis.call('TIME')
  local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', deadlines_key, '-inf', now)) do
    redis.call('ZREM', deadlines_key, id)
    if redis.call('LREM', queue_key, 1, id) > 0 then
      local key = job_prefix .. id
      local meta = cjson.decode(redis.call('HGET', key, 'meta') or '{}')
      meta['expired'] = true
      redis.call('HSET', key, 'status', 'canceled', 'ended_at', ended_at, 'meta', cjson.encode(meta))
      redis.call('EXPIRE', key, ttl)
    end
  end
  return now
end
"""

# RQ's enqueue writes the job and pushes its id inside our MULTI; this script runs last in the
# same transaction and undoes both when the key was used before or the push went over the cap.
# The transaction is atomic, so no client ever sees more than `capacity` waiting ids, however
# many API processes admit at once, and concurrent retries with one key admit one job.
ADMIT_SCRIPT = EXPIRE_DUE_LUA + ESTIMATE_LUA + PLACE_FREES_LUA + """
local now = expire_due(KEYS[1], KEYS[5], ARGV[6], ARGV[7], tonumber(ARGV[8]))
local function undo() redis.call('LREM', KEYS[1], -1, ARGV[2]); redis.call('DEL', KEYS[2]) end
if ARGV[3] ~= '' then
  local prior = redis.call('GET', KEYS[4])
  if prior then undo(); return {-2, prior} end
end
-- The tenant's token bucket, on Redis's clock: refilled at `rate` units a second up to `burst`.
local rate, burst, cost, tokens = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13]), 0
if rate then
  local state = redis.call('HMGET', KEYS[7], 'tokens', 'at')
  local level, at = tonumber(state[1]) or burst, tonumber(state[2]) or now
  tokens = math.min(burst, level + math.max(0, now - at) * rate)
  if tokens < cost then undo(); return {-3, tostring((cost - tokens) / rate)} end
end
-- The tenant's own cap: its waiting jobs are counted from the list itself, so the count can
-- never drift from what waits (O(waiting jobs), bounded by the capacity).
local max_queued = tonumber(ARGV[14])
if max_queued then
  local mine = 0
  for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
    if redis.call('HGET', ARGV[6] .. id, 'tenant') == ARGV[10] then mine = mine + 1 end
  end
  if mine >= max_queued then
    undo()
    return {-4, tostring(place_frees_in(KEYS[1], KEYS[3], KEYS[8], ARGV[6], now))}
  end
end
local length = redis.call('LLEN', KEYS[1])
if length > tonumber(ARGV[1]) then
  undo()
  return {-1, tostring(place_frees_in(KEYS[1], KEYS[3], KEYS[8], ARGV[6], now))}
end
redis.call('HSET', KEYS[2], 'cost', ARGV[13], 'tenant', ARGV[10])
if rate then
  redis.call('HSET', KEYS[7], 'tokens', tostring(tokens - cost), 'at', tostring(now))
  redis.call('EXPIRE', KEYS[7], math.ceil(burst / rate) + 60)
end
if ARGV[3] ~= '' then redis.call('SET', KEYS[4], ARGV[3] .. ' ' .. ARGV[2], 'EX', ARGV[4]) end
redis.call('SET', KEYS[6], ARGV[10], 'EX', ARGV[9])
if ARGV[5] ~= '' then
  local deadline = now + tonumber(ARGV[5])
  redis.call('ZADD', KEYS[5], deadline, ARGV[2])
  local meta = cjson.decode(redis.call('HGET', KEYS[2], 'meta') or '{}')
  meta['deadline_at'] = deadline
  redis.call('HSET', KEYS[2], 'meta', cjson.encode(meta))
end
return {length - 1, false}
"""

EXPIRE_SCRIPT = EXPIRE_DUE_LUA + """
return tostring(expire_due(KEYS[1], KEYS[2], ARGV[1], ARGV[2], tonumber(ARGV[3])))
"""


@dataclass(frozen=True)
class Admission:
    """The outcome of a submit: the job, its place, and whether an earlier submit made it."""

    job: Job
    position: int | None
    replayed: bool = False


def connect(settings: Settings, *, blocking: bool = False) -> Redis:
    """A Redis client that fails fast; ``blocking`` allows for a worker's blocking pop."""
    timeout = settings.redis_timeout_s
    return Redis.from_url(
        settings.redis_url,
        socket_connect_timeout=timeout,
        socket_timeout=timeout + 10 if blocking else timeout,
        health_check_interval=30,
        # One immediate retry: a pooled connection that died with a Redis restart is replaced
        # transparently, while a Redis that is really down still answers within two timeouts.
        retry=Retry(NoBackoff(), 1),
    )


def job_queue(connection: Redis, settings: Settings) -> Queue:
    """The one RQ queue, JSON-serialised so that untrusted data never reaches pickle."""
    return Queue(settings.queue_name, connection=connection, serializer=JSONSerializer,
                 default_timeout=settings.job_timeout_s)


def request_digest(request: JobRequest) -> str:
    """A stable hash of a request as the client sent it (before a seed is drawn)."""
    canonical = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def enqueue_job(queue: Queue, settings: Settings, request: JobRequest,
                idempotency_key: str | None = None, tenant: Tenant | None = None) -> Admission:
    """Admit one job atomically, replay an idempotent retry, or raise a typed refusal."""
    digest = request_digest(request)
    cost = job_cost(request.width, request.height, request.steps, request.num_images)
    if tenant and tenant.burst is not None and cost > tenant.burst:
        raise InvalidRequestError(details=[{"loc": [], "msg": f"the job costs {cost:g} units, more than "
                                            f"this key's burst of {tenant.burst:g}"}])
    job = queue.create_job(
        keys.TASK,
        kwargs={"request": request.with_seed().model_dump(mode="json")},
        meta={"tenant": tenant.name} if tenant else {},
        timeout=settings.job_timeout_s,
        result_ttl=settings.record_ttl_s,
        failure_ttl=settings.failure_ttl_s,
    )
    name = tenant.name if tenant else ""
    idem = keys.idempotency_key(queue.name, _hashed(f"{name} {idempotency_key}")) if idempotency_key else ""
    admit = queue.connection.register_script(ADMIT_SCRIPT)
    with queue.connection.pipeline(transaction=True) as pipe:
        queue.enqueue_job(job, pipeline=pipe)
        admit(keys=[queue.key, job.key, keys.model_key(queue.name), idem or job.key,
                    keys.deadlines_key(queue.name), keys.issued_key(job.id),
                    keys.bucket_key(queue.name, name), keys.running_key(queue.name)],
              args=[settings.queue_capacity, job.id, digest if idem else "", IDEMPOTENCY_TTL_S,
                    request.deadline_s or "", Job.redis_job_namespace_prefix, _rq_now(),
                    settings.record_ttl_s, settings.issued_ttl_s, name,
                    tenant.rate if tenant and tenant.rate else "",
                    tenant.burst if tenant and tenant.rate else "", cost,
                    tenant.max_queued if tenant and tenant.max_queued else ""],
              client=pipe)
        position, detail = pipe.execute()[-1]
    return _admission(queue, job, position, detail, digest, tenant)


def _admission(queue: Queue, job: Job, position: int, detail: bytes | None, digest: str,
               tenant: Tenant | None) -> Admission:
    if position == -1:
        raise QueueFullError(retry_after=_whole_seconds(detail))
    if position == -3:
        raise RateLimitedError(retry_after=_whole_seconds(detail))
    if position == -4:
        raise TenantQueueFullError(retry_after=_whole_seconds(detail))
    if position == -2:
        assert detail is not None
        prior_digest, prior_id = detail.decode().split(" ")
        if prior_digest != digest:
            raise IdempotencyConflictError()
        return Admission(fetch_job(queue, prior_id, tenant), None, replayed=True)
    return Admission(fetch_job(queue, job.id, tenant), position)


def _whole_seconds(seconds: bytes | None) -> int:
    return max(1, math.ceil(float(seconds or 1)))


def _hashed(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def _rq_now() -> str:
    return datetime.now(UTC).strftime(RQ_TIME_FORMAT)


def expire_due(queue: Queue, settings: Settings) -> float:
    """End the waiting jobs whose deadline has passed; returns Redis's clock."""
    script = queue.connection.register_script(EXPIRE_SCRIPT)
    now = script(keys=[queue.key, keys.deadlines_key(queue.name)],
                 args=[Job.redis_job_namespace_prefix, _rq_now(), settings.record_ttl_s])
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
    # The flag first: if a worker pops the job after this point, it sees the flag at start.
    connection.set(keys.cancel_key(job.id), 1, ex=settings.record_ttl_s)
    # LREM decides ownership: either we take the id out of the list or a worker already has it.
    if not connection.lrem(queue.key, 0, job.id):
        return False
    with connection.pipeline() as pipe:
        end_job(job, queue, settings, pipe, RQStatus.CANCELED)
        pipe.zrem(keys.deadlines_key(queue.name), job.id)
        pipe.execute()
    return True


def waiting_count(queue: Queue, settings: Settings) -> int:
    """Jobs waiting now, after the expired ones have left."""
    expire_due(queue, settings)
    return queue.count


