-- How long jobs take (shared/store/estimates.py): the fitted model `a + b * cost`, what running jobs
-- have left, and Redis's clock.
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
