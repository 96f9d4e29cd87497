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
    model: str = Field(description="The name of the model it serves (SLOTQ_MODEL_NAME).")
    checkpoint: str | None = Field(None, description="What it loaded: SLOTQ_MODEL, a path or a hub id.")
    family: Family | None = Field(None, description="The model's family (`sd`, `sdxl`, `flux`).")
    loras: list[str] = Field(default_factory=list, description="The LoRA adapters it can load.")

    @property
    def line(self) -> str:
        """The line it claims from: its model's."""
        return keys.line_name(self.queue, self.model)


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
    record = identity.model_dump_json(exclude=None if identity.loras else {"loras"})
    scripts.run(connection, "beat",
                [keys.alive_key(name), keys.claims_key(name), keys.workers_key(identity.line)],
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
        if view.line == line:  # a fixed name may be reused on another line
            views.append(view)
    return views


def live_model(connection: Redis, line: str, name: str) -> ModelInfo | None:
    """The model of this name as the live workers of its line hold it; None while none does."""
    views = [view for view in live_workers(connection, line) if view.family is not None]  # older: silent
    if not views:
        return None
    loras = sorted({lora for view in views for lora in view.loras})
    return model_info(name, views[0].family or "sd", loras, views[0].checkpoint,
                      [view.name for view in views])
