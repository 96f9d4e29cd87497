"""The finishing process: it records each job's end off the GPU path; both sides of it are here.

With a small model the GPU section is mostly Python, so any Python another thread of the worker
runs meanwhile (PNG encoding, RQ's bookkeeping) waits on the same GIL and slows the GPU section
down. So each execution's images go to a finishing process of its own, started with ``spawn``
(CUDA does not survive a fork), which never imports torch: it encodes and stores the PNGs and
records each job's end through RQ's own success path, under the attempt's fence, as the worker
would; then it answers how each job ended, and the worker counts, logs and lets go of it.

The worker's main thread holds the GPU only for the pipeline call, then hands the images over
(:class:`Finisher`) and takes the next job at once. A hand-off waits until the previous one is
answered, so at most two executions' images are in flight (one being finished, one being made)
and a slow finish slows the GPU down instead of piling work up. A job stays in its worker's claims
until its end is recorded, so a crash of either process at any moment leaves it recoverable; a
finishing process that dies is replaced, and the jobs it held are let go for recovery to settle.
The messages between the two are worker/messages.py's.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any, Generic, TypeVar

from PIL import Image
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq.executions import Execution
from rq.job import Job

from shared.contract import keys, logs
from shared.contract.errors import StorageUnavailableError, WorkerFatalError
from shared.contract.jobs import JobRequest, Outcome
from shared.contract.settings import Settings
from shared.store import endings, estimates, results
from shared.store.connection import job_queue
from shared.store.fencing import StaleAttemptError, connect_worker, holding
from worker.messages import (
    Batch,
    Clip,
    Ended,
    Finished,
    FromFinisher,
    Ready,
    Rendered,
    Stop,
    ToFinisher,
    Work,
    encode_png,
)
from worker.rq import RQWorker, run_seconds
from worker.video import encode_mp4

log = logging.getLogger(__name__)
Handoff = TypeVar("Handoff")
# A job finished together: its PNGs, its MP4 (a video job's), its result.
Made = tuple[Job, Execution, list[bytes], bytes | None, dict[str, Any]]
START_TIMEOUT_S = 60.0
CONNECT_FOR_S = START_TIMEOUT_S / 2  # how long a starting finisher waits for Redis (a failover, a restart)
STOP_TIMEOUT_S = 30.0


class Finisher(Generic[Handoff]):
    """One finishing process, fed one batch at a time; a thread reads its answers.

    ``on_ended(handoff, ended)`` runs on that thread with each batch's answer; ``on_lost(handoff)``
    when the process died before answering.
    """

    def __init__(self, settings: Settings, worker_name: str, on_ended: Callable[[Handoff, list[Ended]], None],
                 on_lost: Callable[[Handoff], None]) -> None:
        self._settings, self._worker_name = settings, worker_name
        self._on_ended, self._on_lost = on_ended, on_lost
        self._free = threading.Semaphore(1)  # held from a hand-off until its answer is handled
        self._pending: Handoff | None = None
        self._lock = threading.Lock()  # between the pending batch and the process it went to
        self._closing = False
        self._broken = ""  # why no finishing process could be started again
        self._start()
        self._reader = threading.Thread(target=self._read, name="finisher", daemon=True)
        self._reader.start()

    def submit(self, handoff: Handoff, batch: Batch, wait: bool = True) -> bool:
        """Hand one batch over; blocks while the previous one is still being finished, or without
        ``wait`` answers False at once (nothing handed over). True once handed over."""
        if not self._free.acquire(blocking=False):
            if not wait:
                return False
            # The next GPU section waits on this: finishing (PNGs, the store, RQ) is the slower half.
            log.info("waiting for the finishing process to finish the previous batch")
            self._free.acquire()
        if self._broken:
            self._free.release()
            raise WorkerFatalError(f"no finishing process: {self._broken}")
        with self._lock:
            self._pending, connection = handoff, self._connection
        try:
            connection.send(batch)  # a ToFinisher message
        except OSError:  # the process died meanwhile; unless its reader let go of the batch already
            self._lose(handoff)
        return True

    def close(self) -> None:
        """Let the last batch finish, then stop the process and the reader."""
        self._free.acquire()
        self._closing = True
        try:
            self._connection.send(Stop())
        except OSError:
            pass
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            log.warning("the finishing process did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
            self._process.kill()
        self._reader.join()

    def _start(self) -> None:
        # spawn, not fork: the parent may hold a CUDA context, which does not survive a fork.
        context = multiprocessing.get_context("spawn")
        self._connection, theirs = context.Pipe()
        self._process = context.Process(target=serve, name="slotq-finisher", daemon=True,
                                        args=(theirs, self._settings, self._worker_name))
        self._process.start()
        theirs.close()  # so that its death reads as end of file here
        # Ready before the worker takes a job, so that no GPU section waits on its start-up.
        if not self._connection.poll(START_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the finishing process did not start within {START_TIMEOUT_S:.0f} s")
        try:
            if not isinstance(self._connection.recv(), Ready):
                raise RuntimeError("the finishing process said something else than that it is ready")
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the finishing process exited at start ({self._process.exitcode})") from None

    def _read(self) -> None:
        while True:
            connection: Connection = self._connection
            try:
                answer: FromFinisher = connection.recv()
            except (EOFError, OSError):
                connection.close()
                if self._closing or not self._replace():
                    return
                continue
            with self._lock:
                handoff, self._pending = self._pending, None
            try:
                if not isinstance(answer, Finished):
                    raise TypeError(f"the finishing process answered {answer!r}")
                self._on_ended(handoff, answer.ended)  # type: ignore[arg-type]
            except BaseException:  # a fault here must not stop the next batch's answer
                log.exception("handling the end of finished jobs failed")
            finally:
                self._free.release()

    def _replace(self) -> bool:
        """The process died: start another, and let go of the batch it held; whether one runs."""
        self._process.join()
        if self._process.exitcode == 0:  # it stopped as asked: SIGTERM to the worker's process group
            log.info("the finishing process stopped; starting another for what the worker still finishes")
        else:
            log.error("the finishing process died (exit code %s); starting another", self._process.exitcode)
        with self._lock:
            handoff = self._pending
            try:
                self._start()
            except RuntimeError as exc:  # the worker stops at its next hand-off, to be restarted
                log.critical("could not replace the finishing process: %s", exc)
                self._broken = str(exc)
        if handoff is not None:
            self._lose(handoff)
        return not self._broken

    def _lose(self, handoff: Handoff) -> None:
        """A batch will never be answered: its jobs are let go (once), and the next may come."""
        with self._lock:
            if self._pending is not handoff:
                return  # the other thread let go of it
            self._pending = None
        try:
            self._on_lost(handoff)
        finally:
            self._free.release()


# --- the finishing process itself ------------------------------------------------------------------

def store_result(job: Job, settings: Settings, rendered: Rendered) -> dict[str, Any]:
    """Encode the images as PNG (a clip as MP4 and its poster) and store them for the result TTL;
    the job's result."""
    pngs, video = encoded(settings, rendered)
    results.of(settings).save_images(job, pngs, fault_hook(settings, job, rendered), video=video)
    return finished(job, rendered, pngs)


