"""The waiting line: three priority classes, each shared fairly between tenants.

Waiting job ids live in one sorted set per class (``high``, ``normal``, ``low``); a worker always
takes from the highest class that has work. Inside a class the score is the job's start tag in
start-time fair queueing, weighted by cost: a tenant's next job starts where its previous one
finished, but never before the class's virtual time (the tag of the job taken last). Tenants thus
take turns by GPU work, and a tenant that arrives behind another's 500-job burst waits for at most
one job of each other tenant.

Every change to the line is a Lua function below, run inside the scripts of admission,
expiry, cancellation, claim and requeue, so the sets, the per-tenant counts and the tags never
disagree. A claim pops the next id and registers it in the worker's claims list in one script:
no gap between the pop and the registration, as in v1. The scripts derive the line's keys from
one prefix, which suits a single Redis (with replicas or Sentinel) but not Redis Cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis import Redis
from redis.client import Pipeline
from rq.job import Job

from shared import keys
from shared.jobs import PRIORITIES

DOORBELL_TOKENS = 16  # enough to wake every idle worker of a host; more would only spin them

LINE_LUA = """
local CLASSES = {'high', 'normal', 'low'}
local function num(x) return string.format('%.17g', x) end
local function line_total(line)
  local total = 0
  for _, class in ipairs(CLASSES) do total = total + redis.call('ZCARD', line .. ':' .. class) end
  return total
end
local function line_tenant_count(line, tenant)
  local total = 0
  for _, class in ipairs(CLASSES) do
    total = total + (tonumber(redis.call('HGET', line .. ':counts', class .. ' ' .. tenant)) or 0)
  end
  return total
end
local function line_insert(line, id, class, tenant, tag)
  redis.call('ZADD', line .. ':' .. class, tag, id)
  redis.call('HINCRBY', line .. ':counts', class .. ' ' .. tenant, 1)
  redis.call('RPUSH', line .. ':doorbell', 1)
  redis.call('LTRIM', line .. ':doorbell', -DOORBELL_TOKENS, -1)
end
-- A new job: its start tag is the later of the class's virtual time and its tenant's last finish.
local function line_push(line, job_key, id, class, tenant, cost)
  local field = class .. ' ' .. tenant
  local vtime = tonumber(redis.call('HGET', line .. ':vtime', class)) or 0
  local tag = math.max(vtime, tonumber(redis.call('HGET', line .. ':finish', field)) or 0)
  redis.call('HSET', line .. ':finish', field, num(tag + cost))
  redis.call('HSET', job_key, 'priority', class, 'tenant', tenant, 'cost', num(cost), 'tag', num(tag))
  line_insert(line, id, class, tenant, tag)
end
local function line_uncount(line, class, tenant)
  local field = class .. ' ' .. tenant
  if redis.call('HINCRBY', line .. ':counts', field, -1) <= 0 then
    redis.call('HDEL', line .. ':counts', field)
    return true
  end
  return false
end
-- Out of the line without running (canceled, expired); false when it was not waiting.
local function line_remove(line, job_key, id)
  local f = redis.call('HMGET', job_key, 'priority', 'tenant')
  local class, tenant = f[1] or 'normal', f[2] or ''
  if redis.call('ZREM', line .. ':' .. class, id) == 0 then return false end
  -- A tenant that withdrew all it had waiting owes no turn for the work that never ran.
  if line_uncount(line, class, tenant) then redis.call('HDEL', line .. ':finish', class .. ' ' .. tenant) end
  return true
end
-- Back in the line after an interrupted or lost run, with its own tag: first in its class.
local function line_requeue(line, job_key, id)
  local f = redis.call('HMGET', job_key, 'priority', 'tenant', 'tag')
  local class = f[1] or 'normal'
  local tag = tonumber(f[3]) or tonumber(redis.call('HGET', line .. ':vtime', class)) or 0
  line_insert(line, id, class, f[2] or '', tag)
end
-- A job leaves the line for a worker: the class's virtual time moves up to its tag.
local function line_taken(line, job_prefix, class, id, tag)
  local vtime = tonumber(redis.call('HGET', line .. ':vtime', class)) or 0
  redis.call('HSET', line .. ':vtime', class, num(math.max(vtime, tonumber(tag))))
  line_uncount(line, class, redis.call('HGET', job_prefix .. id, 'tenant') or '')
end
local function line_pop(line, job_prefix)
  for _, class in ipairs(CLASSES) do
    local popped = redis.call('ZPOPMIN', line .. ':' .. class)
    if popped[1] then
      line_taken(line, job_prefix, class, popped[1], popped[2])
      return popped[1]
    end
  end
  redis.call('DEL', line .. ':doorbell')
  return false
end
-- How many jobs a worker takes before this one; nil when it is not waiting.
local function line_position(line, class, id)
  local rank = redis.call('ZRANK', line .. ':' .. class, id)
  if not rank then return nil end
  for _, other in ipairs(CLASSES) do
    if other == class then return rank end
    rank = rank + redis.call('ZCARD', line .. ':' .. other)
  end
