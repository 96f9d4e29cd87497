"""The device's time: when each recent GPU section began and ended, and their sum.

One account a worker: the pipelines it switches between share it (worker/models.py), so the duty
cycle and the busy seconds its metrics report (worker/metrics.py) are the device's, whichever model
ran, and last while it holds no pipeline at all.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class DeviceTime:
    """The GPU sections of one device, by time.perf_counter()."""

    sections: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=10_000))
    busy_s: float = 0.0  # the sum of every section, the warm-up's included
    running_since: float | None = None  # when the section in progress began

    @contextmanager
    def section(self) -> Iterator[None]:
        """A GPU section: its time counts in the duty cycle, a canceled or failed one's too."""
        began = self.running_since = time.perf_counter()
        try:
            yield
        finally:
            ended = time.perf_counter()
            self.sections.append((began, ended))
            self.busy_s += ended - began
            self.running_since = None
