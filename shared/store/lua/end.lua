-- uses: ending
-- A job's end as shared/store/endings.py queues it (lib/ending.lua's end_from).
return end_from(KEYS, ARGV)
