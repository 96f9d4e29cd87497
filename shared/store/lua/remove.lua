-- uses: line
-- KEYS: the job's hash; ARGV: the queue's name, the job's id.
return line_remove(line_of(ARGV[1]), KEYS[1], ARGV[2]) and 1 or 0