def encoded(settings: Settings, rendered: Rendered) -> tuple[list[bytes], bytes | None]:
    """A job's images as PNG bytes, at SLOTQ_PNG_COMPRESS_LEVEL; a clip's first frame so (its
    poster), and the clip as an MP4."""
    request, made = rendered
    if isinstance(made, Clip):
        poster = Image.fromarray(made.frames[0])
        return [encode_png(poster, request, settings.png_compress_level)], encode_mp4(made.frames, made.fps)
    return [encode_png(image, request, settings.png_compress_level) for image in made], None


def finished(job: Job, rendered: Rendered, pngs: list[bytes]) -> dict[str, Any]:
    """A job whose images are made: its record shows the last step; its result."""
    request = rendered[0]
    # Every step ran (saved with the images; the GPU section leaves the last step to this process).
    job.meta["progress"] = {"step": request.steps_run, "total": request.steps_run}
    return {"images": len(pngs), "seed": request.seed}


def fault_hook(settings: Settings, job: Job, rendered: Rendered) -> results.Hook | None:
    """What runs between a job's image write and its record write (a test's fault), if anything."""
    return _kill_worker if settings.fault_injection and _killed_here(rendered[0], job) else None


def _killed_here(request: JobRequest, job: Job) -> bool:
    """Test hook (SLOTQ_FAULT_INJECTION=true): a first attempt whose prompt asks for it dies mid-store."""
    return request.prompt.startswith("__kill_after_store__") and job.meta.get("attempt") == 1


def _kill_worker() -> None:
    """SIGKILL the worker and this finishing process: between the image write and the record write."""
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


