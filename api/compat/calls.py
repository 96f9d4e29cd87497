"""The synchronous call both surfaces make: admit a job, hold the request until it ends (at most
SLOTQ_SYNC_WAIT_S), and hand back the finished job with its images.

The job is an ordinary slotq job: admitted by the same script under every limit, listed, streamed
and readable at ``/v1/jobs/<id>`` while and after the call waits. A call that outlasts its wait, or
that this process stops holding (it drains) raises ``SyncWaitExceededError`` naming the job, which
goes on. A call waits in one of the process's waiting slots (``api/longpoll.py``), taken before the
job is admitted: where none is free (``TooManyWaitingError``), or its tenant holds its share of them
(``TenantWaitShareError``), the call is refused and admits nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from flask import g

from api import state
from api.jobs import Ticket
from shared.contract import logs
from shared.contract.errors import JobEndedError, ServiceError, SyncWaitExceededError
from shared.contract.jobs import JobStatus, JobView, Submission
from shared.store import preferences

Surface = str  # "openai", "a1111" or "comfyui": the label of the admissions metric (slotq_admissions_total)
P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class Finished:
    """A synchronous call's job once it succeeded: its final view and its images as PNG bytes."""

    view: JobView
    pngs: list[bytes]


def caller_model() -> str:
    """The model of a caller's job that names none: the one it chose (``preferences``), else the default."""
    settings = state.settings()
    chosen = preferences.chosen_model(state.queue().connection, settings, state.tenant())
    return chosen or settings.default_model


def submission(body: dict[str, Any]) -> Submission:
    """A translated body as a job, checked as a native ``POST /v1/jobs`` body is (the same errors,
    naming slotq's fields); a body that names no model gets the caller's (:func:`caller_model`)."""
    return state.jobs().submission({**body, "model": body.get("model") or caller_model()})


def admitting(surface: Surface) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Mark a view that admits a job: its outcome, a refusal, a bad key or an invalid body included,
    is counted in the admissions metric under this surface (api/observability.py reads the mark)."""
    def decorate(view: Callable[P, R]) -> Callable[P, R]:
        view.admits_for = surface  # type: ignore[attr-defined]
        return view
    return decorate


def noted(error: ServiceError) -> ServiceError:
    """The error, noted for the admissions metric: a surface's error handler passes each through."""
    g.error_code = error.code
    return error


def run(submitted: Submission) -> Finished:
    """Admit the job and wait for its end; its images, or ``JobEndedError`` where it has none."""
    ticket, wait = Ticket(None, state.tenant(), logs.request_id.get()), state.settings().sync_wait_s
    caller = ticket.tenant.name if ticket.tenant else None
    jobs = state.jobs()
    with jobs.waits.reserved(caller):  # refused before admission where this process may hold no more calls
        outcome = jobs.submit(submitted, ticket, wait=wait, reserved=True)
    g.admission, g.about = "admitted", outcome.about
    view = outcome.view
    if not view.status.is_terminal:
        raise SyncWaitExceededError(f"Job {view.id} is {view.status.value}: this call stopped waiting for it "
                                    f"(after SLOTQ_SYNC_WAIT_S, {wait:g} s, or as this API process shuts "
                                    f"down); the job goes on: GET /v1/jobs/{view.id}.")
    if view.status is not JobStatus.SUCCEEDED:
        error = view.error
        code = error.code if error else view.status.value
        message = error.message if error else f"The job ended {view.status.value}."
        raise JobEndedError(view.status.value, code, f"Job {view.id} ended {view.status.value}: {message}",
                            view.id)
    return Finished(view, jobs.pngs(view.id, ticket.tenant))
