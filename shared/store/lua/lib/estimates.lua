-- How long jobs take (shared/store/estimates.py): the fitted model `a + b * cost`, what running jobs
-- have left, and Redis's clock.
-- The model's two coefficients, {a, b}, or nil before it has seen a job: read once a script.
local function job_model(model_key)
  local m = redis.call('HMGET', model_key, 'a', 'b')
  local a, b = tonumber(m[1]), tonumber(m[2])
  if not a then return nil end
  return {a, b}
end
-- What a job of this cost takes by the model, or nil without one.
local function job_seconds(model, cost)
  return model and model[1] + model[2] * cost
end
local function running_left(model, running_key, now)
  local left = {}
  if not model then return left end
  for _, entry in ipairs(redis.call('HVALS', running_key)) do
    local cost, started = string.match(entry, '(%S+) (%S+)')
    table.insert(left, math.max(0, model[1] + model[2] * tonumber(cost) - (now - tonumber(started))))
  end
  return left
end
local function redis_now()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) + tonumber(clock[2]) / 1e6
end
