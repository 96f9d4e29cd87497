-- uses: line
-- ARGV: the queue's name. How many wait in each class.
local line, counts = line_of(ARGV[1]), {}
for _, class in ipairs(CLASSES) do table.insert(counts, redis.call('ZCARD', order_key(line, class))) end
return counts
