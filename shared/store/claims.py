"""Claiming jobs so that none is lost when a worker dies, and recovering a dead worker's claims.

A worker moves a job id from the waiting line into its own claims list in one script, so the id
is always in exactly one place: there is no gap between the pop and the registration. The
worker keeps an ``alive`` key fresh while it lives; the claims of a worker whose key has
expired are recovered by any other worker: each job runs again, up to SLOTQ_MAX_ATTEMPTS starts
in all, then ends ``failed`` with ``worker_lost``. Recovering a claim also revokes the attempt's
fence, so a worker presumed dead that comes back cannot write to the job again (shared/store/fencing.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

from redis import WatchError
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.queue import Queue

from shared.contract import keys
from shared.contract.jobs import Outcome
from shared.contract.models import Family
from shared.contract.settings import Settings
from shared.store import endings, fencing, waiting, workers
from shared.store.connection import text

log = logging.getLogger(__name__)
RECOVER_EVERY_S = 1.0
FENCE_MARGIN_S = 600  # a fence outlives the job timeout by this much: time to store the images


@dataclass(frozen=True)
class Holding:
    """What a worker holds, for its next claim to prefer: the model and adapters key it ran last,
    the adapters resident in that model's pipeline, and every model on its device."""

    model: str = ""
    adapters: str = ""
    resident: tuple[str, ...] = ()
    on_device: tuple[str, ...] = ()


