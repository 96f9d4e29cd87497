-- uses: line estimates starts_in
-- A job's place and ETA. KEYS: the job's hash, the model, the running hash;
-- ARGV: the queue's name, the job's id, RQ's job prefix, the worker that runs it ('' if none).
local line, now = line_of(ARGV[1]), redis_now()
local f = redis.call('HMGET', KEYS[1], 'cost', 'priority')
local position = line_position(line, f[2] or 'normal', ARGV[2])
local model = job_model(KEYS[2])
local own = job_seconds(model, tonumber(f[1]) or 0)
if not own then return {position or false} end
if position then
  local start = starts_in(line, model, KEYS[3], now, position, nil, f[2] or 'normal', tonumber(f[1]) or 0)
  return {position, num(start), num(start + own)}
end
local entry = redis.call('HGET', KEYS[3], ARGV[4])
if not entry then return {false} end
local _, started = string.match(entry, '(%S+) (%S+)')
return {false, '0', num(math.max(0, own - (now - tonumber(started))))}
