-- uses: line estimates
-- The most each worker's execution makes a job of `class` wait: a step-level loop that pauses for a
-- higher class (its worker's entry in the pausing hash, "class seconds", worker/joining.py) lets such
-- a job in after that many seconds, whatever it has left.
local function pause_waits(running_key, class)
  local rank, waits = {}, {}
  for index, name in ipairs(CLASSES) do rank[name] = index end
  local paused = redis.call('HGETALL', running_key .. ':pausing')
  for i = 1, #paused, 2 do
    local loop_class, after = string.match(paused[i + 1], '^(%S+) (%S+)$')
    if loop_class and rank[class] < rank[loop_class] then waits[paused[i]] = tonumber(after) end
  end
  return waits
end
-- Seconds until the job at `index` in the line starts (index 0 is next): what the running jobs
-- have left plus the jobs ahead of it, shared among the workers running now. Admission asks it
-- when a refused place frees; GET /v1/jobs asks it for a waiting job's ETA. The jobs ahead cost
-- what their classes' sums say (line_cost_ahead), so the answer takes as long with 10,000 jobs
-- ahead as with one. `model` is job_model's (read once by the caller); `counts` (of line_counts),
-- when given, spares the classes' ZCARDs; `own_class` and `own` name the class and cost of the job
-- at `index`, where it waits; `class`, when given, the class of the job asking (pause_waits).
local function starts_in(line, model, running_key, now, index, counts, own_class, own, class)
  local left = running_left(model, running_key, now, class and pause_waits(running_key, class))
  local busy = 0
  for _, seconds in ipairs(left) do busy = busy + seconds end
  if model and index > 0 then
    local cost, jobs = line_cost_ahead(line, index, counts or line_counts(line), own_class, own or 0)
    -- The model is linear: the jobs ahead take a for each execution they make (k jobs apiece, as
    -- the executions so far held) and b times their costs, in all.
    busy = busy + jobs / model[3] * model[1] + model[2] * cost
  end
  return busy / math.max(1, #left)
end
