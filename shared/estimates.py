"""How long jobs take: a model the worker fits from its own runs, and the estimates drawn from it.

Job time is modelled as ``a + b * cost`` (a fixed part per job plus a part proportional to its
cost units), fitted by exponentially weighted least squares in Redis after each job, so short and
long jobs are both estimated well and the model follows the device as it warms or slows.
"""

from __future__ import annotations

from redis import Redis
from rq.job import Job
from rq.queue import Queue

from shared import keys

DECAY = 0.9  # weight of the history against each new run

# Lua shared by the scripts below and by admission: the model, and what is left of running jobs.
ESTIMATE_LUA = """
local function job_seconds(model_key, cost)
  local m = redis.call('HMGET', model_key, 'a', 'b')
  local a, b = tonumber(m[1]), tonumber(m[2])
  if not a then return nil end
  return a + b * cost
end
local function running_left(model_key, running_key, now)
  local left = {}
  for _, entry in ipairs(redis.call('HVALS', running_key)) do
    local cost, started = string.match(entry, '(%S+) (%S+)')
    local total = job_seconds(model_key, tonumber(cost))
    if total then table.insert(left, math.max(0, total - (now - tonumber(started)))) end
  end
  return left
end
local function redis_now()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) + tonumber(clock[2]) / 1e6
end
"""

# Seconds until a place frees in a full queue: when the first running job ends (its successor
# then leaves the list), or one job's time when nothing runs. Used by admission on refusal.
PLACE_FREES_LUA = """
local function place_frees_in(queue_key, model_key, running_key, job_prefix, now)
  local soonest = nil
  for _, left in ipairs(running_left(model_key, running_key, now)) do
    if not soonest or left < soonest then soonest = left end
  end
  if soonest then return soonest end
  local head = redis.call('LINDEX', queue_key, 0)
  local cost = head and tonumber(redis.call('HGET', job_prefix .. head, 'cost')) or 0
  return job_seconds(model_key, cost) or 1
end
"""

FIT_SCRIPT = """
local decay, x, y = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local m = redis.call('HMGET', KEYS[1], 's0', 's1', 's2', 't1', 't2')
local s0 = (tonumber(m[1]) or 0) * decay + 1
local s1 = (tonumber(m[2]) or 0) * decay + x
local s2 = (tonumber(m[3]) or 0) * decay + x * x
local t1 = (tonumber(m[4]) or 0) * decay + y
local t2 = (tonumber(m[5]) or 0) * decay + x * y
local spread = s0 * s2 - s1 * s1
local a, b
if spread > 1e-9 * s0 * s2 then
  b = (s0 * t2 - s1 * t1) / spread
  a = (t1 - b * s1) / s0
end
if not b or b < 0 or a < 0 then
  -- One cost seen so far (or a fit that makes no sense): assume time grows with cost.
  a, b = 0, t1 / math.max(s1, 1e-9)
end
redis.call('HSET', KEYS[1], 's0', s0, 's1', s1, 's2', s2, 't1', t1, 't2', t2, 'a', a, 'b', b)
return {tostring(a), tostring(b)}
"""

ETA_SCRIPT = ESTIMATE_LUA + """
local now = redis_now()
local own = job_seconds(KEYS[2], tonumber(redis.call('HGET', KEYS[4], 'cost')) or 0)
if not own then return false end
if ARGV[1] == 'running' then
  local entry = redis.call('HGET', KEYS[3], ARGV[3])
  if not entry then return false end
  local _, started = string.match(entry, '(%S+) (%S+)')
  return {'0', tostring(math.max(0, own - (now - tonumber(started))))}
end
local left = running_left(KEYS[2], KEYS[3], now)
local busy = 0
for _, seconds in ipairs(left) do busy = busy + seconds end
local ahead = 0
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)) do
  ahead = ahead + (job_seconds(KEYS[2], tonumber(redis.call('HGET', ARGV[4] .. id, 'cost')) or 0) or 0)
end
local start = (busy + ahead) / math.max(1, #left)
return {tostring(start), tostring(start + own)}
"""

MARK_RUNNING_SCRIPT = ESTIMATE_LUA + """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ' ' .. tostring(redis_now()))
"""


def record_duration(connection: Redis, queue_name: str, cost: float, seconds: float) -> None:
    """Feed one finished job's cost and wall time into the model."""
    connection.register_script(FIT_SCRIPT)(keys=[keys.model_key(queue_name)], args=[DECAY, cost, seconds])


def mark_running(connection: Redis, queue_name: str, worker: str, cost: float) -> None:
    """Note, on Redis's clock, that this worker started a job of this cost."""
    connection.register_script(MARK_RUNNING_SCRIPT)(keys=[keys.running_key(queue_name)], args=[worker, cost])


def clear_running(connection: Redis, queue_name: str, worker: str) -> None:
    """This worker runs nothing (any more)."""
    connection.hdel(keys.running_key(queue_name), worker)


def eta(queue: Queue, job: Job, position: int | None) -> tuple[float, float] | None:
    """Seconds from now until the job starts and finishes, by the model; None before it knows."""
    mode = "running" if position is None else str(position)
    answer = queue.connection.register_script(ETA_SCRIPT)(
        keys=[queue.key, keys.model_key(queue.name), keys.running_key(queue.name), job.key],
        args=[mode, "", job.worker_name or "", Job.redis_job_namespace_prefix])
    if not answer:
        return None
    start, finish = (float(value) for value in answer)
    return start, finish
