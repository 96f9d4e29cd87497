-- uses: line estimates starts_in
-- A job's place and ETA. KEYS: the job's hash, the model, the running hash;
-- ARGV: the queue's name, the job's id, RQ's job prefix, the worker that runs it ('' if none).
-- A waiting job's ETA needs the model; a running one's, its step time once it has run a step.
-- Answers {position, starts in, finishes in, 1 where its line is paused} while it waits (the two
-- estimates false without a model), {false, '0', finishes in} or {false} once it runs.
local line, now = line_of(ARGV[1]), redis_now()
local f = redis.call('HMGET', KEYS[1], 'cost', 'priority')
local position = line_position(line, f[2] or 'normal', ARGV[2])
local model = job_model(KEYS[2])
if position then
  local paused = line_paused(line) and 1 or false
  local own = job_seconds(model, tonumber(f[1]) or 0)
  if not own then return {position, false, false, paused} end
  local class = f[2] or 'normal'
  local start = starts_in(line, model, KEYS[3], now, position, nil, class, tonumber(f[1]) or 0, class)
  return {position, num(start), num(start + own), paused}
end
local entry = redis.call('HGET', KEYS[3], ARGV[4])
local left = entry and entry_left(model, entry, now)
if not left then return {false} end
-- Once the execution shows its step time, the job's own steps left at it (in a step-level loop a
-- job's steps are its own; the entry's total is the loop's longest).
local started, step, at = string.match(entry, '^%S+ (%S+) (%S+) %S+ (%S+)$')
local meta = redis.call('HGET', KEYS[1], 'meta')
local progress = meta and cjson.decode(meta)['progress']
if step and tonumber(step) >= 1 and type(progress) == 'table' and progress['total'] then
  local per = (tonumber(at) - tonumber(started)) / tonumber(step)
  left = math.max(0, per * (progress['total'] - progress['step']) - (now - tonumber(at)))
end
return {false, '0', num(left)}
