-- uses: line estimates
-- One step's progress for the jobs of a GPU execution, each checked against its attempt's fence,
-- logged as a `progress` event and announced on the events channel.
-- KEYS: per job its hash, cancel flag, fence and event log; ARGV[1]: the events channel; then per
-- job its meta and fence token ('' for none). Where the execution's steps are counted, also the line's
-- running hash (the last KEY) and, last in ARGV, the worker, the steps the execution has run since its
-- running entry was marked and that plus the most steps any of its jobs has left: the worker's
-- running entry ("cost started") then says when this step was reached, "cost started step total at"
-- on Redis's clock, and the ETAs of the jobs running and waiting follow the step time this execution
-- shows; each `progress` event then carries the job's `eta_s` too, from its own steps left.
-- Answers per job: -1 when the attempt is stale (nothing written for it), else whether it was canceled.
local answers, channel = {}, ARGV[1]
local jobs = math.floor(#KEYS / 4)
local step_s  -- the seconds a step takes, as this execution shows, where it is known
if #KEYS % 4 == 1 then
  local running, worker, step, total = KEYS[#KEYS], ARGV[#ARGV - 2], ARGV[#ARGV - 1], ARGV[#ARGV]
  local entry, cost, started = redis.call('HGET', running, worker), nil, nil
  if entry then cost, started = string.match(entry, '^(%S+) (%S+)') end
  if started and tonumber(step) >= 1 then
    local now = redis_now()
    redis.call('HSET', running, worker, table.concat({cost, started, step, total, num(now)}, ' '))
    step_s = (now - tonumber(started)) / tonumber(step)
  end
end
for n = 1, jobs do
  local hash, cancel, fence, log = KEYS[4 * n - 3], KEYS[4 * n - 2], KEYS[4 * n - 1], KEYS[4 * n]
  local meta, token = ARGV[2 * n], ARGV[2 * n + 1]
  if token ~= '' and redis.call('GET', fence) ~= token then
    answers[n] = -1
  else
    redis.call('HSET', hash, 'meta', meta)
    local progress = cjson.decode(meta)['progress']
    if progress then
      -- The event carries the job's ETA as the view has it, so that a follower's time left falls.
      if step_s then
        progress['eta_s'] = {start = 0, finish = step_s * (progress['total'] - progress['step'])}
      end
      redis.call('XADD', log, 'MAXLEN', '~', @LOG_LENGTH@, '*', 'event', 'progress', 'data', cjson.encode(progress))
      redis.call('PUBLISH', channel, string.sub(log, #'@LOG_PREFIX@' + 1))
    end
    answers[n] = redis.call('EXISTS', cancel)
  end
end
return answers
