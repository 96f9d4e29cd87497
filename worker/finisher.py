"""The worker's side of its finishing process: hand each execution's images over, act on the answer.

The worker's main thread holds the GPU only for the pipeline call, then hands the images here and
takes the next job at once. A hand-off waits until the previous one is answered, so at most two
executions' images are in flight (one being finished, one being made) and a slow finish slows the
GPU down instead of piling work up. A job stays in its worker's claims until its end is recorded,
so a crash of either process at any moment leaves it recoverable; a finishing process that dies
is replaced, and the jobs it held are let go for recovery to settle.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Generic, TypeVar

from shared.errors import WorkerFatalError
from shared.settings import Settings
from worker import finishing
from worker.finishing import Batch, Ended

log = logging.getLogger(__name__)
Handoff = TypeVar("Handoff")
START_TIMEOUT_S = 60.0
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

    def submit(self, handoff: Handoff, batch: Batch) -> None:
        """Hand one batch over; blocks while the previous one is still being finished."""
        self._free.acquire()
        if self._broken:
            self._free.release()
            raise WorkerFatalError(f"no finishing process: {self._broken}")
        with self._lock:
            self._pending, connection = handoff, self._connection
        try:
            connection.send(batch)
        except OSError:  # the process died meanwhile; unless its reader let go of the batch already
            self._lose(handoff)

    def close(self) -> None:
        """Let the last batch finish, then stop the process and the reader."""
        self._free.acquire()
        self._closing = True
        try:
            self._connection.send(None)
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
        self._process = context.Process(target=finishing.serve, name="slotq-finisher", daemon=True,
                                        args=(theirs, self._settings, self._worker_name))
        self._process.start()
        theirs.close()  # so that its death reads as end of file here
        # Ready before the worker takes a job, so that no GPU section waits on its start-up.
        if not self._connection.poll(START_TIMEOUT_S):
            self._process.kill()
            raise RuntimeError(f"the finishing process did not start within {START_TIMEOUT_S:.0f} s")
        try:
            if self._connection.recv() != finishing.READY:
                raise RuntimeError("the finishing process said something else than that it is ready")
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the finishing process exited at start ({self._process.exitcode})") from None

    def _read(self) -> None:
        while True:
            connection: Connection = self._connection
            try:
                ended = connection.recv()
            except (EOFError, OSError):
                connection.close()
                if self._closing or not self._replace():
                    return
                continue
            with self._lock:
                handoff, self._pending = self._pending, None
            try:
                self._on_ended(handoff, ended)  # type: ignore[arg-type]
            except BaseException:  # a fault here must not stop the next batch's answer
                log.exception("handling the end of finished jobs failed")
            finally:
                self._free.release()

    def _replace(self) -> bool:
        """The process died: start another, and let go of the batch it held; whether one runs."""
        self._process.join()
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
