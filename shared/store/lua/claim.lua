-- uses: line
-- The next job, moved from its RQ list into the worker's claims in one step; with its record, its
-- line and Redis's clock, so starting a job costs no extra round trip.
-- With affinity, a job of the model and adapters the worker holds may go first, within its bound
-- (line.lua). A worker serving several models claims from all their lines (lines_pop_affine).
-- The claim starts an attempt at the job (shared/store/fencing.py): its fence key gets the token.
-- KEYS: the worker's claims list; ARGV: the lines' names, comma-separated, that of the model the
-- worker ran last first; RQ's job key prefix; the most times a job may be passed over (0: no
-- affinity); the lines channel (told that a line moved up); the adapters key the worker ran last;
-- the attempt's fence token ('' for none) and the fence's TTL in seconds; the indexes (1-based,
-- comma-separated) of the lines whose models are on the worker's device; then its resident adapters.
-- A paused line is passed over, its doorbell silenced (pause.lua); a held worker claims nothing.
if worker_held(KEYS[1]) then return false end
local resident, named, held, lines, on_device = {}, {}, {}, {}, {}
for i = 9, #ARGV do resident[ARGV[i]] = true end
for name in string.gmatch(ARGV[1], '[^,]+') do named[#named + 1] = line_of(name) end
for index in string.gmatch(ARGV[8], '[^,]+') do held[tonumber(index)] = true end
for i, line in ipairs(named) do
  if line_paused(line) then
    redis.call('DEL', line.key .. ':doorbell')
  else
    lines[#lines + 1] = line
    on_device[#lines] = held[i]
  end
end
if #lines == 0 then return false end
local id, index
if #lines == 1 then
  id, index = line_pop_affine(lines[1], ARGV[2], tonumber(ARGV[3]), ARGV[5], resident), 1
else
  id, index = lines_pop_affine(lines, ARGV[2], tonumber(ARGV[3]), ARGV[5], resident, on_device)
end
if not id then return false end
redis.call('RPUSH', KEYS[1], id)
if ARGV[6] ~= '' then redis.call('SET', '@FENCE_PREFIX@' .. id, ARGV[6], 'EX', ARGV[7]) end
redis.call('PUBLISH', ARGV[4], 'line@SEP@' .. lines[index].queue)
local clock = redis.call('TIME')
return {id, redis.call('HGETALL', ARGV[2] .. id), clock[1] .. '.' .. string.format('%06d', clock[2]),
        lines[index].queue}
