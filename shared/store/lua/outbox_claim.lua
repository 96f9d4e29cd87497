-- Take the first due webhook delivery and move it a lease ahead, in one step: no other sender
-- takes it meanwhile. KEYS: the outbox; ARGV: now, lease.
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 1)
if due[1] then redis.call('ZADD', KEYS[1], tonumber(ARGV[1]) + tonumber(ARGV[2]), due[1]) end
return due[1]
