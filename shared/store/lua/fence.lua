-- Start an attempt at each job: set its fence token only while the claim is this worker's, so a
-- claim recovered by another worker cannot be started again by the one that lost it.
-- KEYS: the worker's claims list, then each job's fence key; ARGV: the TTL in seconds, then each
-- job's id and token. Answers per job: 1 when its attempt started, 0 when the claim is gone.
local granted = {}
for n = 2, #KEYS do
  local id, token = ARGV[2 * n - 2], ARGV[2 * n - 1]
  if redis.call('LPOS', KEYS[1], id) then
    redis.call('SET', KEYS[n], token, 'EX', ARGV[1])
    granted[n - 1] = 1
  else
    granted[n - 1] = 0
  end
end
return granted
