-- One step's progress for the jobs of a GPU execution, each checked against its attempt's fence.
-- KEYS: per job its hash, cancel flag and fence; ARGV: per job its meta and fence token ('' for none).
-- Answers per job: -1 when the attempt is stale (nothing written for it), else whether it was canceled.
local answers = {}
for n = 1, #ARGV / 2 do
  local hash, cancel, fence = KEYS[3 * n - 2], KEYS[3 * n - 1], KEYS[3 * n]
  local meta, token = ARGV[2 * n - 1], ARGV[2 * n]
  if token ~= '' and redis.call('GET', fence) ~= token then
    answers[n] = -1
  else
    redis.call('HSET', hash, 'meta', meta)
    answers[n] = redis.call('EXISTS', cancel)
  end
end
return answers
