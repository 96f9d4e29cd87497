-- uses: line
-- ARGV: the queue's name. How many wait in each class, then 1 where an operator paused the line (else 0).
local line, counts = line_of(ARGV[1]), {}
for _, class in ipairs(CLASSES) do table.insert(counts, redis.call('ZCARD', order_key(line, class))) end
table.insert(counts, line_paused(line) and 1 or 0)
return counts
