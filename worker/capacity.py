"""How large a job this worker can run, for admission to refuse one that no live worker could run
(422 too_large_for_workers) rather than let it wait in line and fail ``out_of_memory``.

On a GPU the bound is fitted from what the worker's executions used: each one's peak device memory
against its pixels x images, a line through the peaks (or, from a single size, through the memory its
weights hold once loaded), extended to the device's memory less a margin. SLOTQ_CAPACITY_PIXELS sets
the bound instead (an operator who knows the card; the tests on the CPU). On the CPU, with no setting,
no bound is reported: host memory is shared with everything else and swaps rather than failing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MARGIN = 0.9  # of the device's memory: the allocator's fragmentation and the other processes' share
MAX_POINTS = 64  # the largest peak per size, for this many sizes


@dataclass
class Capacity:
    """The peaks seen per pixels x images, and the bound fitted to them."""

    total: int | None = None  # the device's memory in bytes (None: not a GPU)
    after_load: int = 0  # what the loaded weights hold, in bytes
    free_after_load: int | None = None
    setting: int | None = None  # SLOTQ_CAPACITY_PIXELS
    peaks: dict[int, int] = field(default_factory=dict)  # pixels x images -> the largest peak seen

    @classmethod
    def of(cls, device: torch.device, setting: int | None) -> Capacity:
        """The capacity of a worker whose model is loaded on ``device`` now."""
        if device.type != "cuda":
            return cls(setting=setting)
        free, total = torch.cuda.mem_get_info(device)
        return cls(total=total, after_load=torch.cuda.memory_allocated(device), free_after_load=free,
                   setting=setting)

    def observe(self, pixels: int, peak: int) -> None:
        """An execution of this many pixels x images peaked at ``peak`` bytes of device memory."""
        if pixels in self.peaks or len(self.peaks) < MAX_POINTS:
            self.peaks[pixels] = max(peak, self.peaks.get(pixels, 0))

    @property
    def pixels(self) -> int | None:
        """The most pixels x images one execution may make; None where no bound is known."""
        if self.setting is not None:
            return self.setting
        if self.total is None or not self.peaks:
            return None
        base, per_pixel = fit(self.peaks, self.after_load)
        if per_pixel <= 0:
            return None
        return max(0, int((MARGIN * self.total - base) / per_pixel))


def fit(peaks: dict[int, int], after_load: int) -> tuple[float, float]:
    """Peak memory as ``base + per_pixel * pixels``: least squares through the peaks of two sizes or
    more; from one size, the line through it and the loaded weights at no pixels."""
    if len(peaks) == 1:
        ((pixels, peak),) = peaks.items()
        return float(after_load), (peak - after_load) / pixels
    count = len(peaks)
    mean_x = sum(peaks) / count
    mean_y = sum(peaks.values()) / count
    spread = sum((x - mean_x) ** 2 for x in peaks)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in peaks.items()) / spread
    return mean_y - slope * mean_x, slope
