-- A worker's heartbeat: its identity, state and held jobs, on Redis's clock (workers on several
-- hosts are compared on one clock). cjson writes an empty Lua table as {}, so no job at all leaves
-- `current_jobs` out rather than writing {}.
-- KEYS: alive key, claims list, then the workers set of each line it claims from; ARGV: TTL in ms, the identity as JSON, the worker's name.
-- Answers {drain, held}: whether an operator asked the worker to drain (the request is taken: it is
-- answered once), and whether an operator's hold on it lasts (it is read at each beat until it lapses).
-- It also keeps the queue that jobs name as their origin in RQ's registry of queues, so `rq info` and
-- rq-dashboard list its started, finished and failed registries (its own list stays empty).
local record = cjson.decode(ARGV[2])
local jobs = redis.call('LRANGE', KEYS[2], 0, -1)
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + math.floor(tonumber(clock[2]) / 1000) / 1000
local hold = redis.call('PTTL', '@HOLD_PREFIX@' .. ARGV[3])  -- -2: none; -1: until resumed
record['state'] = 'idle'
if hold ~= -2 then
  record['state'] = 'held'
  record['held'] = true
  if hold > 0 then record['held_until'] = now + hold / 1000 end
end
if #jobs > 0 then
  record['state'] = 'busy'  -- a held worker finishes what it holds
  record['current_jobs'] = jobs
end
record['last_beat_at'] = now
redis.call('SET', KEYS[1], cjson.encode(record), 'PX', ARGV[1])
for i = 3, #KEYS do redis.call('SADD', KEYS[i], ARGV[3]) end
redis.call('SADD', '@RQ_QUEUES_KEY@', '@RQ_QUEUE_PREFIX@' .. record['queue'])
local drain = redis.call('GETDEL', '@DRAIN_PREFIX@' .. ARGV[3]) and 1 or 0
return {drain, hold ~= -2 and 1 or 0}
