-- uses: line
-- The next job, moved from its RQ list into the worker's claims in one step; with its record and
-- Redis's clock, so starting a job costs no extra round trip.
-- With affinity, a job of the adapters the worker holds may go first, within its bound (line.lua).
-- The claim starts an attempt at the job (shared/store/fencing.py): its fence key gets the token.
-- KEYS: the worker's claims list; ARGV: the line's name, RQ's job key prefix, the most times a job
-- may be passed over (0: no affinity), the lines channel (told that the line moved up), the
-- adapters key the worker ran last, the attempt's fence token ('' for none) and the fence's TTL in
-- seconds, then the worker's resident adapters.
local resident = {}
for i = 8, #ARGV do resident[ARGV[i]] = true end
local id = line_pop_affine(line_of(ARGV[1]), ARGV[2], tonumber(ARGV[3]), ARGV[5], resident)
if not id then return false end
redis.call('RPUSH', KEYS[1], id)
if ARGV[6] ~= '' then redis.call('SET', '@FENCE_PREFIX@' .. id, ARGV[6], 'EX', ARGV[7]) end
redis.call('PUBLISH', ARGV[4], 'line@SEP@' .. ARGV[1])
local clock = redis.call('TIME')
return {id, redis.call('HGETALL', ARGV[2] .. id), clock[1] .. '.' .. string.format('%06d', clock[2])}
