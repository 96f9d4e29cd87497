-- uses: line estimates starts_in
-- A job's place and ETA. KEYS: the job's hash, the model, the running hash;
-- ARGV: the queue's name, the job's id, RQ's job prefix, the worker that runs it ('' if none).
-- A waiting job's ETA needs the model; a running one's, its step time once it has run a step.
local line, now = line_of(ARGV[1]), redis_now()
local f = redis.call('HMGET', KEYS[1], 'cost', 'priority')
local position = line_position(line, f[2] or 'normal', ARGV[2])
local model = job_model(KEYS[2])
if position then
  local own = job_seconds(model, tonumber(f[1]) or 0)
  if not own then return {position} end
  local start = starts_in(line, model, KEYS[3], now, position, nil, f[2] or 'normal', tonumber(f[1]) or 0)
  return {position, num(start), num(start + own)}
end
local entry = redis.call('HGET', KEYS[3], ARGV[4])
local left = entry and entry_left(model, entry, now)
if not left then return {false} end
return {false, '0', num(left)}
