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


def job_done(connection: Redis, line: str, worker: str, entry: str, cost: float, seconds: float,
             jobs: int = 1) -> None:
    """An execution of ``jobs`` jobs, this worker's ``entry``, held the slot this long: fit, and clear."""
    scripts.run(connection, "job_done", [keys.model_key(line), keys.running_key(line)],
                [DECAY, cost, seconds, worker, entry, jobs])


def mark_pausing(connection: Redis, line: str, worker: str, priority: str, after_s: float) -> None:
    """This worker runs a step-level loop of ``priority`` jobs that pauses for a job of a higher class
    once it has waited ``after_s``: such a job's estimated start does not wait for the loop's end."""
    connection.hset(keys.pausing_key(line), worker, f"{priority} {after_s!r}")


def clear_pausing(connection: Redis, line: str, worker: str) -> None:
    """This worker's running execution (if any) pauses for no one."""
    connection.hdel(keys.pausing_key(line), worker)


def clear_running(connection: Redis, line: str, worker: str) -> None:
    """This worker runs nothing (any more)."""
    connection.hdel(keys.running_key(line), worker)


def standing(queue: Queue, job: Job) -> tuple[int | None, tuple[float, float] | None, bool]:
    """A job's place in the line (None once taken), the seconds until it starts and finishes, by the
    model (None before the model has seen a job), and whether its line is paused (an operator's)."""
    line = waiting.line_of(job)
    answer = scripts.run(queue.connection, "standing",
                         [job.key, keys.model_key(line), keys.running_key(line)],
                         [line, job.id, Job.redis_job_namespace_prefix, job.worker_name or ""])
    position = None if answer[0] is None else int(answer[0])
    paused = len(answer) > 3 and answer[3] == 1
    if len(answer) < 3 or answer[1] is None:
        return position, None, paused
    return position, (float(answer[1]), float(answer[2])), paused
