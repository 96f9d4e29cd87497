"""How long jobs take: a model the worker fits from its own runs, and the estimates drawn from it.

Job time is modelled as ``a + b * cost`` (a fixed part per job plus a part proportional to its
cost units), fitted by exponentially weighted least squares in Redis after each job, so short and
long jobs are both estimated well and the model follows the device as it warms or slows.
"""

from __future__ import annotations

from redis import Redis
from redis.client import Pipeline
from rq.job import Job
from rq.queue import Queue

from shared import keys
from shared.waiting import LINE_LUA

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

# Seconds until the job at `index` in the line starts (index 0 is next): what the running jobs
# have left plus the jobs ahead of it, shared among the workers running now. Admission asks it
# when a refused place frees; GET /v1/jobs asks it for a waiting job's ETA.
STARTS_IN_LUA = """
local function starts_in(line, job_prefix, model_key, running_key, now, index)
  local left = running_left(model_key, running_key, now)
  local busy = 0
  for _, seconds in ipairs(left) do busy = busy + seconds end
  if index > 0 then
    for _, id in ipairs(line_head(line, index)) do
      local cost = tonumber(redis.call('HGET', job_prefix .. id, 'cost')) or 0
      busy = busy + (job_seconds(model_key, cost) or 0)
    end
  end
  return busy / math.max(1, #left)
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

STANDING_SCRIPT = LINE_LUA + ESTIMATE_LUA + STARTS_IN_LUA + """
local now = redis_now()
local f = redis.call('HMGET', KEYS[2], 'cost', 'priority')
local position = line_position(KEYS[1], f[2] or 'normal', ARGV[1])
local own = job_seconds(KEYS[3], tonumber(f[1]) or 0)
if not own then return {position or false} end
if position then
  local start = starts_in(KEYS[1], ARGV[2], KEYS[3], KEYS[4], now, position)
  return {position, num(start), num(start + own)}
end
local entry = redis.call('HGET', KEYS[4], ARGV[3])
if not entry then return {false} end
local _, started = string.match(entry, '(%S+) (%S+)')
return {false, '0', num(math.max(0, own - (now - tonumber(started))))}
"""

# A job's end: fit the model with the time it held the slot, and clear the worker's running entry
# unless the worker has started its next job meanwhile (the entry is then that job's).
JOB_DONE_SCRIPT = FIT_SCRIPT.replace("return {tostring(a), tostring(b)}", """
if redis.call('HGET', KEYS[2], ARGV[4]) == ARGV[5] then redis.call('HDEL', KEYS[2], ARGV[4]) end
return {tostring(a), tostring(b)}""")


def mark_running(pipe: Redis | Pipeline, queue_name: str, worker: str, cost: float, since: float) -> str:
    """Note that this worker started a job of this cost at ``since`` on Redis's clock; the entry."""
    entry = f"{cost!r} {since!r}"
    pipe.hset(keys.running_key(queue_name), worker, entry)
    return entry


def job_done(connection: Redis, queue_name: str, worker: str, entry: str, cost: float,
             seconds: float) -> None:
    """A job this worker marked running with ``entry`` held the slot this long: fit, and clear."""
    connection.register_script(JOB_DONE_SCRIPT)(
        keys=[keys.model_key(queue_name), keys.running_key(queue_name)],
        args=[DECAY, cost, seconds, worker, entry])


def clear_running(connection: Redis, queue_name: str, worker: str) -> None:
    """This worker runs nothing (any more)."""
    connection.hdel(keys.running_key(queue_name), worker)


def standing(queue: Queue, job: Job) -> tuple[int | None, tuple[float, float] | None]:
    """A job's place in the line (None once taken) and the seconds until it starts and finishes,
    by the model (None before the model has seen a job)."""
    answer = queue.connection.register_script(STANDING_SCRIPT)(
        keys=[keys.line_key(queue.name), job.key, keys.model_key(queue.name), keys.running_key(queue.name)],
        args=[job.id, Job.redis_job_namespace_prefix, job.worker_name or ""])
    position = None if answer[0] is None else int(answer[0])
    if len(answer) < 3:
        return position, None
    return position, (float(answer[1]), float(answer[2]))
