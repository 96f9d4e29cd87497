"""What a worker keeps loaded of one kind (pipelines, ControlNets, adapters) by name, up to a capacity,
the least recently used going first.

Not ``functools.lru_cache``: its owner must see each eviction, to free the device's memory, unload an
adapter from its pipeline or move a pipeline to host memory, and must make room before it loads the
next one, not after.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Resident(Generic[K, V]):
    """Values by key, the least recently used first; each evicted passed to ``evicted`` as it goes."""

    def __init__(self, capacity: int, evicted: Callable[[K, V], None] | None = None) -> None:
        self.capacity = capacity
        self._evicted = evicted
        self._values: OrderedDict[K, V] = OrderedDict()

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[K]:
        """The keys, the least recently used first."""
        return iter(list(self._values))

    def __reversed__(self) -> Iterator[K]:
        """The keys, the most recently used first."""
        return iter(list(reversed(self._values)))

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def get(self, key: K) -> V | None:
        """The value of this key, now the most recently used; None where it is not held."""
        if key not in self._values:
            return None
        self._values.move_to_end(key)
        return self._values[key]

    def touch(self, key: K) -> None:
        """Make the key the most recently used (KeyError where it is not held)."""
        self._values.move_to_end(key)

    def put(self, key: K, value: V, keep: Container[K] = ()) -> list[K]:
        """Hold the value as the most recently used, evicting the least recently used beyond capacity
        (never this key nor those in ``keep``); the keys evicted."""
        self._values[key] = value
        self._values.move_to_end(key)
        return self._evict(lambda: len(self._values) > self.capacity, (key,), keep)

    def make_room(self, keep: Container[K] = ()) -> list[K]:
        """Evict the least recently used, but those in ``keep``, until one more fits within capacity
        (or none is left to evict); the keys evicted. Called before a load, so that the evicted free
        their memory first."""
        return self._evict(lambda: len(self._values) >= self.capacity, (), keep)

    def evict_all(self) -> list[K]:
        """Evict every value, the least recently used first; the keys evicted."""
        return self._evict(lambda: bool(self._values), (), ())

    def pop(self, key: K, default: V | None = None) -> V | None:
        """Take the key's value out, as no eviction (nothing is called back); ``default`` where it is
        not held."""
        return self._values.pop(key, default)

    def _evict(self, over: Callable[[], bool], this: tuple[K, ...], keep: Container[K]) -> list[K]:
        """Evict the least recently used not in ``this`` or ``keep`` while ``over()``."""
        evicted: list[K] = []
        while over():
            key = next((held for held in self._values if held not in this and held not in keep), None)
            if key is None:
                break  # what is kept stays, even over capacity
            value = self._values.pop(key)
            evicted.append(key)
            if self._evicted is not None:
                self._evicted(key, value)
        return evicted
