-- uses: ending
-- A fenced transaction in one round trip (shared/store/fencing.py): the commands run, in order and
-- atomically, only while every fence still holds its attempt's token; otherwise none runs.
-- KEYS: the fence keys; ARGV: a token for each, then each command as its word count and its words.
-- Answers each command's reply (an error reply in its place, as EXEC answers one), or the error
-- `STALE` followed by the places (from 1) of the fences that changed. A script cannot call another
-- by EVALSHA, so a job's end (end.lua) comes as the word @END_COMMAND@, its key count, keys and
-- arguments, and runs here as lib/ending.lua's end_from.
local function run(first, last)
  if ARGV[first] ~= '@END_COMMAND@' then return redis.pcall(unpack(ARGV, first, last)) end
  local count = tonumber(ARGV[first + 1])
  local ok, answer = pcall(end_from, {unpack(ARGV, first + 2, first + 1 + count)},
                           {unpack(ARGV, first + 2 + count, last)})
  if ok then return answer end
  return redis.error_reply(tostring(answer))
end
local stale = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) ~= ARGV[i] then stale[#stale + 1] = i end
end
if #stale > 0 then return redis.error_reply('STALE ' .. table.concat(stale, ' ')) end
local replies, at = {}, #KEYS + 1
while at <= #ARGV do
  local count = tonumber(ARGV[at])
  replies[#replies + 1] = run(at + 1, at + count)
  at = at + count + 1
end
return replies
