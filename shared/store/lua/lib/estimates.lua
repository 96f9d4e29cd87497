-- How long jobs take (shared/store/estimates.py): the fitted model `a + b * cost`, what running jobs
-- have left, and Redis's clock.
-- The model's two coefficients and the jobs an execution holds on average, {a, b, k}, or nil before
-- it has seen a job: read once a script.
local function job_model(model_key)
  local m = redis.call('HMGET', model_key, 'a', 'b', 'k')
  local a, b = tonumber(m[1]), tonumber(m[2])
  if not a then return nil end
  return {a, b, math.max(1, tonumber(m[3]) or 1)}
end
-- What a job of this cost takes by the model, or nil without one.
local function job_seconds(model, cost)
  return model and model[1] + model[2] * cost
end
-- What a running entry ("cost started", with "step total at" once a step is reported) has left:
-- its remaining steps at the step time this execution has shown since its start, once it has run a
-- step; before, what the model says of its cost. nil without either.
local function entry_left(model, entry, now)
  local cost, started, step, total, at = string.match(entry, '^(%S+) (%S+) ?(%S*) ?(%S*) ?(%S*)$')
  step, total, at, started = tonumber(step), tonumber(total), tonumber(at), tonumber(started)
  if step and step >= 1 and total and at then
    return math.max(0, (at - started) / step * (total - step) - (now - at))
  end
  if not model then return nil end
  return math.max(0, model[1] + model[2] * tonumber(cost) - (now - started))
end
-- What each running execution has left; `waits`, when given, the most a worker's execution makes
-- the asking job wait, by worker name.
local function running_left(model, running_key, now, waits)
  local left, running = {}, redis.call('HGETALL', running_key)
  for i = 1, #running, 2 do
    local seconds = entry_left(model, running[i + 1], now)
    local most = waits and waits[running[i]]
    if most then seconds = math.min(seconds or most, most) end
    if seconds then table.insert(left, seconds) end
  end
  return left
end
local function redis_now()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) + tonumber(clock[2]) / 1e6
end
