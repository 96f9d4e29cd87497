"""The benchmarks' statistics: medians, percentiles, paired-round ratios and timed calls."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")


def median(values: Iterable[float]) -> float:
    """The median (the mean of the middle two of an even count)."""
    return statistics.median(values)


def percentile(values: Iterable[float], share: float) -> float:
    """The ``share`` (0 to 1) percentile, interpolated between the nearest ranks."""
    ordered = sorted(values)
    if len(ordered) < 2:
        return ordered[0]
    position = share * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def percentiles(values: Iterable[float], *shares: float) -> tuple[float, ...]:
    """Several percentiles of the same values (p50, p95 and p99 unless ``shares`` says)."""
    ordered = sorted(values)
    return tuple(percentile(ordered, share) for share in shares or (0.5, 0.95, 0.99))


def ratios(figures: Sequence[float], baselines: Sequence[float]) -> list[float]:
    """Each round's figure over the baseline of the same round."""
    return [figure / baseline for figure, baseline in zip(figures, baselines, strict=True)]


def paired_ratio(figures: Sequence[float], baselines: Sequence[float]) -> float:
    """The median of the per-round ratios: a slow spell of the machine lands on both sides of one."""
    return median(ratios(figures, baselines))


def median_item(items: Sequence[T], key: Callable[[T], float]) -> T:
    """The item whose ``key`` is the median (the upper middle one of an even count)."""
    return sorted(items, key=key)[len(items) // 2]


def timed(call: Callable[[], object], count: int, warm_ups: int = 1) -> list[float]:
    """Seconds of each of ``count`` calls, after ``warm_ups`` untimed ones."""
    for _ in range(warm_ups):
        call()
    times = []
    for _ in range(count):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return times
