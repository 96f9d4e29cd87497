"""The worker's stop signals: the first SIGTERM stops taking jobs, the second stops the running one."""

from __future__ import annotations

import faulthandler
import logging
import signal
import threading
from types import FrameType

log = logging.getLogger(__name__)

# Process-wide on purpose: a signal reaches the process, not an object.
stopping = threading.Event()
interrupting = threading.Event()


def install(stop_timeout_s: float | None) -> None:
    """Handle SIGTERM and SIGINT: warm stop first, then interrupt (or after ``stop_timeout_s``); and
    SIGUSR1: every thread's stack to stderr, to see where a worker that seems stuck is."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def handle(signum: int, frame: FrameType | None) -> None:
        if stopping.is_set():
            log.warning("second stop signal: interrupting the running job, it goes back to the queue")
            interrupting.set()
            return
        log.info("stop requested: finishing the running job, taking no new one")
        stopping.set()
        if stop_timeout_s is not None:
            timer = threading.Timer(stop_timeout_s, interrupting.set)
            timer.daemon = True
            timer.start()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
