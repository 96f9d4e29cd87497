"""An API process's slots of one kind (requests held waiting, event streams), and each tenant's share.

A process holds at most ``capacity`` of them at once; with API keys on, one tenant at most ``share``
of that (SLOTQ_TENANT_WAIT_SHARE, at least one slot), so that a key that holds all it can still
leaves the other tenants theirs. Without keys every caller is one tenant: the capacity alone applies.
"""

from __future__ import annotations

import threading
from collections import Counter
from enum import Enum


class Taken(Enum):
    """What asking for a slot came to."""

    TAKEN = "taken"
    FULL = "full"  # every slot of the process is held
    OVER_SHARE = "over_share"  # this tenant holds its share already


class Slots:
    """At most ``capacity`` held at once, at most ``share`` of them (rounded down, at least one) by one
    tenant."""

    def __init__(self, capacity: int, share: float = 1.0) -> None:
        self.capacity = capacity
        self.per_tenant = max(1, int(capacity * share))
        self._lock = threading.Lock()
        self._held = 0
        self._by_tenant: Counter[str] = Counter()

    def take(self, tenant: str | None) -> Taken:
        """Take a slot for this tenant (None: a service without keys), unless it may not."""
        with self._lock:
            if tenant is not None and self._by_tenant[tenant] >= self.per_tenant:
                return Taken.OVER_SHARE
            if self._held >= self.capacity:
                return Taken.FULL
            self._held += 1
            if tenant is not None:
                self._by_tenant[tenant] += 1
            return Taken.TAKEN

    def give(self, tenant: str | None) -> None:
        """Give back a slot that ``take`` gave this tenant."""
        with self._lock:
            if self._held <= 0 or (tenant is not None and self._by_tenant[tenant] <= 0):
                raise ValueError("a slot given back that was not taken")
            self._held -= 1
            if tenant is not None:
                self._by_tenant[tenant] -= 1
                if not self._by_tenant[tenant]:
                    del self._by_tenant[tenant]
