-- One step's progress for the jobs of a GPU execution, each checked against its attempt's fence,
-- logged as a `progress` event and announced on the events channel.
-- KEYS: per job its hash, cancel flag, fence and event log; ARGV[1]: the events channel; then per
-- job its meta and fence token ('' for none).
-- Answers per job: -1 when the attempt is stale (nothing written for it), else whether it was canceled.
local answers, channel = {}, ARGV[1]
for n = 1, (#ARGV - 1) / 2 do
  local hash, cancel, fence, log = KEYS[4 * n - 3], KEYS[4 * n - 2], KEYS[4 * n - 1], KEYS[4 * n]
  local meta, token = ARGV[2 * n], ARGV[2 * n + 1]
  if token ~= '' and redis.call('GET', fence) ~= token then
    answers[n] = -1
  else
    redis.call('HSET', hash, 'meta', meta)
    local progress = cjson.decode(meta)['progress']
    if progress then
      redis.call('XADD', log, 'MAXLEN', '~', @LOG_LENGTH@, '*', 'event', 'progress', 'data', cjson.encode(progress))
      redis.call('PUBLISH', channel, string.sub(log, #'@LOG_PREFIX@' + 1))
    end
    answers[n] = redis.call('EXISTS', cancel)
  end
end
return answers
