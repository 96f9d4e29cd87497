"""Which workers live, where, and on which jobs: the heartbeat record a worker writes and the API reads.

Each heartbeat rewrites the worker's ``alive`` key as one JSON record with the heartbeat's TTL, so
the record and the liveness are one key: a record is listed exactly while the worker counts as
alive for recovery. Its state and jobs are read from the worker's claims list by the same script,
so the worker adds no write between GPU jobs for them; they lag by at most one heartbeat.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis import Redis

from shared.contract import keys
from shared.contract.models import Family, ModelInfo, model_info
from shared.store import scripts
from shared.store.connection import text


class WorkerIdentity(BaseModel):
    """What a worker's heartbeat says that does not change while it lives."""

    model_config = ConfigDict(frozen=True)

    name: str
    queue: str = Field(description="SLOTQ_QUEUE_NAME: the queue its jobs name as their origin.")
    host: str | None = Field(description="The worker's host name (in a container: the container's).")
    pid: int | None
    device: str = Field(description="The torch device the model is on, e.g. `cuda:1` or `cpu`.")
    model: str = Field(description="The name of the model it serves (SLOTQ_MODEL_NAME), the first of "
                                   "`models` where it serves several.")
    checkpoint: str | None = Field(None, description="What it loaded for `model`: a path or a hub id.")
    family: Family | None = Field(None, description="The family of `model` (`sd`, `sdxl`, `flux`).")
    loras: list[str] = Field(default_factory=list, description="The LoRA adapters it can load for `model`.")
    models: list[str] = Field(default_factory=list, description="Every model it serves, where it serves "
                                                                "several (SLOTQ_WORKER_MODELS); else empty.")
    on_device: list[str] = Field(default_factory=list, description="The models on its device now, the one "
                                                                   "it ran last first.")
    compile: str = Field("off", description="Its SLOTQ_COMPILE: `off`, `regional` or `full`.")
    capacity_pixels: int | None = Field(None, description="The most pixels x images one execution may make "
                                                          "on it (SLOTQ_CAPACITY_PIXELS, or fitted on a "
                                                          "GPU from its jobs' peak memory); null: no bound "
                                                          "known.")
    device_memory: int | None = Field(None, description="Its device's memory in bytes (a GPU's), if any.")
    free_after_load: int | None = Field(None, description="The device memory free once its model was "
                                                          "loaded, in bytes.")

    @property
    def lines(self) -> list[str]:
        """The lines it claims from: its models'."""
        return [keys.line_name(self.queue, model) for model in self.models or [self.model]]


class WorkerView(WorkerIdentity):
    """A live worker as ``GET /v1/workers`` shows it: ids of the jobs it holds, never their contents."""

    state: Literal["idle", "busy"] = Field(description="`busy` while the worker holds a job.")
    current_jobs: list[str] = Field(default_factory=list,
                                    description="The jobs it runs or is storing the images of.")
    last_beat_at: datetime


def beat(connection: Redis, identity: WorkerIdentity, ttl_s: float) -> None:
    """Refresh a worker's liveness and its record in one round trip."""
    name = identity.name
    # cjson would write an empty list back as {}: a worker with no adapters leaves them out.
    empty = {field for field in ("loras", "models", "on_device") if not getattr(identity, field)}
    record = identity.model_dump_json(exclude=empty or None)
    scripts.run(connection, "beat",
                [keys.alive_key(name), keys.claims_key(name), *map(keys.workers_key, identity.lines)],
                [int(ttl_s * 1000), record, name])


def live_workers(connection: Redis, line: str) -> list[WorkerView]:
    """The workers of a line whose heartbeat has not expired, by name."""
    names = sorted(text(raw) for raw in connection.smembers(keys.workers_key(line)))
    if not names:
        return []
    views = []
    for raw in connection.mget([keys.alive_key(name) for name in names]):
        if raw is None:
            continue  # expired (a dead worker whose claims wait for recovery) or gone
        try:
            view = WorkerView.model_validate_json(raw)
        except ValidationError:
            continue  # a worker of an older version keeps only "1" there: alive, but it says no more
        if line in view.lines:  # a fixed name may be reused on another line
            views.append(view)
    return views


def live_model(connection: Redis, line: str, name: str) -> ModelInfo | None:
    """The model of this name as the live workers of its line hold it; None while none does. A worker
    serving several models describes its first alone: of the others, it says only that it serves
    them and which it holds on its device, and None is answered where no worker describes the model."""
    views = [view for view in live_workers(connection, line) if view.family is not None]  # older: silent
    own = [view for view in views if view.model == name]
    if not own:
        return None
    loras = sorted({lora for view in own for lora in view.loras})
    return model_info(name, own[0].family or "sd", loras, own[0].checkpoint, [view.name for view in views],
                      held_by(views, name), capacity_of(views))


def serving(connection: Redis, line: str, name: str) -> tuple[list[str], list[str], int | None]:
    """The live workers that serve the model of this name, those of them that hold it on their
    device now, and the largest job they can run (:func:`capacity_of`)."""
    views = [view for view in live_workers(connection, line) if view.family is not None]
    return [view.name for view in views], held_by(views, name), capacity_of(views)


def capacity_of(views: list[WorkerView]) -> int | None:
    """The most pixels x images one job may make on any of these workers; None where one of them
    reports no bound, or none lives (admission then refuses nothing for size)."""
    bounds = [view.capacity_pixels for view in views]
    if not bounds or None in bounds:
        return None
    return max(bound for bound in bounds if bound is not None)


def held_by(views: list[WorkerView], name: str) -> list[str]:
    """Which of these workers hold the model of this name on their device now."""
    return [view.name for view in views if name in (view.on_device or [view.model])]
