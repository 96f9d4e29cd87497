"""How long jobs take: a model the workers of a line fit from their runs, and the estimates drawn from it.

Job time is modelled as ``a + b * cost`` (a fixed part per job plus a part proportional to its
cost units), fitted by exponentially weighted least squares in Redis after each job, so short and
long jobs are both estimated well and the model follows the device as it warms or slows.
"""

from __future__ import annotations

from redis import Redis
from redis.client import Pipeline
from rq.job import Job
from rq.queue import Queue

from shared.contract import keys
from shared.store import scripts, waiting

DECAY = 0.9  # weight of the history against each new run


def mark_running(pipe: Redis | Pipeline, line: str, worker: str, cost: float, since: float) -> str:
    """Note that this worker of the line started a job of this cost at ``since`` on Redis's clock;
    the entry."""
    entry = f"{cost!r} {since!r}"
    pipe.hset(keys.running_key(line), worker, entry)
    return entry


def job_done(connection: Redis, line: str, worker: str, entry: str, cost: float, seconds: float) -> None:
    """A job this worker marked running with ``entry`` held the slot this long: fit, and clear."""
    scripts.run(connection, "job_done", [keys.model_key(line), keys.running_key(line)],
                [DECAY, cost, seconds, worker, entry])


def clear_running(connection: Redis, line: str, worker: str) -> None:
    """This worker runs nothing (any more)."""
    connection.hdel(keys.running_key(line), worker)


def standing(queue: Queue, job: Job) -> tuple[int | None, tuple[float, float] | None]:
    """A job's place in the line (None once taken) and the seconds until it starts and finishes,
    by the model (None before the model has seen a job)."""
    line = waiting.line_of(job)
    answer = scripts.run(queue.connection, "standing",
                         [job.key, keys.model_key(line), keys.running_key(line)],
                         [line, job.id, Job.redis_job_namespace_prefix, job.worker_name or ""])
    position = None if answer[0] is None else int(answer[0])
    if len(answer) < 3:
        return position, None
    return position, (float(answer[1]), float(answer[2]))
