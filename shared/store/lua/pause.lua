-- uses: line
-- Pause or resume a line. Paused, it admits as ever and no claim takes from it (claim.lua,
-- claim_compatible.lua): its doorbell is silenced, so its workers wait rather than ask again.
-- Resumed, the doorbell rings for each waiting job and the lines channel hears it moved.
-- ARGV: the line's name, 'pause' or 'resume', the lines channel. Answers how many jobs wait in it.
local line = line_of(ARGV[1])
local _, waiting = line_counts(line)
if ARGV[2] == 'pause' then
  redis.call('SET', line.key .. ':paused', 1)
  redis.call('DEL', line.key .. ':doorbell')
else
  redis.call('DEL', line.key .. ':paused')
  for _ = 1, math.min(waiting, @DOORBELL_TOKENS@) do redis.call('RPUSH', line.key .. ':doorbell', 1) end
  redis.call('PUBLISH', ARGV[3], 'line@SEP@' .. line.queue)
end
return waiting