class Claims:
    """One worker's claims on the lines of the models it serves."""

    def __init__(self, queue: Queue, settings: Settings, worker: str) -> None:
        self.queue, self.settings, self.worker = queue, settings, worker
        self.connection = queue.connection
        self.models = settings.served_models
        self.lines = [settings.line_of(model) for model in self.models]
        self.key = keys.claims_key(worker)
        self._recovered_at = 0.0
        # The claims this process is working on (one running, one being finished): never leftovers.
        self._held: set[str] = set()
        self.identity: workers.WorkerIdentity | None = None

    def describe(self, host: str | None, pid: int | None, device: str, family: Family,
                 loras: list[str], on_device: list[str] | None = None) -> None:
        """Say where this worker runs and what it holds (``family`` and ``loras``: of its first model;
        ``on_device``: the models on its device now); each heartbeat from now on carries it (GET
        /v1/workers, GET /v1/models). Said again as the models on its device change."""
        first = self.models[0]
        self.identity = workers.WorkerIdentity(
            name=self.worker, queue=self.queue.name, host=host, pid=pid, device=device, model=first,
            checkpoint=self.settings.source_of(first), family=family, loras=loras,
            models=self.models if len(self.models) > 1 else [],
            on_device=on_device if on_device is not None else [first], compile=self.settings.compile)

    def describe_capacity(self, pixels: int | None, device_memory: int | None, free_after_load: int | None
                          ) -> None:
        """Say how large a job this worker can run (worker/capacity.py; the next heartbeat carries it)."""
        facts = {"capacity_pixels": pixels, "device_memory": device_memory,
                 "free_after_load": free_after_load}
        if self.identity is not None and any(getattr(self.identity, name) != value
                                             for name, value in facts.items()):
            self.identity = self.identity.model_copy(update=facts)

    def describe_holding(self, on_device: tuple[str, ...], places: list[workers.ModelPlace]) -> None:
        """Say which models are on this worker's device now, and where each of them is since when
        (the next heartbeat carries it)."""
        if self.identity is not None and (list(on_device), places) != (self.identity.on_device,
                                                                        self.identity.model_places):
            self.identity = self.identity.model_copy(update={"on_device": list(on_device),
                                                             "model_places": places})

    def beat(self) -> workers.Beat:
        """Tell the others this worker lives, where it runs and which jobs it holds; whether an
        operator asked it to drain, or holds it."""
        if self.identity is None:
            raise RuntimeError("describe() the worker before its first heartbeat")
        return workers.beat(self.connection, self.identity, self.settings.heartbeat_ttl_s)

    def claim(self, timeout: float | None, holding: Holding = Holding()) -> waiting.Claimed | None:
        """Move the next waiting job id of this worker's lines into its claims and start an attempt
        at it (its fence token is the claim's); None when there is none.
        ``holding``: what this worker holds, for affinity (SLOTQ_AFFINITY_MAX_SKIP)."""
        lines, affinity = self._lines(holding), self._affinity(holding)
        claimed = waiting.claim(self.connection, lines, self.key, affinity, self.fence_ttl_s)
        if claimed is None and timeout is not None:
            waiting.wait_for_work(self.connection, lines, timeout)
            claimed = waiting.claim(self.connection, lines, self.key, affinity, self.fence_ttl_s)
        return self._noted(claimed)

    def claim_from(self, line: str) -> waiting.Claimed | None:
        """Claim the next job of one of this worker's lines, without affinity (a preemption takes the
        highest class's first); None when none waits."""
        return self._noted(waiting.claim(self.connection, line, self.key, None, self.fence_ttl_s))

    def send_claim(self, holding: Holding = Holding()) -> waiting.SentClaim:
        """:meth:`claim` sent now, waiting for nothing: :meth:`received` reads what it took."""
        return waiting.send_claim(self.connection, self._lines(holding), self.key, self._affinity(holding),
                                  self.fence_ttl_s)

    def received(self, sent: waiting.SentClaim) -> waiting.Claimed | None:
        """What a claim sent earlier took; None when nothing waited."""
        return self._noted(sent.claimed())

    def claim_compatible(self, like: waiting.Claimed, count: int, window: int,
                         by: Literal["batch", "join"] = "batch") -> list[waiting.Claimed]:
        """Claim up to ``count`` more waiting jobs that may share a batch with ``like`` (``by``: its
        batch key, or its join key for the step-level loop)."""
        claimed = waiting.claim_compatible(self.connection, like.line or self.lines[0], self.key, like,
                                           count, window, self.fence_ttl_s, by)
        self._held.update(member.job_id for member in claimed)
        return claimed

    def send_join(self, like: waiting.Claimed, count: int, window: int) -> waiting.SentCompatible | None:
        """A join's claim for the step-level loop, sent now, waiting for nothing: jobs of ``like``'s
        class and join key, passing none over more than SLOTQ_AFFINITY_MAX_SKIP times.
        :meth:`received_compatible` reads what it took (until then, a claim it made is a leftover)."""
        return waiting.send_claim_compatible(self.connection, like.line or self.lines[0], self.key, like,
                                             count, window, self.fence_ttl_s, "join",
                                             self.settings.affinity_max_skip)

    def received_compatible(self, sent: waiting.SentCompatible) -> list[waiting.Claimed]:
        """What a claim sent earlier took, noted as held."""
        claimed = sent.claimed()
        self._held.update(member.job_id for member in claimed)
        return claimed

    def _noted(self, claimed: waiting.Claimed | None) -> waiting.Claimed | None:
        """The claimed job, noted as held by this worker (until its end or release)."""
        if claimed is not None:
            self._held.add(claimed.job_id)
        return claimed

    def _lines(self, holding: Holding) -> list[str]:
        """This worker's lines, that of the model it ran last first."""
        if holding.model not in self.models[1:]:
            return self.lines
        last = self.settings.line_of(holding.model)
        return [last, *(line for line in self.lines if line != last)]

    def _affinity(self, holding: Holding) -> waiting.Affinity:
        """What a claim prefers: the model and adapters this worker ran last, its resident adapters
        and the models on its device, within SLOTQ_AFFINITY_MAX_SKIP."""
        on_device = tuple(self.settings.line_of(model) for model in holding.on_device)
        return waiting.Affinity(self.settings.affinity_max_skip, holding.adapters, holding.resident,
                                on_device)

    @property
    def fence_ttl_s(self) -> int:
        """How long the fence of an attempt this worker starts lasts: the job's run and its end."""
        longest = max(self.settings.job_timeout_of(model) for model in self.settings.served_models)
        return longest + FENCE_MARGIN_S

    def wait_for_work(self, timeout: float) -> None:
        """Block until a job may have arrived in any of this worker's lines, or the timeout passes."""
        waiting.wait_for_work(self.connection, self.lines, timeout)

    def unhold(self, job_id: str) -> None:
        """This process is done with the job: a claim on it still in the list is a leftover."""
        self._held.discard(job_id)

    def release(self, job_id: str) -> None:
        """Drop a claim once the job's end is recorded."""
        self.connection.lrem(self.key, 1, job_id)
        self.unhold(job_id)

    def gone(self) -> None:
        """Say this worker is gone: others recover any claim it still holds right away."""
        self.connection.delete(keys.alive_key(self.worker))
        if not self.connection.llen(self.key):
            for line in self.lines:
                self.connection.srem(keys.workers_key(line), self.worker)

    def recover(self) -> int | None:
        """Recover this worker's leftover claims and those of dead workers; how many jobs moved.

        Runs at most once a second; None when it did not run this time.
        """
        if time.monotonic() - self._recovered_at < RECOVER_EVERY_S:
            return None
        self._recovered_at = time.monotonic()
        moved = 0
        for line in self.lines:
            for raw in self.connection.smembers(keys.workers_key(line)):
                moved += self._recover_worker(line, text(raw))
        return moved

    def _recover_worker(self, line: str, worker: str) -> int:
        """Recover a worker's claims if it is dead, or this worker's leftovers; how many jobs moved."""
        if worker != self.worker and self.connection.exists(keys.alive_key(worker)):
            return 0
        claims_key, moved = keys.claims_key(worker), 0
        if worker != self.worker:
            self.connection.hdel(keys.running_key(line), worker)  # it runs nothing now
        # Of this worker's own claims, those it is not working on are leftovers.
        held = set(self._held) if worker == self.worker else set()
        for job_id in self.connection.lrange(claims_key, 0, -1):
            if text(job_id) not in held:
                moved += self._recover_one(claims_key, text(job_id))
        if worker != self.worker and not self.connection.llen(claims_key):
            self.connection.srem(keys.workers_key(line), worker)
        return moved

    def recover_now(self, job_id: str) -> None:
        """Settle one of this worker's own claims without running it: back to the queue, or dropped."""
        self._recover_one(self.key, job_id)
        self.unhold(job_id)

    def _recover_one(self, claims_key: str, job_id: str) -> int:
        with self.connection.pipeline() as pipe:
            try:
                # Two workers may recover the same dead list; WATCH lets exactly one act.
                pipe.watch(claims_key)
                if pipe.lpos(claims_key, job_id) is None:
                    return 0
                job = self._fetch(job_id)
                pipe.multi()
                pipe.lrem(claims_key, 1, job_id)
                fencing.revoke(pipe, job_id)  # whoever ran it may not write to it any more
                outcome = (endings.settle_abandoned(job, self.queue, self.settings, pipe) if job is not None
                           else Outcome.MISSING)
                pipe.execute()
            except WatchError:
                return 0
        log.warning("recovered job %s from %s: %s", job_id, claims_key, outcome.value)
        return 1

    def _fetch(self, job_id: str) -> Job | None:
        try:
            return Job.fetch(job_id, connection=self.connection, serializer=self.queue.serializer)
        except NoSuchJobError:
            return None
