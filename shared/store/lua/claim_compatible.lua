-- uses: line
-- More jobs for a batch: up to ARGV[5] jobs of class ARGV[3] whose key (the job hash's field ARGV[8]:
-- `batch`, or `join` for the step-level loop) is ARGV[4], from the first ARGV[6] of that class, each
-- registered in the worker's claims (KEYS[1]) as a claim is. ARGV[1]: the queue's name; ARGV[2]: RQ's
-- job key prefix; ARGV[7]: the fences' TTL in seconds; ARGV[9]: how many times a job may be passed
-- over ('' for no bound: a batch's gather, once, in a bounded window); then a fence token for each job
-- it may take ('' for none): each claim starts an attempt, as in claim.lua.
-- With a bound (the loop, which joins at every step), a job of another key counts each time jobs
-- behind it are taken, and once passed over that often nothing behind it is taken: it goes next.
local line, prefix, class = line_of(ARGV[1]), ARGV[2], ARGV[3]
local wanted, taken, max_skip, passed = tonumber(ARGV[5]), {}, tonumber(ARGV[9]), {}
-- Nothing joins from a paused line (pause.lua), nor the execution of a held worker (workers.hold).
if line_paused(line) or worker_held(KEYS[1]) then return taken end
local window = redis.call('ZRANGE', order_key(line, class), 0, tonumber(ARGV[6]) - 1, 'WITHSCORES')
for i = 1, #window, 2 do
  if #taken >= wanted then break end
  local id = window[i]
  local f = redis.call('HMGET', prefix .. id, ARGV[8], 'skips')
  if f[1] == ARGV[4] then
    for _, other in ipairs(passed) do redis.call('HINCRBY', prefix .. other, 'skips', 1) end
    passed = {}
    redis.call('ZREM', order_key(line, class), id)
    line_taken(line, prefix, class, id, window[i + 1])
    redis.call('RPUSH', KEYS[1], id)
    local token = ARGV[10 + #taken] or ''
    if token ~= '' then redis.call('SET', '@FENCE_PREFIX@' .. id, token, 'EX', ARGV[7]) end
    table.insert(taken, {id, redis.call('HGETALL', prefix .. id)})
  elseif max_skip then
    if (tonumber(f[2]) or 0) >= max_skip then break end
    table.insert(passed, id)
  end
end
return taken
