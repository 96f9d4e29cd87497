-- uses: line
-- KEYS: the job's hash; ARGV: the queue's name, the job's id.
return line_position(line_of(ARGV[1]), redis.call('HGET', KEYS[1], 'priority') or 'normal', ARGV[2])
