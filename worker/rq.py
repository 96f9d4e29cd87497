"""The one adapter for RQ's private API: the worker records each job's end through RQ's own paths.

RQ's ``perform_job`` runs a job and records its end in one go; the slotq worker splits the two
(the GPU section here, the end in its finishing process), so it calls the halves RQ keeps private:
``_finalize_success``, ``_finalize_failure``, ``_stopped_job_id``, and for a batch's ends in one
transaction ``Job._handle_success`` and ``Job._result``. Every such use is below, and
:func:`check_rq` (run at start-up and by tests/worker/test_rq.py) fails with a plain message when an RQ
release outside ``pyproject.toml``'s range (``rq>=3.0,<4``) no longer has them. The rest of RQ that
slotq uses is public: ``Job``, ``Queue``, registries, ``Execution``, death penalties; ``RQWorker.start``
writes what RQ's ``prepare_execution`` and ``prepare_job_execution`` do, and ``RQWorker.succeed`` what
its ``handle_job_success`` does, through the same calls, on one pipeline for a whole batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from redis.client import Pipeline
from rq.executions import Execution, prepare_execution
from rq.job import Job
from rq.queue import Queue
from rq.rate_limit import release_slot
from rq.serializers import JSONSerializer
from rq.utils import now as rq_now
from rq.worker import SimpleWorker, WorkerStatus

from shared.contract import keys
from shared.contract.jobs import JobStatus
from shared.contract.settings import Settings
from shared.store import endings
from shared.store.fencing import Fence, FencedRedis

# RQ's private methods, with the parameters slotq passes them (after self).
PRIVATE_METHODS: dict[tuple[type, str], list[str]] = {
    (SimpleWorker, "_finalize_success"): ["job", "queue", "execution", "return_value"],
    (SimpleWorker, "_finalize_failure"): ["job", "queue", "execution", "exc_info"],
    (Job, "_handle_success"): ["result_ttl", "pipeline", "worker_name", "execution_id",
                               "execution_started_at", "execution_ended_at"],
}
# Private attributes, each with the RQ function that reads it: a job stopped on request, and the
# return value that _handle_success stores as the job's result.
PRIVATE_ATTRIBUTES: dict[str, Callable[..., Any]] = {"_stopped_job_id": SimpleWorker.handle_job_failure,
                                                     "_result": Job._handle_success}
# What RQ's start bookkeeping and its success path write, each through the calls named: RQWorker.start
# and RQWorker.succeed queue the same on one pipeline for a whole batch. RQ's functions must still
# make these calls (and none other that writes).
REPLAYED_CALLS: dict[str, tuple[Callable[..., Any], list[str]]] = {
    "prepare_execution": (prepare_execution, ["Execution.create", "set_state"]),
    "prepare_job_execution": (SimpleWorker.prepare_job_execution,
                              ["self.heartbeat", "job.heartbeat", "job.prepare_for_execution",
                               "pipeline.persist"]),
    "handle_job_success": (SimpleWorker.handle_job_success,
                           ["self.increment_successful_job_count", "self.increment_total_working_time",
                            "job._handle_success", "job.cleanup", "self.cleanup_execution", "release_slot"]),
}


def check_rq() -> None:
    """Raise ``RuntimeError`` naming what changed when RQ no longer has what this module uses."""
    problems = []
    for (owner, name), expected in PRIVATE_METHODS.items():
        method = getattr(owner, name, None)
        if method is None:
            problems.append(f"rq's {owner.__name__}.{name} is gone")
            continue
        parameters = list(inspect.signature(method).parameters)[1:len(expected) + 1]
        if parameters != expected:
            problems.append(f"rq's {owner.__name__}.{name} takes {parameters}, not {expected}")
    attributes = PRIVATE_ATTRIBUTES.items()
    problems += [f"rq's {reader.__name__} no longer reads self.{name}" for name, reader in attributes
                 if f"self.{name}" not in inspect.getsource(reader)]
    for name, (function, calls) in REPLAYED_CALLS.items():
        body = inspect.getsource(function)
        problems += [f"rq's {name} no longer calls {call}" for call in calls if f"{call}(" not in body]
    rq_names = (Queue.redis_queue_namespace_prefix, Queue.redis_queues_keys)
    if rq_names != (keys.RQ_QUEUE_PREFIX, keys.RQ_QUEUES_KEY):
        problems.append("RQ names its queue keys differently from shared/contract/keys.py")
    if problems:
        raise RuntimeError("this RQ release does not fit slotq (worker/rq.py): " + "; ".join(problems))


class RQWorker(SimpleWorker):
    """RQ's worker, for recording jobs' ends through RQ's own paths with fenced writes."""

    def __init__(self, queue: Queue, settings: Settings, name: str | None) -> None:
        if not isinstance(queue.connection, FencedRedis):
            raise TypeError("a worker writes through a FencedRedis connection: see connect_worker()")
        # RQ logs a job's description (its arguments: the prompt) unless told not to.
        super().__init__([queue], name=name, connection=queue.connection, serializer=JSONSerializer,
                         log_job_description=settings.log_prompts)
        self.settings = settings

    @property
    def queue(self) -> Queue:
        return self.queues[0]

    def start(self, jobs: list[Job], pipe: Pipeline) -> list[Execution]:
        """Queue RQ's start bookkeeping for these jobs on one pipeline: what its ``prepare_execution``
        (an execution each, this worker busy) and ``prepare_job_execution`` (the heartbeats, each
        job started and persisted) write, in one transaction rather than one each per job."""
        executions = []
        for job in jobs:
            ttl = self.get_heartbeat_ttl(job)
            execution = Execution.create(job, ttl, pipeline=pipe, worker_name=self.name)
            self.executions[execution.id] = execution
            executions.append(execution)
        self.set_state(WorkerStatus.BUSY, pipeline=pipe)
        self.heartbeat(max(self.get_heartbeat_ttl(job) for job in jobs), pipeline=pipe)
        for job in jobs:
            job.heartbeat(rq_now(), self.get_heartbeat_ttl(job), pipeline=pipe)
            job.prepare_for_execution(self.name, pipeline=pipe)
            pipe.persist(job.key)
        return executions

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        """RQ's own: the job's end, and a heartbeat that keeps it registered for as long as its
        success or failure callback may take. slotq's jobs have none (admission names none), so that
        heartbeat, a fenced transaction of two round trips, is left out for them."""
        job.ended_at = rq_now()
        if job.success_callback is not None or job.failure_callback is not None:
            with self.connection.pipeline() as pipe:
                job.heartbeat(rq_now(), heartbeat_ttl, pipeline=pipe)
                pipe.execute()

    def record_success(self, job: Job, execution: Execution, result: Any) -> None:
        """RQ's own success path (the one its perform_job takes): result, registries, status."""
        self._finalize_success(job, self.queue, execution, result)

    def succeed(self, job: Job, execution: Execution, result: Any, pipe: Pipeline) -> None:
        """Queue RQ's success path for one job on a pipeline the caller runs, then calls
        :meth:`succeeded`: what ``_finalize_success`` and ``handle_job_success`` write for a job
        without callbacks, repeats or dependents (slotq's: admission names none, and nothing
        adds any), so that a batch's ends are one transaction, not a WATCH and two round trips each."""
        if not plain(job):
            raise ValueError(f"job {job.id} has callbacks or repeats: record it with record_success")
        self.handle_execution_ended(job, self.queue, job.success_callback_timeout)
        job._result = result
        assert job.ended_at is not None and job.started_at is not None
        self.increment_successful_job_count(pipeline=pipe)
        self.increment_total_working_time(job.ended_at - job.started_at, pipe)
        result_ttl = job.get_result_ttl(self.default_result_ttl)
        if result_ttl != 0:
            job._handle_success(result_ttl, pipeline=pipe, worker_name=self.name, execution_id=execution.id,
                                execution_started_at=execution.created_at, execution_ended_at=job.ended_at)
        job.cleanup(result_ttl, pipeline=pipe, remove_from_queue=False)
        self.cleanup_execution(job, pipeline=pipe, execution=execution)

    def succeeded(self, job: Job) -> None:
        """After :meth:`succeed`'s writes: what RQ's success path does once its transaction ran."""
        release_slot(job)
        self.log.info("Successfully completed job %s in %ss on worker %s", job.id,
                      (job.ended_at or rq_now()) - (job.started_at or rq_now()), self.name)

    def record_failure(self, job: Job, execution: Execution, error: BaseException) -> None:
        """RQ's own failure path; its hooks (handle_exception, handle_job_failure) decide the ending."""
        self._finalize_failure(job, self.queue, execution, (type(error), error, error.__traceback__))

    def mark_stopped(self, job: Job) -> None:
        """Have RQ's failure path mark this job stopped (RQ's own stop-job command), never retried."""
        self._stopped_job_id = job.id

    def settle(self, job: Job, fence: Fence) -> JobStatus:
        """The job's end is recorded: drop its claim and the attempt's fence; its status."""
        return endings.settle(self.connection, self.queue.name, keys.claims_key(self.name), job, fence.key,
                              self.settings.result_ttl_s)


def plain(job: Job) -> bool:
    """Whether RQ's success path for this job writes only what :meth:`RQWorker.succeed` queues."""
    return job.success_callback is None and job.failure_callback is None and not job.repeats_left


def run_seconds(job: Job) -> float:
    """How long the job ran, from its start to its recorded end."""
    return (job.ended_at or rq_now()).timestamp() - (job.started_at or rq_now()).timestamp()
