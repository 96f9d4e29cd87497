"""The operations behind the routes, one per route: each takes parsed input, calls the store and,
where a client asked to wait, the long-poll waits, and returns a shared model or raises a typed error."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from pydantic import ValidationError
from rq import Queue

from api import longpoll
from api.longpoll import Waits
from shared.contract.adapters import available_adapters
from shared.contract.controlnets import available_controlnets
from shared.contract.errors import InvalidRequestError, NotWaitingError, PriorityNotAllowedError
from shared.contract.images import ImageRef, InputName, input_reference
from shared.contract.ip_adapters import available_ip_adapters
from shared.contract.jobs import (
    PRIORITIES,
    JobChange,
    JobStatus,
    JobView,
    Priority,
    Submission,
    requested_model,
    validate_submission,
)
from shared.contract.models import Family, ModelInfo, model_info
from shared.contract.settings import Settings
from shared.contract.tenants import Tenant
from shared.store import admission, endings, listing, records, results, waiting, workers
from shared.store.workers import WorkerView


@dataclass(frozen=True)
class Submitted:
    """A submit's answer: the job's view, whether an earlier submit made it, and the wait applied."""

    view: JobView
    replayed: bool
    about: str  # the log's words for it: "admitted job <id>: model ..., 64x64, 4 steps, ..."
    waited: int | None = None  # the ``Prefer: wait=N`` applied: the job ended within it


@dataclass(frozen=True)
class Ticket:
    """Who submits: the Idempotency-Key, the API key's tenant and the request id, each optional."""

    idempotency_key: str | None = None
    tenant: Tenant | None = None
    request_id: str | None = None


MAX_RUNNING = 20  # the running jobs a caller's progress and interrupt look at
MODELS_TTL_S = 2.0  # how long a process reuses what the heartbeats say of the models


