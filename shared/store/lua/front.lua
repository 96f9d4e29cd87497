-- uses: line
-- A waiting job to the front of its class (an operator's move): a start tag before every other of
-- the class, and the head of its tenant's list (whose order is the tenant's order in the line).
-- KEYS: the job's hash; ARGV: the line's name, the job's id, the lines channel. Answers false where
-- the job does not wait in the line, else its place before the move.
local line, id = line_of(ARGV[1]), ARGV[2]
local f = redis.call('HMGET', KEYS[1], 'priority', 'tenant')
local class, tenant = f[1] or 'normal', f[2] or ''
local order = order_key(line, class)
local before = line_position(line, class, id)
if not before then return false end
local head = redis.call('ZRANGE', order, 0, 0, 'WITHSCORES')
if head[1] ~= id then
  local tag = tonumber(head[2]) - 1
  redis.call('ZADD', order, num(tag), id)
  redis.call('HSET', KEYS[1], 'tag', num(tag))  -- a requeue after a lost run keeps its place
  local list = rq_list(line, class, tenant)
  redis.call('LREM', list, 1, id)
  redis.call('LPUSH', list, id)
  redis.call('PUBLISH', ARGV[3], 'line@SEP@' .. line.queue)
end
return before
