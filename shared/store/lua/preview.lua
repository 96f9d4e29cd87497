-- One step's previews for the jobs of a GPU execution, each checked against its attempt's fence:
-- the picture replaces the job's latest preview, and a `preview` event (its step only: the picture
-- stays in the one key, so a job's log holds no image bytes) is logged and announced.
-- KEYS: per job its fence, event log and preview key; ARGV[1]: the events channel, ARGV[2]: the
-- preview's TTL in ms, ARGV[3]: the step; then per job its fence token ('' for none) and preview.
local channel, ttl, step = ARGV[1], ARGV[2], tonumber(ARGV[3])
local written = 0
for n = 1, (#ARGV - 3) / 2 do
  local fence, log, preview = KEYS[3 * n - 2], KEYS[3 * n - 1], KEYS[3 * n]
  local token, image = ARGV[2 * n + 2], ARGV[2 * n + 3]
  if token == '' or redis.call('GET', fence) == token then
    redis.call('SET', preview, cjson.encode({step = step, image = image}), 'PX', ttl)
    redis.call('XADD', log, 'MAXLEN', '~', @LOG_LENGTH@, '*', 'event', 'preview', 'data', cjson.encode({step = step}))
    redis.call('PUBLISH', channel, string.sub(log, #'@LOG_PREFIX@' + 1))
    written = written + 1
  end
end
return written
