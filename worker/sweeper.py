"""The sweep of a file store or a bucket: what no live record points to is deleted, at least once a minute.

A folder or a bucket keeps what is written to it (``shared/store/results.py``); every worker runs
this thread, and each interval one of them (whichever takes the turn, a ``SET NX`` that lapses
with the interval) lists the store and deletes the images and inputs that have outlived their
records, and the writes of attempts that were never recorded.
"""

from __future__ import annotations

import logging
import threading

from redis import Redis
from redis.exceptions import RedisError

from shared.contract import keys
from shared.contract.errors import StorageUnavailableError
from shared.contract.settings import Settings
from shared.store import results

log = logging.getLogger(__name__)


class Sweeper:
    """A thread that sweeps the result store every SLOTQ_SWEEP_INTERVAL_S, on one worker at a time."""

    def __init__(self, connection: Redis, settings: Settings, worker_name: str) -> None:
        self.connection, self.settings, self.worker_name = connection, settings, worker_name
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sweeper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.settings.sweep_interval_s):
            try:
                self.sweep_once()
            except (RedisError, StorageUnavailableError) as exc:  # the next turn tries again
                log.warning("could not sweep the result store: %s", exc)
            except Exception:
                log.exception("the sweep of the result store failed")

    def sweep_once(self) -> int:
        """Sweep if this worker has the turn of this interval; how many objects went."""
        turn, key = int(self.settings.sweep_interval_s * 1000), keys.sweep_key(self.settings.queue_name)
        if not self.connection.set(key, self.worker_name, nx=True, px=turn):
            return 0
        return results.of(self.settings).sweep(self.connection)
