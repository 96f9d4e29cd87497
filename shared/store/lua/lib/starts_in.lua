-- uses: line estimates
-- Seconds until the job at `index` in the line starts (index 0 is next): what the running jobs
-- have left plus the jobs ahead of it, shared among the workers running now. Admission asks it
-- when a refused place frees; GET /v1/jobs asks it for a waiting job's ETA.
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
