-- uses: line
-- The next job, moved from its RQ list into the worker's claims in one step; with its record and
-- Redis's clock, so starting a job costs no extra round trip.
-- KEYS: the worker's claims list; ARGV: the queue's name, RQ's job key prefix.
local id = line_pop(line_of(ARGV[1]), ARGV[2])
if not id then return false end
redis.call('RPUSH', KEYS[1], id)
local clock = redis.call('TIME')
return {id, redis.call('HGETALL', ARGV[2] .. id), clock[1] .. '.' .. string.format('%06d', clock[2])}
