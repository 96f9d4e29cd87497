"""Which steps the GPU section reports: each report is a round trip (shared/store/records.py's
``report_progress``) inside the GPU section, and the moment a cancel is seen. The last step is
not among them: the finishing process records it with the job's end."""

from __future__ import annotations

import time
from collections.abc import Callable


class Cadence:
    """Which steps to report: the first always, any other but the last once ``interval_s`` has
    passed since the last report (as tqdm's ``mininterval``). A report is a round trip inside the
    GPU section, and it is also when a cancel is seen."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.clock = interval_s, clock
        self.last: float | None = None

    def due(self, step: int, total: int) -> bool:
        if step == total and step:
            return False  # recorded with the end, in the finishing process
        now = self.clock()
        if step == 0 or self.last is None or now - self.last >= self.interval_s:
            self.last = now
            return True
        return False
