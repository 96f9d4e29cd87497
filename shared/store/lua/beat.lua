-- A worker's heartbeat: its identity, state and held jobs, on Redis's clock (workers on several
-- hosts are compared on one clock). cjson writes an empty Lua table as {}, so no job at all leaves
-- `current_jobs` out rather than writing {}.
-- KEYS: alive key, claims list, then the workers set of each line it claims from; ARGV: TTL in ms, the identity as JSON, the worker's name.
-- It also keeps the queue that jobs name as their origin in RQ's registry of queues, so `rq info` and
-- rq-dashboard list its started, finished and failed registries (its own list stays empty).
local record = cjson.decode(ARGV[2])
local jobs = redis.call('LRANGE', KEYS[2], 0, -1)
record['state'] = 'idle'
if #jobs > 0 then
  record['state'] = 'busy'
  record['current_jobs'] = jobs
end
local clock = redis.call('TIME')
record['last_beat_at'] = tonumber(clock[1]) + math.floor(tonumber(clock[2]) / 1000) / 1000
redis.call('SET', KEYS[1], cjson.encode(record), 'PX', ARGV[1])
for i = 3, #KEYS do redis.call('SADD', KEYS[i], ARGV[3]) end
redis.call('SADD', '@RQ_QUEUES_KEY@', '@RQ_QUEUE_PREFIX@' .. record['queue'])