class Jobs:
    """The jobs of one queue, with these settings; a request that waits is held by ``waits``."""

    def __init__(self, queue: Queue, settings: Settings, waits: Waits) -> None:
        self.queue, self.settings, self.waits = queue, settings, waits
        self._models: tuple[float, list[ModelInfo]] = (-MODELS_TTL_S, [])

    def submission(self, body: Any) -> Submission:
        """A client's JSON body as a job for the model it names (absent: the default), checked
        against that model and this service's limits, or ``InvalidRequestError``
        (``UnknownModelError``, ``UnknownLoraError``, ``InvalidImageError`` for an input image)."""
        settings = self.settings
        name = requested_model(body, list(settings.offered_models))
        try:
            return validate_submission(body, max_side=settings.max_side, max_steps=settings.max_steps,
                                       max_image_bytes=settings.max_image_bytes, model=self.model(name),
                                       max_frames=settings.max_frames,
                                       adapters=available_adapters(settings.lora_dir_of(name)),
                                       controlnets=available_controlnets(settings.controlnet_dir, name),
                                       ip_adapters=available_ip_adapters(settings.ip_adapter_dir, name))
        except ValidationError as exc:
            raise InvalidRequestError.of(exc) from None

    def submit(self, submission: Submission, ticket: Ticket, wait: float | None = None,
               reserved: bool = False) -> Submitted:
        """Admit a job or replay an idempotent retry; with ``wait``, once it ends or ``wait`` s pass
        (``reserved``: in a waiting slot the caller took before, ``Waits.reserved``)."""
        admitted = admission.enqueue_job(self.queue, self.settings, submission.request,
                                         ticket.idempotency_key, ticket.tenant, ticket.request_id,
                                         submission.inputs)
        fetch = partial(records.fetch_job, self.queue, admitted.job_id, ticket.tenant)
        # Admitted already: a tenant over its share of the waiting slots is answered at once, not refused.
        held = self.waits.hold(admitted.job_id, fetch, wait, longpoll.finished, reserved,
                               tenant=ticket.tenant.name if ticket.tenant else None) if wait else None
        if held is not None:
            view = records.current_view(self.queue, self.settings, held, ticket.tenant)
        elif admitted.prior is not None:
            view = records.standing_view(self.queue, admitted.prior)
        else:
            # The admission script already answered where the job stands: no second round trip.
            assert admitted.record is not None and admitted.position is not None
            view = records.admitted_view(admitted.job_id, admitted.record.request, admitted.record.created_at,
                                         admitted.position, admitted.eta, admitted.deadline_at,
                                         admitted.line_paused)
        about = admission.describe(self.settings, admitted, submission.request)
        waited = int(wait) if wait and view.status.is_terminal else None
        return Submitted(view, admitted.replayed, about, waited)

    def read(self, job_id: str, tenant: Tenant | None = None, wait: float | None = None) -> JobView:
        """A job's view; with ``wait``, once its status changes or ``wait`` seconds pass."""
        fetch = partial(records.fetch_job, self.queue, job_id, tenant)
        job = self.waits.hold(job_id, fetch, wait, longpoll.changed, tenant=tenant.name if tenant else None,
                              refuse=True) if wait else None
        return records.current_view(self.queue, self.settings, job if job is not None else fetch(), tenant)

    def image(self, job_id: str, index: int, tenant: Tenant | None = None) -> bytes | str:
        """One finished image of a job, as PNG, or a short-lived URL of it in the store."""
        job, store = records.fetch_job(self.queue, job_id, tenant), results.of(self.settings)
        return store.image_url(job, index) or store.image(job, index)

    def video(self, job_id: str, tenant: Tenant | None = None) -> bytes:
        """A finished video job's MP4."""
        job = records.fetch_job(self.queue, job_id, tenant)
        return results.of(self.settings).video(job)

    def pngs(self, job_id: str, tenant: Tenant | None = None) -> list[bytes]:
        """Every finished image of a job, as PNG bytes (from the store, wherever it keeps them)."""
        job, store = records.fetch_job(self.queue, job_id, tenant), results.of(self.settings)
        return [store.image(job, index) for index in range(len(records.job_view(job).images))]

    def running(self, tenant: Tenant | None) -> list[JobView]:
        """The caller's running jobs, newest first (without API keys: every running job)."""
        page = listing.list_jobs(self.queue, tenant, MAX_RUNNING, (JobStatus.RUNNING,))
        return list(page.jobs)

    def check_ready(self) -> None:
        """Raise unless Redis answers and the result store can be written."""
        self.queue.connection.ping()
        results.of(self.settings).check()

    def preview(self, job_id: str, tenant: Tenant | None = None) -> tuple[bytes, int]:
        """A running job's latest preview as JPEG, and the step it shows."""
        return records.fetch_preview(records.fetch_job(self.queue, job_id, tenant))

    def input(self, job_id: str, name: InputName, tenant: Tenant | None = None) -> tuple[bytes, str]:
        """One input image of a job as the client sent it, and its media type."""
        job = records.fetch_job(self.queue, job_id, tenant)
        data = results.of(self.settings).input(job, name)
        return data, ImageRef.model_validate(input_reference(job.kwargs["request"], name)).media_type

    def page(self, tenant: Tenant | None, limit: int, statuses: Collection[JobStatus] = (),
             cursor: str | None = None) -> listing.Page:
        """The caller's jobs, newest first, a page at a time."""
        return listing.list_jobs(self.queue, tenant, limit, statuses, cursor)

    def cancel(self, job_id: str, tenant: Tenant | None = None) -> tuple[JobView, bool]:
        """Cancel a job, keeping its record; its view, and whether it ended now (not at its next step)."""
        ended = endings.cancel(self.queue, self.settings, records.fetch_job(self.queue, job_id, tenant))
        return records.job_view(records.fetch_job(self.queue, job_id, tenant)), ended

    def change(self, job_id: str, body: Any, tenant: Tenant | None,
               priorities: Sequence[Priority] = PRIORITIES) -> JobView:
        """Move a waiting job to another priority class (``priorities``: those its tenant may use, as
        ``tenant``'s key says where it is the caller); its view with its place now, ``NotWaitingError``
        once it runs or has ended."""
        try:
            change = JobChange.model_validate(body)
        except ValidationError as exc:
            raise InvalidRequestError.of(exc) from None
        allowed = tenant.priorities if tenant is not None else priorities
        if change.priority not in allowed:
            raise PriorityNotAllowedError(f"This job's key may use priority {', '.join(allowed)}, "
                                          f"not {change.priority}.")
        job = records.fetch_job(self.queue, job_id, tenant)
        if waiting.reclass(self.queue.connection, job, change.priority) is None:
            raise NotWaitingError()
        return records.current_view(self.queue, self.settings, records.fetch_job(self.queue, job_id, tenant))

    def line(self) -> dict[str, Any]:
        """How many jobs wait, by priority, against the limits of each class: the service's totals
        and, under ``models``, each model's line."""
        lines = {name: self._line(name) for name in self.settings.offered_models}
        total = {field: {p: sum(line[field][p] for line in lines.values()) for p in PRIORITIES}
                 for field in ("by_priority", "limits")}
        return {"waiting": sum(line["waiting"] for line in lines.values()),
                "capacity": sum(line["capacity"] for line in lines.values()), **total, "models": lines}

    def _line(self, model: str) -> dict[str, Any]:
        counts, paused = waiting.waiting_state(self.queue, self.settings, self.settings.line_of(model))
        return {"waiting": sum(counts.values()), "capacity": self.settings.queue_capacity,
                "by_priority": counts, "limits": {p: self.settings.waiting_limit(p) for p in PRIORITIES},
                "paused": paused}

    def workers(self, tenant: Tenant | None = None) -> list[WorkerView]:
        """The live workers of every model, by model and name; a worker serving several models once.
        A tenant sees the ids of its own jobs among those they hold, no other's."""
        listed: dict[str, WorkerView] = {}
        for name in self.settings.offered_models:
            for view in workers.live_workers(self.queue.connection, self.settings.line_of(name)):
                listed.setdefault(view.name, view)
        views = list(listed.values())
        if tenant is None:
            return views
        held = [job_id for view in views for job_id in view.current_jobs]
        admitted_for = records.tenants_of(self.queue.connection, held)
        own = {job_id for job_id, of in zip(held, admitted_for, strict=True) if of == tenant.name}
        return [view.model_copy(update={"current_jobs": [job for job in view.current_jobs if job in own]})
                for view in views]

    def models(self) -> list[ModelInfo]:
        """The models a job may name, the default first: as their live workers hold them, else as
        the settings assume them."""
        read_at, held = self._models
        if time.monotonic() - read_at > MODELS_TTL_S:  # a submit costs no heartbeat read as a rule
            # Marked read first: requests arriving meanwhile use what was read before, so that one
            # request of this process reads the heartbeats, not every one in flight.
            if held:
                self._models = time.monotonic(), held
            held = [self._model(name, family).within(self.settings.max_side, self.settings.max_frames)
                    for name, family in self.settings.offered_models.items()]
            self._models = time.monotonic(), held
        return list(held)

    def _model(self, name: str, family: Family) -> ModelInfo:
        line = self.settings.line_of(name)
        info = workers.live_model(self.queue.connection, line, name)
        if info is None:  # no worker describes it: as the settings assume it, with who serves it
            names, held, capacity = workers.serving(self.queue.connection, line, name)
            adapters = available_adapters(self.settings.lora_dir_of(name))
            info = model_info(name, family, adapters, None, names, held, capacity)
        update: dict[str, object] = dict(self.settings.controls_of(name, family))
        if (in_folder := self.settings.folder_model(name)) is not None:
            update["size"] = in_folder.size
        return info.model_copy(update=update)

    def model(self, name: str) -> ModelInfo:
        """The model of this name (of SLOTQ_MODEL_NAMES or SLOTQ_MODELS_DIR), that a job for it is
        checked against."""
        return next(info for info in self.models() if info.name == name)
