-- A fenced transaction in one round trip (shared/store/fencing.py): the commands run, in order and
-- atomically, only while every fence still holds its attempt's token; otherwise none runs.
-- KEYS: the fence keys; ARGV: a token for each, then each command as its word count and its words.
-- Answers each command's reply (an error reply in its place, as EXEC answers one), or the error
-- `STALE` followed by the places (from 1) of the fences that changed.
local stale = {}
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) ~= ARGV[i] then stale[#stale + 1] = i end
end
if #stale > 0 then return redis.error_reply('STALE ' .. table.concat(stale, ' ')) end
local replies, at = {}, #KEYS + 1
while at <= #ARGV do
  local count = tonumber(ARGV[at])
  replies[#replies + 1] = redis.pcall(unpack(ARGV, at + 1, at + count))
  at = at + count + 1
end
return replies
