-- uses: estimates outbox
-- A job's end: the one definition of the writes that record it, whoever ends it. The expiry in the
-- line (lib/expiry.lua) calls end_job in its own script; shared/store/endings.py queues end.lua on
-- the pipeline of the end it queues, which fenced.lua runs as end_from where the writes are fenced. The status field itself is the caller's: RQ's set_status
-- writes it from Python (and keeps the Job object in step), the expiry writes `canceled`.
-- `j` holds: id, status (as a client reads it: succeeded, failed, canceled, expired), ended (the
-- queue's count of ends by status), outbox (the queue's webhook outbox), webhook (whether the job
-- asks for `completed`), inputs_ttl, now; for end_job also key (its hash), ended_at, meta (JSON),
-- ttl (the record's) and channel (the queue's events channel, or nil: no announcement).
-- What follows a final status, whoever wrote it (RQ's own paths in the worker, or end_job): its
-- count by status, its `completed` webhook, its final event, and the expiry of its input images
-- and event log, kept as long as its images; its step checkpoint is of no more use.
local function ended(j)
  redis.call('HINCRBY', j.ended, j.status, 1)
  if j.webhook then webhook_completed(j.outbox, j.id, j.now) end
  redis.call('XADD', '@LOG_PREFIX@' .. j.id, 'MAXLEN', '~', @LOG_LENGTH@, '*', 'event', j.status)
  redis.call('EXPIRE', '@INPUTS_PREFIX@' .. j.id, j.inputs_ttl)
  redis.call('EXPIRE', '@LOG_PREFIX@' .. j.id, j.inputs_ttl)
  redis.call('DEL', '@CHECKPOINT_PREFIX@' .. j.id)
end
-- A job that ends outside RQ's own paths (canceled, expired, or failed or stopped by recovery):
-- when and with what meta, its record kept `ttl` more, what follows, then the announcement.
local function end_job(j)
  redis.call('HSET', j.key, 'ended_at', j.ended_at, 'meta', j.meta)
  redis.call('EXPIRE', j.key, j.ttl)
  ended(j)
  if j.channel then redis.call('PUBLISH', j.channel, j.id) end  -- after the writes: a woken reader sees them
end
-- An end as shared/store/endings.py sends it: with its record (ARGV[5..8]) the whole of end_job,
-- without it only what follows the final status RQ wrote (ended).
-- KEYS: the queue's ended counts, its outbox[, the job's hash]; ARGV: job id, status, inputs TTL,
-- '1' when it asks for `completed` (else ''), [ended-at, meta, the record's TTL, channel].
local function end_from(keys, argv)
  local j = {id = argv[1], status = argv[2], inputs_ttl = tonumber(argv[3]), webhook = argv[4] == '1',
             ended = keys[1], outbox = keys[2], now = redis_now()}
  if not keys[3] then
    ended(j)
    return false
  end
  j.key, j.ended_at, j.meta, j.ttl, j.channel = keys[3], argv[5], argv[6], tonumber(argv[7]), argv[8]
  end_job(j)
  return false
end
