-- uses: expiry
-- KEYS: the deadlines; ARGV: queue name, RQ's job prefix, ended-at, record TTL, channel, outbox, ended,
-- inputs TTL.
return num(expire_due(line_of(ARGV[1]), KEYS[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5], ARGV[6], ARGV[7],
                        tonumber(ARGV[8])))
