"""Which workers live, where, and on which jobs: the heartbeat record a worker writes and the API reads.

Each heartbeat rewrites the worker's ``alive`` key as one JSON record with the heartbeat's TTL, so
the record and the liveness are one key: a record is listed exactly while the worker counts as
alive for recovery. Its state and jobs are read from the worker's claims list by the same script,
so the worker adds no write between GPU jobs for them; they lag by at most one heartbeat.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from redis import Redis

from shared.contract import keys
from shared.contract.models import Family, ModelInfo, model_info
from shared.store import scripts
from shared.store.connection import text

Place = Literal["on_device", "in_host", "released"]


class ModelPlace(BaseModel):
    """Where one of a worker's models is, and since when."""

    model_config = ConfigDict(frozen=True)

    model: str
    place: Place = Field(description="`on_device`: ready to run; `in_host`: moved to host memory, back on "
                                     "the device in a moment; `released`: in neither (let go, or not "
                                     "loaded yet): its next job loads it from disk.")
    since: datetime


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
    model_places: list[ModelPlace] = Field(default_factory=list, description="Where each model it serves "
                                                                             "is, and since when.")
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

    state: Literal["idle", "busy", "held"] = Field(description="`busy` while the worker holds a job; "
                                                           "`held` while an operator's hold keeps it "
                                                           "from claiming, once its jobs are done.")
    current_jobs: list[str] = Field(default_factory=list,
                                    description="The jobs it runs or is storing the images of.")
    held: bool = Field(False, description="Whether an operator's hold keeps it from claiming "
                                          "(`POST /v1/admin/workers/{name}/release`).")
    held_until: datetime | None = Field(None, description="When that hold lapses; null: until resumed.")
    last_beat_at: datetime


class WorkerHold(BaseModel):
    """What ``POST /v1/admin/workers/<name>/release`` asks: how long the worker keeps its device free."""

    model_config = ConfigDict(extra="forbid")

    hold_s: float | None = Field(None, gt=0, le=7 * 86_400, description="Seconds the worker claims "
                                 "nothing after letting go; absent: until `.../resume`.")


class WorkerDrain(BaseModel):
    """What ``POST /v1/admin/workers/<name>/drain`` asks: whether the drained worker exits."""

    model_config = ConfigDict(extra="forbid")

    exit: bool = Field(True, description="Exit once the running execution is done; false: stay, claiming "
                                         "nothing, until `.../resume` (a hold).")


class Beat(NamedTuple):
    """What a heartbeat learned: whether an operator asked the worker to drain, or holds it."""

    drain: bool
    held: bool


def beat(connection: Redis, identity: WorkerIdentity, ttl_s: float) -> Beat:
    """Refresh a worker's liveness and its record in one round trip; whether an operator asked it to
    drain (:func:`drain`) since its last beat, and whether an operator holds it (:func:`hold`)."""
    name = identity.name
    # cjson would write an empty list back as {}: a worker with no adapters leaves them out.
    empty = {field for field in ("loras", "models", "on_device", "model_places")
             if not getattr(identity, field)}
    record = identity.model_dump_json(exclude=empty or None)
    drain, held = scripts.run(connection, "beat", [keys.alive_key(name), keys.claims_key(name),
                                                   *map(keys.workers_key, identity.lines)],
                              [int(ttl_s * 1000), record, name])
    return Beat(drain == 1, held == 1)


def held_jobs(connection: Redis, line: str) -> list[str]:
    """The ids the live workers of a line hold now (their claims lists: running, or being stored),
    without waiting for a heartbeat to report them."""
    names = [view.name for view in live_workers(connection, line)]
    with connection.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.lrange(keys.claims_key(name), 0, -1)
        held = pipe.execute()
    return sorted({text(raw) for ids in held for raw in ids})


def drain(connection: Redis, name: str, within_s: float) -> bool:
    """Ask a live worker to drain: finish its execution, claim nothing more and exit, as after
    SIGTERM. False where no live worker has this name; a request its heartbeat does not take within
    ``within_s`` lapses."""
    if not connection.exists(keys.alive_key(name)):
        return False
    connection.set(keys.drain_key(name), 1, px=int(within_s * 1000))
    return True


def hold(connection: Redis, name: str, hold_s: float | None) -> bool:
    """Hold a live worker: at its next job boundary it lets go of its device (worker/models.py's
    release) and claims nothing until ``hold_s`` seconds have passed (None: until :func:`unhold`).
    False where no live worker has this name."""
    if not connection.exists(keys.alive_key(name)):
        return False
    connection.set(keys.hold_key(name), 1, px=int(hold_s * 1000) if hold_s else None)
    return True


def unhold(connection: Redis, name: str) -> bool:
    """End an operator's hold on a live worker: it claims again (loading its models as jobs need
    them). False where no live worker has this name."""
    connection.delete(keys.hold_key(name))  # a dead worker's lapsed hold goes too
    return bool(connection.exists(keys.alive_key(name)))


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
    """Which of these workers hold the model of this name on their device now (one that lists no
    places is of an older version, which held its first model for as long as it lived)."""
    return [view.name for view in views
            if name in (view.on_device if view.model_places else view.on_device or [view.model])]
