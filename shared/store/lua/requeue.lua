-- uses: line
-- KEYS: the job's hash; ARGV: the queue's name, the job's id.
line_requeue(line_of(ARGV[1]), KEYS[1], ARGV[2])
