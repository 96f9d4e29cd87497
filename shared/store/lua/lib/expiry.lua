-- uses: line estimates outbox
-- Waiting jobs whose deadline has passed leave the line and end expired. Runs at the start of
-- every admission, so an expired job never holds a place that a new one asks for. Each expired id
-- is published on `channel` (when one is given: the line's change on its lines channel), counted
-- in `ended` and gets its `completed` webhook in `outbox` when it asked for one. Its input images,
-- if any, are kept `inputs_ttl` more.
local function expire_due(line, deadlines_key, job_prefix, ended_at, ttl, channel, outbox, ended, inputs_ttl)
  local now = redis_now()
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', deadlines_key, '-inf', now)) do
    redis.call('ZREM', deadlines_key, id)
    local key = job_prefix .. id
    if line_remove(line, key, id) then
      local meta = cjson.decode(redis.call('HGET', key, 'meta') or '{}')
      meta['expired'] = true
      redis.call('HSET', key, 'status', 'canceled', 'ended_at', ended_at, 'meta', cjson.encode(meta))
      redis.call('EXPIRE', key, ttl)
      redis.call('EXPIRE', '@INPUTS_PREFIX@' .. id, inputs_ttl)
      redis.call('XADD', '@LOG_PREFIX@' .. id, 'MAXLEN', '~', @LOG_LENGTH@, '*', 'event', 'expired')
      redis.call('EXPIRE', '@LOG_PREFIX@' .. id, inputs_ttl)
      if channel then
        redis.call('PUBLISH', channel, id)
        redis.call('PUBLISH', channel .. '@LINES_SUFFIX@', 'line@SEP@' .. line.queue)  -- the others moved up
      end
      redis.call('HINCRBY', ended, 'expired', 1)
      webhook_completed(outbox, key, id, now)
    end
  end
  return now
end
