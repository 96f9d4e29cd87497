-- uses: line estimates
-- Seconds until the job at `index` in the line starts (index 0 is next): what the running jobs
-- have left plus the jobs ahead of it, shared among the workers running now. Admission asks it
-- when a refused place frees; GET /v1/jobs asks it for a waiting job's ETA. The first
-- @ETA_WALK@ jobs ahead are read one by one; any further ones are taken to cost what those cost on
-- average, so that the answer takes as long with 10,000 jobs ahead as with @ETA_WALK@.
local function starts_in(line, job_prefix, model_key, running_key, now, index)
  local model = job_model(model_key)  -- once: the walk below reads only each job's cost
  local left = running_left(model, running_key, now)
  local busy = 0
  for _, seconds in ipairs(left) do busy = busy + seconds end
  if model and index > 0 then
    local costs, walked = 0, 0
    for _, id in ipairs(line_head(line, math.min(index, @ETA_WALK@))) do
      costs, walked = costs + (tonumber(redis.call('HGET', job_prefix .. id, 'cost')) or 0), walked + 1
    end
    -- The model is linear: the walked jobs take walked * a + b * their costs, in all.
    if walked > 0 then busy = busy + (walked * model[1] + model[2] * costs) * index / walked end
  end
  return busy / math.max(1, #left)
end
