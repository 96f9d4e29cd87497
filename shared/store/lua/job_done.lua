-- An execution's end: fit the model `a + b * cost` by exponentially weighted least squares with the
-- time it held the slot (`a` is what an execution costs whatever it holds), keep the jobs an
-- execution holds on average (`k`: a batch pays `a` once for all its jobs), and clear the worker's
-- running entry unless the worker has started its next job meanwhile (the entry is then that job's).
-- KEYS: the model, the running hash; ARGV: decay, cost, seconds, worker, its running entry, its jobs.
local decay, x, y = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local m = redis.call('HMGET', KEYS[1], 's0', 's1', 's2', 't1', 't2', 'n0', 'n1')
local n0 = (tonumber(m[6]) or 0) * decay + 1
local n1 = (tonumber(m[7]) or 0) * decay + math.max(1, tonumber(ARGV[6]) or 1)
local s0 = (tonumber(m[1]) or 0) * decay + 1
local s1 = (tonumber(m[2]) or 0) * decay + x
local s2 = (tonumber(m[3]) or 0) * decay + x * x
local t1 = (tonumber(m[4]) or 0) * decay + y
local t2 = (tonumber(m[5]) or 0) * decay + x * y
local spread = s0 * s2 - s1 * s1
local a, b
if spread > 1e-9 * s0 * s2 then
  b = (s0 * t2 - s1 * t1) / spread
  a = (t1 - b * s1) / s0
end
if not b or b < 0 or a < 0 then
  -- One cost seen so far (or a fit that makes no sense): assume time grows with cost.
  a, b = 0, t1 / math.max(s1, 1e-9)
end
redis.call('HSET', KEYS[1], 's0', s0, 's1', s1, 's2', s2, 't1', t1, 't2', t2, 'a', a, 'b', b,
           'n0', n0, 'n1', n1, 'k', n1 / n0)
-- The entry stored begins with the one the worker holds: its steps' timing is appended (step.lua).
local stored = redis.call('HGET', KEYS[2], ARGV[4])
if stored and (stored == ARGV[5] or string.sub(stored, 1, #ARGV[5] + 1) == ARGV[5] .. ' ') then
  redis.call('HDEL', KEYS[2], ARGV[4])
end
return {tostring(a), tostring(b)}
