"""When a worker lets go of its device, and when it takes it again.

Three reasons, read at each job boundary of the main loop: it has been idle SLOTQ_IDLE_RELEASE_S; an
operator holds it (``POST /v1/admin/workers/<name>/release``, read by the heartbeat); or, on a GPU,
another program took the device's memory, so that what is free fell below SLOTQ_YIELD_BELOW_MB. Held
or yielding, it claims nothing; letting go itself is worker/models.py's ``release``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch

from shared.contract.settings import Settings

log = logging.getLogger(__name__)
MB = 2**20


class DeviceSharing:
    """One worker's reasons to keep its device free."""

    def __init__(self, settings: Settings, device: torch.device,
                 free_memory: Callable[[], int] | None = None, held_memory: Callable[[], int] | None = None
                 ) -> None:
        """``free_memory`` and ``held_memory``: the device's free bytes, and this process's, read as
        needed (CUDA's by default)."""
        self.idle_release_s = settings.idle_release_s
        on_gpu = str(device).startswith("cuda")  # a benchmark's stand-in pipeline names no torch device
        self.yield_below = settings.yield_below_mb * MB if on_gpu else 0
        self._free = free_memory or (lambda: torch.cuda.mem_get_info(device)[0])
        self._held = held_memory or (lambda: torch.cuda.memory_reserved(device))
        self.held = threading.Event()  # an operator's hold, as the last heartbeat read it
        self.last_busy = time.monotonic()
        self._back_at: int | None = None  # while yielding: the free bytes to come back at

    def busy(self) -> None:
        """An execution just ended: the idle time counts from now."""
        self.last_busy = time.monotonic()

    def idle_due(self) -> bool:
        """Whether the worker has been idle for SLOTQ_IDLE_RELEASE_S (never where it is 0)."""
        return bool(self.idle_release_s) and time.monotonic() - self.last_busy >= self.idle_release_s

    def keep_free(self) -> str | None:
        """Why the device is to stay free now (``held``, ``yielding``), or None: the worker claims."""
        if self.held.is_set():
            return "held"
        return "yielding" if self._yielding() else None

    def _yielding(self) -> bool:
        """Whether another program needs the device: its free memory fell below SLOTQ_YIELD_BELOW_MB.
        Once yielding, until as much is free again as this worker held besides, so that taking its
        models back does not at once make it yield again."""
        if not self.yield_below:
            return False
        free = self._free()
        if self._back_at is None:
            if free >= self.yield_below:
                return False
            self._back_at = self.yield_below + self._held()
            log.warning("yielding the device: %d MB free, below SLOTQ_YIELD_BELOW_MB=%d; back at %d MB free",
                        free // MB, self.yield_below // MB, self._back_at // MB)
            return True
        if free < self._back_at:
            return True
        log.info("taking the device again: %d MB free", free // MB)
        self._back_at = None
        return False
