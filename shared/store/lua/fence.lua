-- Start an attempt: set its fence token only while the claim is this worker's, so a claim
-- recovered by another worker cannot be started again by the one that lost it.
-- KEYS: the worker's claims list, the job's fence key; ARGV: job id, token, TTL in seconds.
if not redis.call('LPOS', KEYS[1], ARGV[1]) then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return 1
