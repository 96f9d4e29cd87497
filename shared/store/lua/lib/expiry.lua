-- uses: line ending
-- Waiting jobs whose deadline has passed leave the line and end expired. Runs at the start of
-- every admission, so an expired job never holds a place that a new one asks for. Each expired id
-- ends as lib/ending.lua writes any end (its `completed` webhook in `outbox` when admission marked
-- its hash as asking for one: the script cannot read its compressed request), and is published
-- with the line's change on `channel` when one is given.
local function expire_due(line, deadlines_key, job_prefix, ended_at, ttl, channel, outbox, ended_key, inputs_ttl)
  local now = redis_now()
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', deadlines_key, '-inf', now)) do
    redis.call('ZREM', deadlines_key, id)
    local key = job_prefix .. id
    if line_remove(line, key, id) then
      local meta = cjson.decode(redis.call('HGET', key, 'meta') or '{}')
      meta['expired'] = true
      redis.call('HSET', key, 'status', 'canceled')
      end_job({id = id, key = key, status = 'expired', ended_at = ended_at, meta = cjson.encode(meta), ttl = ttl,
               ended = ended_key, outbox = outbox, webhook = outbox and redis.call('HGET', key, 'webhook'),
               inputs_ttl = inputs_ttl, now = now, channel = channel})
      if channel then
        redis.call('PUBLISH', channel .. '@LINES_SUFFIX@', 'line@SEP@' .. line.queue)  -- the others moved up
      end
    end
  end
  return now
end
