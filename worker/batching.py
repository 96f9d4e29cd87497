"""Dynamic batching: gathering waiting jobs that can share one GPU execution with a claimed one.

Jobs with the same size, steps, guidance, sampler and images per job (and model: one line) run as
one batch: still one GPU execution at a time. A batch holds at most SLOTQ_MAX_BATCH jobs and never
more pixels than the largest single job allowed (SLOTQ_MAX_SIDE² × 4 images) nor than the worker's
capacity where it knows it, so batching cannot ask the device for more memory than one job may.
Companions are taken from the first job's class only, among the first few of that class: a bounded
step out of line, in exchange for the throughput of one execution for several jobs.
"""

from __future__ import annotations

import time
from typing import Literal

from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings
from shared.store.claims import Claims
from shared.store.waiting import Claimed
from worker import lifecycle

WINDOW_PER_PLACE = 4  # how far into its class a batch looks for companions, per place in it


def room(settings: Settings, first: Claimed, capacity: int | None = None) -> int:
    """How many more jobs may join ``first``'s batch; ``capacity``: the pixels x images one execution
    may make on this worker (worker/capacity.py), where it knows."""
    key = first.record.get(b"batch", b"").decode()
    if settings.max_batch <= 1 or not key:
        return 0
    fits = pixel_bound(settings, capacity) // JobRequest.pixels_of_batch_key(key)
    return max(0, min(settings.max_batch, fits) - 1)


def pixel_bound(settings: Settings, capacity: int | None) -> int:
    """The most pixels x images one execution may make: the largest single job's, and no more than
    the worker's ``capacity`` where it knows it."""
    return settings.batch_pixels if capacity is None else min(settings.batch_pixels, capacity)


def gather(claims: Claims, settings: Settings, first: Claimed, capacity: int | None = None,
           by: Literal["batch", "join"] = "batch") -> list[Claimed]:
    """Companions for ``first``: compatible jobs (``by`` their batch key, or their join key for the
    step-level loop) waiting now, or arriving within SLOTQ_BATCH_WAIT_MS, no more than the worker's
    ``capacity`` allows in one execution."""
    wanted = room(settings, first, capacity)
    if not wanted:
        return []
    deadline = time.monotonic() + settings.batch_wait_ms / 1000
    gathered: list[Claimed] = []
    while True:
        gathered += claims.claim_compatible(first, wanted - len(gathered),
                                            window=WINDOW_PER_PLACE * settings.max_batch, by=by)
        left = deadline - time.monotonic()
        if len(gathered) >= wanted or left <= 0 or lifecycle.stopping.is_set():
            return gathered
        claims.wait_for_work(left)
