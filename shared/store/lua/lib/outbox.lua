-- The webhook outbox (shared/store/outbox.py): a job's `completed` entry, written by whichever
-- script ends the job (lib/ending.lua). Its id is derived, not drawn, so that a receiver that
-- dedupes on it sees a repeat as one message; the `started` ids are
-- shared/contract/webhooks.py's.
local function webhook_completed(outbox, id, now)
  local msg = 'msg_' .. string.sub(redis.sha1hex(id .. ' job.completed'), 1, 32)
  redis.call('ZADD', outbox, now, cjson.encode(
    {id = msg, job = id, event = 'job.completed', first = now, attempt = 0}))
end
