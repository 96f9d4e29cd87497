"""Finishing jobs off the GPU: a thread that encodes, stores and records while the next job runs.

The worker's main thread holds the GPU only for the pipeline call, then hands the images here and
takes the next job at once. A hand-off waits until the previous job is finished, so at most two
jobs' images are in memory (one being finished, one being made) and a slow finish slows the GPU
down instead of piling work up. A job stays in its
worker's claims until it is finished here, so a crash at any moment leaves it recoverable.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
Item = TypeVar("Item")


class Finisher(Generic[Item]):
    """One thread that runs ``finish`` on each item handed to it, in order."""

    def __init__(self, finish: Callable[[Item], None]) -> None:
        self._finish = finish
        self._items: queue.Queue[Item | None] = queue.Queue()
        self._free = threading.Semaphore(1)  # held from a hand-off until that item is finished
        self._thread = threading.Thread(target=self._run, name="finisher", daemon=True)
        self._thread.start()

    def submit(self, item: Item) -> None:
        """Hand one item over; blocks while the previous one is still being finished."""
        self._free.acquire()
        self._items.put(item)

    def wait(self) -> None:
        """Return once every item handed over is finished."""
        self._items.join()

    def close(self) -> None:
        """Finish what was handed over, then stop the thread."""
        self._items.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._items.get()) is not None:
            try:
                self._finish(item)
            except BaseException:  # a failed finish must not stop the next one
                log.exception("finishing a job failed")
            finally:
                self._items.task_done()
                self._free.release()
        self._items.task_done()