class Finishing(RQWorker):
    """The finishing process's side: store each job's images and record its success."""

    def finish(self, batch: Batch) -> list[Ended]:
        ended = self._finish_together(batch.works)
        if ended is None:  # the batch did not end as one: each job alone, with its own error
            ended = [self._finish_one(work) for work in batch.works]
        if any(end.outcome is Outcome.SUCCEEDED for end in ended):
            try:
                estimates.job_done(self.connection, batch.line, self.name, batch.running, batch.cost,
                                   batch.seconds, len(batch.works))
            except RedisError as exc:  # the ends are recorded: the model only misses one sample
                log.warning("could not update the job-time model: %s", exc)
        return ended

    def _finish_together(self, works: list[Work]) -> list[Ended] | None:
        """Record a batch's ends in one fenced transaction (each job's images, RQ's success, the
        settling); None, with nothing recorded, where any job needs :meth:`_finish_one`'s path: an
        image that cannot be encoded or stored, a stale attempt, Redis away."""
        store = results.of(self.settings)
        try:
            made = [self._stored(work, store) for work in works]
            with holding(*(work.fence for work in works)), self.connection.pipeline() as pipe:
                statuses = []
                for (job, execution, pngs, video, result), work in zip(made, works, strict=True):
                    store.record_images(job, pngs, pipe, video=video)
                    self.succeed(job, execution, result, pipe)
                    statuses.append(endings.settle_in(pipe, self.queue.name, keys.claims_key(self.name), job,
                                                      work.fence.key, self.settings.result_ttl_s))
                pipe.execute()
        except Exception as exc:  # nothing of the transaction was written; the images are rewritten
            log.info("the batch's ends are recorded one by one (%r)", exc)
            return None
        ended = []
        for (job, *_), status in zip(made, statuses, strict=True):
            with logs.about_job(job.id, job.meta.get("request_id")):
                self.succeeded(job)
            ended.append(Ended(job.id, Outcome.of(status), run_seconds(job)))
        return ended

    def _stored(self, work: Work, store: results.Results) -> Made:
        """A job of a batch finished together: restored, its images encoded and (outside Redis) stored."""
        job, execution = self._restored(work)
        pngs, video = encoded(self.settings, work.rendered)
        store.put_images(job, pngs, fault_hook(self.settings, job, work.rendered), video=video)
        return job, execution, pngs, video, finished(job, work.rendered, pngs)

    def _restored(self, work: Work) -> tuple[Job, Execution]:
        job = Job(work.job_id, connection=self.connection, serializer=self.serializer)
        job.restore(work.record)
        execution = Execution(work.execution_id, job.id, self.connection, self.name)
        execution.created_at = work.execution_started
        return job, execution

    def _finish_one(self, work: Work) -> Ended:
        job, execution = self._restored(work)
        with holding(work.fence), logs.about_job(job.id, job.meta.get("request_id")):
            try:
                try:
                    result = store_result(job, self.settings, work.rendered)
                except (RedisConnectionError, RedisTimeoutError, StaleAttemptError):
                    raise  # not the job's failure: Redis is away or the job is another attempt's now
                except StorageUnavailableError as exc:
                    return self._unstored(job, work, str(exc))
                except Exception as exc:
                    log.exception("could not encode or store the images")
                    return Ended(job.id, Outcome.UNFINISHED, error=f"{type(exc).__name__}: {exc}")
                self.record_success(job, execution, result)
                status = self.settle(job, work.fence)
            except StaleAttemptError as exc:
                return Ended(job.id, Outcome.SUPERSEDED, error=str(exc))
            except Exception as exc:  # Redis away, or a fault: the claim stays for recovery
                log.warning("could not record the end of job %s: %r", job.id, exc)
                return Ended(job.id, Outcome.UNRECORDED, error=repr(exc))
        return Ended(job.id, Outcome.of(status), run_seconds(job))

    def _unstored(self, job: Job, work: Work, why: str) -> Ended:
        """The store could not be written: the job runs again while it has attempts left (as when its
        worker is lost), else it fails ``storage_unavailable``; under the attempt's fence."""
        log.error("could not store the images of job %s: %s", job.id, why)
        with self.connection.pipeline() as pipe:
            outcome = endings.again_or_failed(job, self.queue, self.settings, pipe, "storage_unavailable",
                                              f"The result store could not be written ({why})")
            endings.let_go(pipe, self.queue.name, keys.claims_key(self.name), job.id, work.fence.key)
            pipe.execute()
        return Ended(job.id, outcome, run_seconds(job))


_busy = False  # finishing a batch now
_stop_requested = False


def _stop_when_idle(signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a supervisor stopping the whole group): end now if idle, else after this batch."""
    global _stop_requested
    _stop_requested = True
    if not _busy:
        raise SystemExit(0)


def _connected(settings: Settings, worker_name: str) -> Finishing:
    """The finishing side, once Redis answers: RQ's worker names its connection at start, so a
    finisher started while Redis is away (during a failover) waits for it rather than exit."""
    deadline = time.monotonic() + CONNECT_FOR_S
    while True:
        try:
            return Finishing(job_queue(connect_worker(settings), settings), settings, worker_name)
        except RedisError as exc:
            if time.monotonic() > deadline:
                raise
            log.warning("Redis is away (%s); the finishing process retries", exc)
            time.sleep(0.5)  # a back-off between connection attempts, not a wait for a condition


def serve(connection: Connection, settings: Settings, worker_name: str) -> None:
    """The finishing process: finish each batch handed over until the worker says stop or is gone."""
    global _busy
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl+C reaches the group: the worker decides
    signal.signal(signal.SIGTERM, _stop_when_idle)
    logs.configure(settings, "finisher")
    finishing = _connected(settings, worker_name)
    connection.send(Ready())
    while not _stop_requested:
        try:
            message: ToFinisher = connection.recv()
        except EOFError:
            return  # the worker is gone
        if isinstance(message, Stop):
            return
        _busy = True
        try:
            connection.send(Finished(finishing.finish(message)))
        finally:
            _busy = False
