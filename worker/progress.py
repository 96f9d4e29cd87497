"""Step progress from inside the GPU section, where every round trip to Redis is idle GPU time.

Step 0 announces the start (an event and the ``started`` webhook) in one fenced transaction like
any other write. Each later step costs one round trip for the whole batch: a script per job that
checks the attempt's fence itself, writes the progress and answers whether the job was canceled,
rather than the three round trips of a watched transaction.
"""

from __future__ import annotations

from redis import Redis
from rq.job import Job

from shared import keys, records
from worker.fencing import StaleAttemptError, held

# KEYS: the job's hash, its cancel key, its fence key; ARGV: the meta as JSON, the attempt's token
# ('' when the writer holds no fence: a plain RQ worker). -1: the attempt is stale, nothing written.
STEP_SCRIPT = """
if ARGV[2] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[2] then return -1 end
redis.call('HSET', KEYS[1], 'meta', ARGV[1])
return redis.call('EXISTS', KEYS[2])
"""


def report(jobs: list[Job], step: int, total: int) -> list[bool]:
    """Record the step of jobs that run together; whether each was canceled by its client."""
    if step == 0:
        return records.report_progress(jobs, step, total)
    tokens = {fence.job_id: fence.token for fence in held()}
    connection = jobs[0].connection
    script = connection.register_script(STEP_SCRIPT)
    # The base class's pipeline: the script is the fence, no watched transaction around it.
    with Redis.pipeline(connection, transaction=False) as pipe:
        for job in jobs:
            job.meta["progress"] = {"step": step, "total": total}
            script(keys=[job.key, keys.cancel_key(job.id), keys.fence_key(job.id)],
                   args=[job.serializer.dumps(job.meta), tokens.get(job.id, "")], client=pipe)
        answers = pipe.execute()
    stale = [job.id for job, answer in zip(jobs, answers, strict=True) if answer == -1]
    if stale:
        raise StaleAttemptError(f"a newer attempt took over job(s) {', '.join(stale)}")
    return [bool(answer) for answer in answers]
