-- uses: line
-- More jobs for a batch: up to ARGV[5] jobs of class ARGV[3] whose key (the job hash's field ARGV[8]:
-- `batch`, or `join` for the step-level loop) is ARGV[4], from the first ARGV[6] of that class, each
-- registered in the worker's claims (KEYS[1]) as a claim is. ARGV[1]: the queue's name; ARGV[2]: RQ's
-- job key prefix; ARGV[7]: the fences' TTL in seconds, then a fence token for each job it may take
-- ('' for none): each claim starts an attempt, as in claim.lua.
local line, prefix, class = line_of(ARGV[1]), ARGV[2], ARGV[3]
local wanted, taken = tonumber(ARGV[5]), {}
local window = redis.call('ZRANGE', order_key(line, class), 0, tonumber(ARGV[6]) - 1, 'WITHSCORES')
for i = 1, #window, 2 do
  if #taken >= wanted then break end
  local id = window[i]
  if redis.call('HGET', prefix .. id, ARGV[8]) == ARGV[4] then
    redis.call('ZREM', order_key(line, class), id)
    line_taken(line, prefix, class, id, window[i + 1])
    redis.call('RPUSH', KEYS[1], id)
    local token = ARGV[9 + #taken] or ''
    if token ~= '' then redis.call('SET', '@FENCE_PREFIX@' .. id, token, 'EX', ARGV[7]) end
    table.insert(taken, {id, redis.call('HGETALL', prefix .. id)})
  end
end
return taken