end
-- The first `count` ids in the order workers take them.
local function line_head(line, count)
  local ids = {}
  for _, class in ipairs(CLASSES) do
    if #ids >= count then break end
    for _, id in ipairs(redis.call('ZRANGE', line .. ':' .. class, 0, count - #ids - 1)) do
      table.insert(ids, id)
    end
  end
  return ids
end
""".replace("DOORBELL_TOKENS", str(DOORBELL_TOKENS))

# The claim answers with the job's record too, so starting a job costs no extra round trip.
CLAIM_SCRIPT = LINE_LUA + """
local id = line_pop(KEYS[1], ARGV[1])
if not id then return false end
redis.call('RPUSH', KEYS[2], id)
local clock = redis.call('TIME')
return {id, redis.call('HGETALL', ARGV[1] .. id), clock[1] .. '.' .. string.format('%06d', clock[2])}
"""

# More jobs for a batch: up to ARGV[4] jobs of class ARGV[2] whose batch key is ARGV[3], from the
# first ARGV[5] of that class, each registered in the worker's claims as a claim is.
CLAIM_COMPATIBLE_SCRIPT = LINE_LUA + """
local line, prefix, class = KEYS[1], ARGV[1], ARGV[2]
local wanted, taken = tonumber(ARGV[4]), {}
local window = redis.call('ZRANGE', line .. ':' .. class, 0, tonumber(ARGV[5]) - 1, 'WITHSCORES')
for i = 1, #window, 2 do
  if #taken >= wanted then break end
  local id = window[i]
  if redis.call('HGET', prefix .. id, 'batch') == ARGV[3] then
    redis.call('ZREM', line .. ':' .. class, id)
    line_taken(line, prefix, class, id, window[i + 1])
    redis.call('RPUSH', KEYS[2], id)
    table.insert(taken, {id, redis.call('HGETALL', prefix .. id)})
  end
end
return taken
"""

REQUEUE_SCRIPT = LINE_LUA + "line_requeue(KEYS[1], KEYS[2], ARGV[1])"

REMOVE_SCRIPT = LINE_LUA + "return line_remove(KEYS[1], KEYS[2], ARGV[1]) and 1 or 0"

COUNTS_SCRIPT = LINE_LUA + """
local counts = {}
for _, class in ipairs(CLASSES) do table.insert(counts, redis.call('ZCARD', KEYS[1] .. ':' .. class)) end
return counts
"""

POSITION_SCRIPT = LINE_LUA + """
return line_position(KEYS[1], redis.call('HGET', KEYS[2], 'priority') or 'normal', ARGV[1])
"""


@dataclass(frozen=True)
class Claimed:
    """A job id a worker has just claimed, with the job's record as it stood (empty: none) and
    Redis's clock at the claim."""

    job_id: str
    record: dict[bytes, bytes]
    at: float


def claim(connection: Redis, queue_name: str, claims_key: str) -> Claimed | None:
    """Move the next job id into a worker's claims list, atomically; None when none waits."""
    script = connection.register_script(CLAIM_SCRIPT)
    claimed = script(keys=[keys.line_key(queue_name), claims_key], args=[Job.redis_job_namespace_prefix])
    if not claimed:
        return None
    job_id, flat, at = claimed
    return Claimed(job_id.decode(), dict(zip(flat[::2], flat[1::2], strict=True)), float(at))


def claim_compatible(connection: Redis, queue_name: str, claims_key: str, like: Claimed, count: int,
                     window: int) -> list[Claimed]:
    """Claim up to ``count`` more jobs that may share a batch with ``like``: of its class and batch
    key, among the first ``window`` of that class (a bounded step out of line)."""
    priority, batch = like.record.get(b"priority", b"normal"), like.record.get(b"batch", b"")
    script = connection.register_script(CLAIM_COMPATIBLE_SCRIPT)
    taken = script(keys=[keys.line_key(queue_name), claims_key],
                   args=[Job.redis_job_namespace_prefix, priority, batch, count, window])
    return [Claimed(job_id.decode(), dict(zip(flat[::2], flat[1::2], strict=True)), like.at)
            for job_id, flat in taken]


def wait_for_work(connection: Redis, queue_name: str, timeout: float) -> None:
    """Block until a job may be waiting (each admission rings a doorbell) or the timeout passes."""
    connection.blpop([f"{keys.line_key(queue_name)}:doorbell"], timeout=timeout)


def requeue(client: Redis | Pipeline, queue_name: str, job_id: str) -> None:
    """Put a job back at the head of its class (in a pipeline: when it executes)."""
    script = client.register_script(REQUEUE_SCRIPT)  # a pipeline queues the call, loading it first
    script(keys=[keys.line_key(queue_name), Job.key_for(job_id)], args=[job_id])


def remove(connection: Redis, queue_name: str, job_id: str) -> bool:
    """Take a waiting job out of the line; False when it was not waiting (a worker has it)."""
    script = connection.register_script(REMOVE_SCRIPT)
    return bool(script(keys=[keys.line_key(queue_name), Job.key_for(job_id)], args=[job_id]))


def counts(connection: Redis, queue_name: str) -> dict[str, int]:
    """How many jobs wait in each class."""
    answer = connection.register_script(COUNTS_SCRIPT)(keys=[keys.line_key(queue_name)])
    return dict(zip(PRIORITIES, (int(n) for n in answer), strict=True))


def position(connection: Redis, queue_name: str, job_id: str) -> int | None:
    """How many jobs a worker takes before this one; None when it is not waiting."""
    answer = connection.register_script(POSITION_SCRIPT)(
        keys=[keys.line_key(queue_name), Job.key_for(job_id)], args=[job_id])
    return None if answer is None else int(answer)
