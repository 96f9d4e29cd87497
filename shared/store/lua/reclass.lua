-- uses: line
-- A waiting job to another priority class (its tenant's change, or an operator's): out of its class's
-- order, list and waiting cost, into the new class's with a start tag there as an admission's (its
-- tenant's turn in that class moves on by its cost), and its stored request rewritten to name the class.
-- KEYS: the job's hash; ARGV: the line's name, the job's id, the new class, the job's data rewritten,
-- the lines channel. Answers false where the job does not wait, else its place in the line now.
local line, id, class = line_of(ARGV[1]), ARGV[2], ARGV[3]
local f = redis.call('HMGET', KEYS[1], 'priority', 'tenant', 'cost')
local old, tenant, cost = f[1] or 'normal', f[2] or '', tonumber(f[3]) or 0
if not redis.call('ZSCORE', order_key(line, old), id) then return false end
if old ~= class then
  line_remove(line, KEYS[1], id)
  local tag = line_tag(line, class, tenant, cost)
  line_insert(line, id, class, tenant, tag, cost, false)
  redis.call('HSET', KEYS[1], 'priority', class, 'tag', num(tag), 'data', ARGV[4])
  redis.call('PUBLISH', ARGV[5], 'line@SEP@' .. line.queue)
end
return line_position(line, class, id)
