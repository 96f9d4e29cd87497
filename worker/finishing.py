"""Recording a job's end, and the process that does it off the GPU path. Never imports torch.

With a small model the GPU section is mostly Python, so any Python another thread of the worker
runs meanwhile (PNG encoding, RQ's bookkeeping) waits on the same GIL and slows the GPU section
down. So each execution's images go to a finishing process of its own, started with ``spawn``
(CUDA does not survive a fork): it encodes and stores the PNGs and records each job's end through
RQ's own success path, under the attempt's fence, as the worker would; then it answers how each
job ended, and the worker counts, logs and lets go of it (see worker/finisher.py).
"""

from __future__ import annotations

import io
import json
import logging
import signal
from dataclasses import dataclass
from datetime import datetime
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

from PIL import Image
from PIL.PngImagePlugin import PngInfo
from redis.connection import Encoder
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.utils import now as rq_now
from rq.worker import SimpleWorker

from shared import estimates, events, keys, logs, records
from shared import queue as jobs
from shared.jobs import JobRequest, JobStatus
from shared.settings import Settings
from worker.fencing import Fence, FencedRedis, StaleAttemptError, connect_worker, holding

log = logging.getLogger(__name__)

Rendered = tuple[JobRequest, list[Image.Image]]
READY = "ready"  # the finishing process's first message, once it can take work
REDIS_ENCODING = Encoder("utf-8", "strict", decode_responses=False)  # values as HSET would store them


def encode_png(image: Image.Image, request: JobRequest) -> bytes:
    """PNG bytes with the request in a text chunk, so a saved file says how it was made."""
    info = PngInfo()
    info.add_text("parameters", json.dumps(request.model_dump(mode="json"), sort_keys=True))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def store_result(job: Job, settings: Settings, rendered: Rendered) -> dict[str, Any]:
    """Encode the images as PNG and store them for the result TTL; the job's result."""
    request, images = rendered
    records.store_images(job, settings, [encode_png(image, request) for image in images])
    return {"images": len(images), "seed": request.seed}


# --- What crosses between the worker and its finishing process -------------------------------------

@dataclass(frozen=True)
class Work:
    """One job whose GPU section is done: its record as the worker holds it, this run of it, its
    attempt's fence and its images."""

    job_id: str
    record: dict[bytes, bytes]  # as in Redis (HGETALL), so that RQ's own restore() reads it
    execution_id: str
    execution_started: datetime
    fence: Fence
    rendered: Rendered

    @classmethod
    def of(cls, job: Job, execution: Execution, fence: Fence, rendered: Rendered) -> Work:
        record = {name.encode(): REDIS_ENCODING.encode(value) for name, value in job.to_dict().items()}
        return cls(job.id, record, execution.id, execution.created_at, fence, rendered)


@dataclass(frozen=True)
class Batch:
    """The jobs of one GPU execution, and what the drain-rate estimate needs once they are done."""

    works: list[Work]
    running: str  # the worker's running entry for this execution
    cost: float
    seconds: float  # how long the execution held the slot


@dataclass(frozen=True)
class Ended:
    """How finishing one job went. ``outcome``: its final status (``succeeded``) once recorded;
    ``superseded`` (a newer attempt owns it); ``unrecorded`` (Redis failed: it runs again);
    ``unfinished`` (encoding or storing failed: the worker records the failure)."""

    job_id: str
    outcome: str
    seconds: float = 0.0
    error: str = ""


# --- Recording an end, in either process -------------------------------------------------------------

class FencedWorker(SimpleWorker):
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

    def handle_execution_ended(self, job: Job, queue: Queue, heartbeat_ttl: int) -> None:
        """RQ's own, but its two writes in one transaction: each is fenced, and a fence costs a round trip."""
        job.ended_at = rq_now()
        with self.connection.pipeline() as pipe:
            job.heartbeat(rq_now(), heartbeat_ttl, pipeline=pipe)
            pipe.execute()

    def settle(self, job: Job, fence: Fence) -> JobStatus:
        """The job's end is recorded: drop its claim and the attempt's fence, and tell whoever waits
        on it; its status."""
        status = records.job_status(job)
        with self.connection.pipeline(transaction=False) as pipe:
            pipe.lrem(keys.claims_key(self.name), 1, job.id)
            if status.is_terminal:  # not an interrupted job, which runs again
                records.ended(pipe, self.queue.name, job)
            events.announce(pipe, self.queue.name, job.id)
            pipe.delete(fence.key)  # the attempt is over: the last write it makes
            pipe.execute()
        return status


def run_seconds(job: Job) -> float:
    """How long the job ran, from its start to its recorded end."""
    return (job.ended_at or rq_now()).timestamp() - (job.started_at or rq_now()).timestamp()


class Finishing(FencedWorker):
    """The finishing process's side: store each job's images and record its success."""

    def finish(self, batch: Batch) -> list[Ended]:
        ended = [self._finish_one(work) for work in batch.works]
        if any(end.outcome == JobStatus.SUCCEEDED.value for end in ended):
            estimates.job_done(self.connection, self.queue.name, self.name, batch.running, batch.cost,
                               batch.seconds)
        return ended

    def _finish_one(self, work: Work) -> Ended:
        job = Job(work.job_id, connection=self.connection, serializer=self.serializer)
        job.restore(work.record)
        execution = Execution(work.execution_id, job.id, self.connection, self.name)
        execution.created_at = work.execution_started
        with holding(work.fence), logs.about_job(job.id, job.meta.get("request_id")):
            try:
                try:
                    result = store_result(job, self.settings, work.rendered)
                except (RedisConnectionError, RedisTimeoutError, StaleAttemptError):
                    raise  # not the job's failure: Redis is away or the job is another attempt's now
                except Exception as exc:
                    log.exception("could not encode or store the images")
                    return Ended(job.id, "unfinished", error=f"{type(exc).__name__}: {exc}")
                # RQ's own success path (the one its perform_job takes): result, registries, status.
                self._finalize_success(job, self.queue, execution, result)
                status = self.settle(job, work.fence)
            except StaleAttemptError as exc:
                return Ended(job.id, "superseded", error=str(exc))
            except Exception as exc:  # Redis away, or a fault: the claim stays for recovery
                log.warning("could not record the end of job %s: %r", job.id, exc)
                return Ended(job.id, "unrecorded", error=repr(exc))
        return Ended(job.id, status.value, run_seconds(job))


_busy = False  # finishing a batch now
_stop_requested = False


def _stop_when_idle(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a supervisor stopping the whole group): end now if idle, else after this batch."""
    global _stop_requested
    _stop_requested = True
    if not _busy:
        raise SystemExit(0)


def serve(connection: Connection, settings: Settings, worker_name: str) -> None:
    """The finishing process: finish each batch handed over until the worker says stop or is gone."""
    global _busy
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl+C reaches the group: the worker decides
    signal.signal(signal.SIGTERM, _stop_when_idle)
    logs.configure(settings, "finisher")
    finishing = Finishing(jobs.job_queue(connect_worker(settings), settings), settings, worker_name)
    connection.send(READY)
    while not _stop_requested:
        try:
            batch = connection.recv()
        except EOFError:
            return  # the worker is gone
        if batch is None:
            return
        _busy = True
        try:
            connection.send(finishing.finish(batch))
        finally:
            _busy = False
