"""Step progress from inside the GPU section, where every round trip to Redis is idle GPU time.

Step 0 announces the start (an event and the ``started`` webhook) in one fenced transaction like
any other write. Each later step costs one round trip for the whole batch: one script that, for
each job, checks the attempt's fence itself, writes the progress and answers whether the job was
canceled, rather than the two round trips of a watched transaction.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rq.job import Job

from shared.contract import keys
from shared.store import records, scripts
from shared.store.fencing import FencedRedis, StaleAttemptError, held


class Cadence:
    """Which steps to report: the first and the last always, any other once ``interval_s`` has
    passed since the last report (as tqdm's ``mininterval``). A report is a round trip inside the
    GPU section, and it is also when a cancel is seen."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self.last: float | None = None

    def due(self, step: int, total: int) -> bool:
        now = self.clock()
        if step in (0, total) or self.last is None or now - self.last >= self.interval_s:
            self.last = now
            return True
        return False


# For each job n of the batch, KEYS[3n-2..3n]: its hash, its cancel key, its fence key; ARGV[2n-1..2n]:
# its meta as JSON, its attempt's token ('' when the writer holds no fence: a plain RQ worker).

def report(jobs: list[Job], step: int, total: int) -> list[bool]:
    """Record the step of jobs that run together; whether each was canceled by its client."""
    if step == 0:
        return records.report_progress(jobs, step, total)
    tokens = {fence.job_id: fence.token for fence in held()}
    job_keys: list[str] = []
    args: list[str | bytes] = []
    for job in jobs:
        job.meta["progress"] = {"step": step, "total": total}
        job_keys += [job.key, keys.cancel_key(job.id), keys.fence_key(job.id)]
        args += [job.serializer.dumps(job.meta), tokens.get(job.id, "")]
    # The script is the fence: no watched transaction around it. One EVALSHA, not in a pipeline
    # (a pipeline asks SCRIPT EXISTS first: a second round trip).
    connection = jobs[0].connection
    client = connection.unfenced if isinstance(connection, FencedRedis) else connection
    answers = scripts.run(client, "step", job_keys, args)
    stale = [job.id for job, answer in zip(jobs, answers, strict=True) if answer == -1]
    if stale:
        raise StaleAttemptError(f"a newer attempt took over job(s) {', '.join(stale)}")
    return [bool(answer) for answer in answers]
