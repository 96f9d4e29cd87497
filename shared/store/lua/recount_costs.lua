-- uses: line
-- Each class's waiting-cost sum, counted again from the `cost` fields of the jobs that wait, in one
-- step. A worker runs it when it starts: it sets right a line whose jobs were admitted before the
-- sums were kept (their ETAs would read low until they left) and any drift of the sums' additions.
-- ARGV: the queue's name, RQ's job key prefix. Answers {class, sum, ...}.
local line, prefix, sums = line_of(ARGV[1]), ARGV[2], {}
for _, class in ipairs(CLASSES) do
  local sum = 0
  for _, id in ipairs(redis.call('ZRANGE', order_key(line, class), 0, -1)) do
    sum = sum + (tonumber(redis.call('HGET', prefix .. id, 'cost')) or 0)
  end
  table.insert(sums, class)
  table.insert(sums, num(sum))
end
redis.call('HSET', costs_key(line), unpack(sums))
return sums
