-- The waiting line (shared/store/waiting.py). Waiting ids sit in RQ's own lists, one per priority
-- class and tenant, so `rq info` and rq.Queue see them; a sorted set per class orders them by start
-- tag (start-time fair queueing by cost); a hash holds each class's waiting cost in all, which ETAs
-- are drawn from. Every function keeps the lists, the order and the costs in step.
local CLASSES = {'high', 'normal', 'low'}
local function num(x) return string.format('%.17g', x) end
-- One queue's line: its RQ lists are named after the queue, its bookkeeping under `key`.
local function line_of(queue) return {queue = queue, key = '@LINE_PREFIX@' .. queue} end
local function rq_list(line, class, tenant)
  local name = line.queue .. '@SEP@' .. class
  if tenant ~= '' then name = name .. '@SEP@' .. tenant end
  return '@RQ_QUEUE_PREFIX@' .. name
end
local function order_key(line, class) return line.key .. ':' .. class end
-- An operator paused the line (shared/store/waiting.py's pause): it admits, no worker takes from it.
local function line_paused(line) return redis.call('EXISTS', line.key .. ':paused') == 1 end
-- Whether an operator holds the worker of this claims list (workers.hold): it claims nothing then.
local function worker_held(claims_key)
  return redis.call('EXISTS', '@HOLD_PREFIX@' .. string.sub(claims_key, #'@CLAIMS_PREFIX@' + 1)) == 1
end
local function costs_key(line) return line.key .. ':costs' end
-- How many wait in each class, and in all.
local function line_counts(line)
  local counts, total = {}, 0
  for _, class in ipairs(CLASSES) do
    counts[class] = redis.call('ZCARD', order_key(line, class))
    total = total + counts[class]
  end
  return counts, total
end
-- What the first `index` jobs of the line cost in all: each class whole ahead of the job at
-- `index` by its sum, and of the class it stands in the share it is ahead of, at that class's
-- average cost (without `own`, the cost of a job of `own_class` at `index`, where one is there).
-- It reads one hash however long the line is.
local function line_cost_ahead(line, index, counts, own_class, own)
  local sums = redis.call('HMGET', costs_key(line), unpack(CLASSES))
  local jobs, cost = 0, 0
  for i, class in ipairs(CLASSES) do
    if jobs >= index then break end
    local n, sum = counts[class], math.max(0, tonumber(sums[i]) or 0)
    local take = math.min(index - jobs, n)
    if take == n then
      cost = cost + sum
    elseif class == own_class and n > 1 then
      cost = cost + take * math.max(0, sum - own) / (n - 1)
    else
      cost = cost + take * sum / n
    end
    jobs = jobs + take
  end
  return cost, jobs
end
local function line_tenant_count(line, tenant)
  local total = 0
  for _, class in ipairs(CLASSES) do total = total + redis.call('LLEN', rq_list(line, class, tenant)) end
  return total
end
-- Into the line; `front` puts it at the head of its tenant's list (a requeue, as RQ's at_front).
local function line_insert(line, id, class, tenant, tag, cost, front)
  redis.call('ZADD', order_key(line, class), tag, id)
  redis.call('HINCRBYFLOAT', costs_key(line), class, cost)
  local list = rq_list(line, class, tenant)
  redis.call(front and 'LPUSH' or 'RPUSH', list, id)
  redis.call('SADD', '@RQ_QUEUES_KEY@', list)
  -- The doorbell holds at most @DOORBELL_TOKENS@ tokens: trimmed only when it overflows.
  if redis.call('RPUSH', line.key .. ':doorbell', 1) > @DOORBELL_TOKENS@ then
    redis.call('LTRIM', line.key .. ':doorbell', -@DOORBELL_TOKENS@, -1)
  end
end
-- The start tag a new job of this class and tenant would get: the later of the class's virtual
-- time and the tenant's last finish.
local function line_next_tag(line, class, tenant)
  local vtime = tonumber(redis.call('HGET', line.key .. ':vtime', class)) or 0
  return math.max(vtime, tonumber(redis.call('HGET', line.key .. ':finish', class .. ' ' .. tenant)) or 0)
end
-- A new job's start tag (line_next_tag); the tenant's finish moves on by the job's cost.
local function line_tag(line, class, tenant, cost)
  local tag = line_next_tag(line, class, tenant)
  redis.call('HSET', line.key .. ':finish', class .. ' ' .. tenant, num(tag + cost))
  return tag
end
-- How many jobs a worker would take before a new job of `class` with start `tag`: every job of
-- the classes above, and those of its own with a tag as early (ties counted ahead).
local function line_place(line, class, tag, counts)
  local ahead = redis.call('ZCOUNT', order_key(line, class), '-inf', num(tag))
  for _, other in ipairs(CLASSES) do
    if other == class then return ahead end
    ahead = ahead + counts[other]
  end
end
-- Out of its RQ list; whether its tenant has nothing left waiting in that class.
local function line_unlist(line, class, tenant, id)
  local list = rq_list(line, class, tenant)
  redis.call('LREM', list, 1, id)
  return redis.call('LLEN', list) == 0
end
-- Out of the line without running (canceled, expired); false when it was not waiting.
local function line_remove(line, job_key, id)
  local f = redis.call('HMGET', job_key, 'priority', 'tenant', 'cost')
  local class, tenant = f[1] or 'normal', f[2] or ''
  if redis.call('ZREM', order_key(line, class), id) == 0 then return false end
  redis.call('HINCRBYFLOAT', costs_key(line), class, -(tonumber(f[3]) or 0))
  -- A tenant that withdrew all it had waiting owes no turn for the work that never ran.
  if line_unlist(line, class, tenant, id) then redis.call('HDEL', line.key .. ':finish', class .. ' ' .. tenant) end
  return true
end
-- Back in the line after an interrupted or lost run, with its own tag: first in its class.
local function line_requeue(line, job_key, id)
  local f = redis.call('HMGET', job_key, 'priority', 'tenant', 'tag', 'cost')
  local class = f[1] or 'normal'
  local tag = tonumber(f[3]) or tonumber(redis.call('HGET', line.key .. ':vtime', class)) or 0
  line_insert(line, id, class, f[2] or '', tag, tonumber(f[4]) or 0, true)
end
-- A job leaves the line for a worker: the class's virtual time moves up to its tag.
local function line_taken(line, job_prefix, class, id, tag)
  local vtime = tonumber(redis.call('HGET', line.key .. ':vtime', class)) or 0
  redis.call('HSET', line.key .. ':vtime', class, num(math.max(vtime, tonumber(tag))))
  local f = redis.call('HMGET', job_prefix .. id, 'tenant', 'cost')
  redis.call('HINCRBYFLOAT', costs_key(line), class, -(tonumber(f[2]) or 0))
  line_unlist(line, class, f[1] or '', id)
end
local function line_pop(line, job_prefix)
  for _, class in ipairs(CLASSES) do
    local popped = redis.call('ZPOPMIN', order_key(line, class))
    if popped[1] then
      line_taken(line, job_prefix, class, popped[1], popped[2])
      return popped[1]
    end
  end
  redis.call('DEL', line.key .. ':doorbell')
  return false
end
-- How many jobs a worker takes before this one; nil when it is not waiting. `counts` (of
-- line_counts), when given, spares the classes' ZCARDs.
local function line_position(line, class, id, counts)
  local rank = redis.call('ZRANK', order_key(line, class), id)
  if not rank then return nil end
  for _, other in ipairs(CLASSES) do
    if other == class then return rank end
    rank = rank + (counts and counts[other] or redis.call('ZCARD', order_key(line, other)))
  end
end
-- The place of a tenant's first waiting job in the line, from the heads of its RQ lists (a
-- tenant's jobs stand in its list in their order in the line); nil when it has none waiting.
local function line_tenant_first(line, tenant, counts)
  local ahead = 0
  for _, class in ipairs(CLASSES) do
    local first = redis.call('LINDEX', rq_list(line, class, tenant), 0)
    if first then
      local rank = redis.call('ZRANK', order_key(line, class), first)
      if rank then return ahead + rank end
    end
    ahead = ahead + counts[class]
  end
  return nil
end
-- Whether every adapter an adapters key names ("ink:1.0,neon:0.5"; '' for none) is in `resident`.
local function adapters_resident(key, resident)
  for name in string.gmatch(key, '([^,:]+):[^,]*') do
    if not resident[name] then return false end
  end
  return true
end
-- The next job with affinity: among the first max_skip + 1 of the highest class that has work, the
-- first that runs with the adapters the worker ran last, else the first whose adapters are all
-- resident, else the head. No job is passed over more than max_skip times: the first that has been
-- goes before any behind it. Priorities always win (only the highest class is looked at), and each
-- job passed over counts it. max_skip 0 is line_pop: the order without affinity.
local function line_pop_affine(line, job_prefix, max_skip, last, resident)
  if max_skip <= 0 then return line_pop(line, job_prefix) end
  for _, class in ipairs(CLASSES) do
    local window = redis.call('ZRANGE', order_key(line, class), 0, max_skip, 'WITHSCORES')
    if window[1] then
      local same, ready, limit
      for i = 1, #window / 2 do
        local f = redis.call('HMGET', job_prefix .. window[2 * i - 1], 'adapters', 'skips')
        local key = f[1] or ''
        if not same and key == last then same = i end
        if not ready and adapters_resident(key, resident) then ready = i end
        if not limit and (tonumber(f[2]) or 0) >= max_skip then limit = i end
      end
      local chosen = same or ready or 1
      if limit and limit < chosen then chosen = limit end
      for i = 1, chosen - 1 do redis.call('HINCRBY', job_prefix .. window[2 * i - 1], 'skips', 1) end
      local id, tag = window[2 * chosen - 1], window[2 * chosen]
      redis.call('ZREM', order_key(line, class), id)
      line_taken(line, job_prefix, class, id, tag)
      return id
    end
  end
  redis.call('DEL', line.key .. ':doorbell')
  return false
end
-- The next job of a worker that serves several models, each model its own line (`lines`, the line of
-- the model it ran last first). Priorities always win: only the highest class any of the lines has
-- work in is looked at. Inside it, the lines' heads are merged by admission time, each line keeping
-- its own fair order. With affinity (max_skip > 0), among the first max_skip + 1 of the merge: the
-- first of the model and adapters the worker ran last, else of that model with its adapters
-- resident, else of a model on its device (`on_device`, by index into `lines`), else the first; the
-- skip bound is line_pop_affine's. Answers the id and the index of its line.
local function lines_pop_affine(lines, job_prefix, max_skip, last, resident, on_device)
  local width = math.max(max_skip, 0) + 1
  for _, class in ipairs(CLASSES) do
    local windows, next_of, admitted, found = {}, {}, {}, false
    for l, line in ipairs(lines) do
      windows[l] = redis.call('ZRANGE', order_key(line, class), 0, width - 1, 'WITHSCORES')
      next_of[l] = 1
      found = found or windows[l][1] ~= nil
    end
    if found then
      local merged = {}
      while #merged < width do
        local best, best_at
        for l = 1, #lines do
          local id = windows[l][2 * next_of[l] - 1]
          if id then
            admitted[id] = admitted[id] or redis.call('HGET', job_prefix .. id, 'enqueued_at') or ''
            if not best or admitted[id] < best_at then best, best_at = l, admitted[id] end
          end
        end
        if not best then break end
        local i = next_of[best]
        merged[#merged + 1] = {line = best, id = windows[best][2 * i - 1], tag = windows[best][2 * i]}
        next_of[best] = i + 1
      end
      local chosen = 1
      if max_skip > 0 then
        local same, ready, held, limit
        for i, m in ipairs(merged) do
          local f = redis.call('HMGET', job_prefix .. m.id, 'adapters', 'skips')
          local key = f[1] or ''
          if m.line == 1 then
            if not same and key == last then same = i end
            if not ready and adapters_resident(key, resident) then ready = i end
          end
          if not held and on_device[m.line] then held = i end
          if not limit and (tonumber(f[2]) or 0) >= max_skip then limit = i end
        end
        chosen = same or ready or held or 1
        if limit and limit < chosen then chosen = limit end
        for i = 1, chosen - 1 do redis.call('HINCRBY', job_prefix .. merged[i].id, 'skips', 1) end
      end
      local m = merged[chosen]
      redis.call('ZREM', order_key(lines[m.line], class), m.id)
      line_taken(lines[m.line], job_prefix, class, m.id, m.tag)
      return m.id, m.line
    end
  end
  for _, line in ipairs(lines) do redis.call('DEL', line.key .. ':doorbell') end
  return false
end
