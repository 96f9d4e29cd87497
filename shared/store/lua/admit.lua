-- uses: line estimates starts_in expiry
-- Admission in one script call: every check first, and only an admitted job writes anything, so
-- a refusal costs one round trip and no writes however hard the service is flooded. Redis runs
-- scripts one at a time, so the limits hold exactly however many API processes admit at once.
-- KEYS: job, idempotency (or job), deadlines, issued, bucket, model, running, inputs, the tenant's
-- listed jobs (GET /v1/jobs).
-- ARGV[1]: the parameters as JSON; ARGV[2..]: the RQ job's fields, as Job.save would write them
-- (`p.fields` of them), then the bytes of each input image that `p.inputs` names.
-- Answers {position, starts in, finishes in, deadline, 1 where its line is paused}, or a refusal: {-1 full, -2 replay,
-- -3 rate limited, -4 tenant full, -6 cannot start by its deadline; detail}, or {-5} (below).
local p = cjson.decode(ARGV[1])
local line, prefix = line_of(p.queue), p.job_prefix
-- Where the job stands, and when it starts and finishes by the estimates; nil once it left the line.
local function standing(now, counts, deadline)
  local position = line_position(line, p.priority, p.id, counts)
  if not position then return nil end
  local model = job_model(KEYS[6])
  local own = job_seconds(model, p.cost)
  local start = own and starts_in(line, model, KEYS[7], now, position, counts, p.priority, p.cost, p.priority)
  return {position, own and num(start) or false, own and num(start + own) or false,
          deadline and num(deadline) or false, line_paused(line) and 1 or false}
end
-- The same call sent again: redis-py sends a command once more when a timeout lost its reply, and
-- the job (its id is new to each submit) went in the first time. This run writes nothing: it
-- answers where the job stands, or {-5} once the job has left the line (taken meanwhile).
if redis.call('EXISTS', KEYS[1]) == 1 then
  local deadline = redis.call('ZSCORE', KEYS[3], p.id)
  return standing(redis_now(), (line_counts(line)), deadline and tonumber(deadline)) or {-5}
end
local now = expire_due(line, KEYS[3], prefix, p.ended_at, p.record_ttl, p.channel, p.outbox, p.ended,
                       p.inputs_ttl)
local function frees_in(index, counts)
  return num(starts_in(line, job_model(KEYS[6]), KEYS[7], now, index, counts))
end
if p.digest then
  local prior = redis.call('GET', KEYS[2])
  if prior then return {-2, prior} end
end
-- The tenant's token bucket, on Redis's clock: refilled at `rate` units a second up to `burst`.
local tokens = 0
if p.rate then
  local state = redis.call('HMGET', KEYS[5], 'tokens', 'at')
  local level, at = tonumber(state[1]) or p.burst, tonumber(state[2]) or now
  tokens = math.min(p.burst, level + math.max(0, now - at) * p.rate)
  if tokens < p.cost then return {-3, num((p.cost - tokens) / p.rate)} end
end
local counts, total = line_counts(line)
if p.max_queued and line_tenant_count(line, p.tenant) >= p.max_queued then
  -- A place frees for this tenant when the first of its waiting jobs starts.
  return {-4, frees_in(line_tenant_first(line, p.tenant, counts) or 0, counts)}
end
-- The class's share of the line: `limit` places for normal, fewer for low, more for high.
if total >= p.limit then return {-1, frees_in(total - p.limit, counts)} end
-- A job the estimates say cannot start before its deadline is refused now rather than left to
-- expire in the line; it could start in time once the line has shortened by the difference.
if p.deadline_s then
  local model = job_model(KEYS[6])
  if model then
    local place = line_place(line, p.priority, line_next_tag(line, p.priority, p.tenant), counts)
    local start = starts_in(line, model, KEYS[7], now, place, counts, nil, nil, p.priority)
    if start > p.deadline_s then return {-6, num(start - p.deadline_s)} end
  end
end
-- The job's hash in one write: RQ's fields, then its place in the fair order.
local tag = line_tag(line, p.priority, p.tenant, p.cost)
redis.call('HSET', KEYS[1], 'priority', p.priority, 'tenant', p.tenant, 'cost', num(p.cost), 'tag', num(tag),
           unpack(ARGV, 2, 1 + p.fields))
for index, name in ipairs(p.inputs or {}) do
  redis.call('HSET', KEYS[8], name, ARGV[1 + p.fields + index])
end
line_insert(line, p.id, p.priority, p.tenant, tag, p.cost, false)
if p.rate then
  redis.call('HSET', KEYS[5], 'tokens', num(tokens - p.cost), 'at', num(now))
  redis.call('EXPIRE', KEYS[5], math.ceil(p.burst / p.rate) + 60)
end
if p.digest then redis.call('SET', KEYS[2], p.digest .. ' ' .. p.id, 'EX', p.idempotency_ttl) end
redis.call('SET', KEYS[4], p.tenant, 'EX', p.issued_ttl)
redis.call('XADD', '@LOG_PREFIX@' .. p.id, 'MAXLEN', '~', @LOG_LENGTH@, '*', 'event', 'queued')
redis.call('EXPIRE', '@LOG_PREFIX@' .. p.id, p.record_ttl)
-- Listed by admission time (unique to the microsecond: scripts run one at a time); entries past
-- any record's TTL go, so the set never outgrows the records it lists.
redis.call('ZADD', KEYS[9], now, p.id)
redis.call('ZREMRANGEBYSCORE', KEYS[9], '-inf', now - p.listed_ttl)
redis.call('EXPIRE', KEYS[9], p.listed_ttl)
local deadline = false
if p.deadline_s then
  deadline = now + p.deadline_s
  redis.call('ZADD', KEYS[3], deadline, p.id)
  local meta = cjson.decode(redis.call('HGET', KEYS[1], 'meta') or '{}')
  meta['deadline_at'] = deadline
  redis.call('HSET', KEYS[1], 'meta', cjson.encode(meta))
end
counts[p.priority] = counts[p.priority] + 1  -- the job itself, inserted since
return standing(now, counts, deadline)
