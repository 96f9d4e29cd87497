-- uses: line
-- The first job of the highest class above ARGV[2] that has work, for preemption (worker/joining.py):
-- its id, when it was admitted (RQ's enqueued_at) and Redis's clock; false when none waits above.
-- ARGV: the queue's name, the class, RQ's job key prefix. A paused line has none: no claim would take it.
local line = line_of(ARGV[1])
if line_paused(line) then return false end
for _, class in ipairs(CLASSES) do
  if class == ARGV[2] then return false end
  local head = redis.call('ZRANGE', order_key(line, class), 0, 0)[1]
  if head then
    local clock = redis.call('TIME')
    return {head, redis.call('HGET', ARGV[3] .. head, 'enqueued_at') or '',
            clock[1] .. '.' .. string.format('%06d', clock[2])}
  end
end
return false
