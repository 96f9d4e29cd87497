-- The outbox entry for a waiting job that ends inside a script, which cannot read the job's
-- compressed request: admission marks the job's hash with a `webhook` field when the job wants
-- `completed`. The id is shared/contract/webhooks.py's message_id, computed the same way.
local function webhook_completed(outbox, job_key, id, now)
  if outbox and redis.call('HGET', job_key, 'webhook') then
    local msg = 'msg_' .. string.sub(redis.sha1hex(id .. ' job.completed'), 1, 32)
    redis.call('ZADD', outbox, now, cjson.encode(
      {id = msg, job = id, event = 'job.completed', first = now, attempt = 0}))
  end
end
