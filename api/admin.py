"""The operators' routes, ``/v1/admin/...``: read every model's line and every tenant's jobs in it,
pause and resume a line, move a waiting job to the front of its class; list the workers, have one let
go of its device for a while (release, resume) or drain it.

They take an admin key (SLOTQ_ADMIN_KEYS) as ``Authorization: Bearer``, kept apart from the tenants'
keys: a tenant's key is refused (403 ``not_admin``), and a service with no admin key has them off
(403 ``admin_disabled``). Each action is logged and counted (``slotq_admin_actions_total``); each is
one script of the store (shared/store/waiting.py), so fair share, caps and fencing hold through it.
"""

from __future__ import annotations

import hmac
import logging
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from flask import Blueprint, jsonify, request
from flask.typing import ResponseReturnValue
from pydantic import BaseModel, ValidationError
from rq.job import Job

from api import bodies, state
from shared.contract import keys
from shared.contract.errors import (
    AdminDisabledError,
    InvalidRequestError,
    NotAdminError,
    NotFoundError,
    NotWaitingError,
    UnauthorizedError,
    UnknownModelError,
)
from shared.contract.tenants import priorities_of
from shared.store import records, waiting, workers

log = logging.getLogger(__name__)
bp = Blueprint("admin", __name__, url_prefix="/v1/admin")
NEEDS_KEY = "Send an admin key (SLOTQ_ADMIN_KEYS) as `Authorization: Bearer <key>`."
DEFAULT_JOBS, MAX_JOBS = 100, 1000  # waiting jobs listed a line
Body = TypeVar("Body", bound=BaseModel)


@bp.before_request
def authorize() -> None:
    """Only an admin key passes; each key compared in constant time, as the tenants' are. (OPTIONS
    answers which methods a route has, as every route does.)"""
    if request.method == "OPTIONS":
        return
    admin_keys = [key.get_secret_value() for key in state.settings().admin_keys]
    if not admin_keys:
        raise AdminDisabledError()
    scheme, _, presented = (request.headers.get("Authorization") or "").partition(" ")
    sent = presented.strip() if scheme.lower() == "bearer" else ""
    if not sent:
        raise UnauthorizedError(NEEDS_KEY)
    matches = [hmac.compare_digest(key.encode(), sent.encode()) for key in admin_keys]
    if not any(matches):
        known_tenant = any(hmac.compare_digest(key.encode(), sent.encode()) for key in state.key_policies())
        raise NotAdminError() if known_tenant else UnauthorizedError(NEEDS_KEY)


@bp.get("/lines")
def lines() -> ResponseReturnValue:
    """Every model's line: whether it is paused and how many wait in each class."""
    queue = state.queue()
    return jsonify({"lines": [_line(name, keys.line_name(queue.name, name))
                              for name in state.settings().offered_models]})


@bp.get("/jobs")
def jobs() -> ResponseReturnValue:
    """Every tenant's running jobs and the first ``limit`` waiting (in the order workers take them) of
    each model's line, each view with its tenant."""
    limit = _limit(request.args.get("limit", str(DEFAULT_JOBS)))
    queue, lines = state.queue(), []
    for model in state.settings().offered_models:
        line = keys.line_name(queue.name, model)
        running = workers.held_jobs(queue.connection, line)
        waiting_ids = waiting.waiting_ids(queue.connection, line, limit)
        lines.append({"model": model, "running": _views(running),
                      "waiting": _views(waiting_ids, positions=True),
                      "waiting_count": sum(waiting.counts(queue.connection, line).values())})
    return jsonify({"lines": lines})


@bp.post("/lines/<model>/pause")
def pause(model: str) -> ResponseReturnValue:
    """Stop the workers taking this model's jobs; admission goes on, a running job finishes."""
    line = _line_of(model)
    waiting.pause(state.queue().connection, line)
    _done("pause", model)
    return jsonify(_line(model, line))


@bp.post("/lines/<model>/resume")
def resume(model: str) -> ResponseReturnValue:
    """Let the workers take this model's jobs again, in their order."""
    line = _line_of(model)
    waiting.resume(state.queue().connection, line)
    _done("resume", model)
    return jsonify(_line(model, line))


@bp.post("/jobs/<job_id>/front")
def to_front(job_id: str) -> ResponseReturnValue:
    """Move any tenant's waiting job to the front of its class; its view, with its place now."""
    queue = state.queue()
    job = records.fetch_job(queue, job_id)
    before = waiting.to_front(queue.connection, waiting.line_of(job), job.id)
    if before is None:
        raise NotWaitingError()
    _done("front", waiting.job_model(job), f"job {job.id} from place {before}")
    return jsonify(records.current_view(queue, state.settings(), job).model_dump(mode="json"))


@bp.get("/workers")
def live_workers() -> ResponseReturnValue:
    """Every live worker: its state, held jobs, and where each of its models is since when."""
    return jsonify({"workers": [view.model_dump(mode="json") for view in state.jobs().workers()]})


@bp.post("/workers/<name>/release")
def release(name: str) -> ResponseReturnValue:
    """Have a live worker let go of its device at its next job boundary and claim nothing for
    ``hold_s`` seconds (absent: until resumed): its line's jobs wait, or go to other workers."""
    hold = _optional_body(workers.WorkerHold)
    if not workers.hold(state.queue().connection, name, hold.hold_s):
        raise NotFoundError("No live worker of this name.")
    _done("release", "", f"worker {name} for {f'{hold.hold_s:g} s' if hold.hold_s else 'until resumed'}")
    until = datetime.now(UTC) + timedelta(seconds=hold.hold_s) if hold.hold_s else None
    return jsonify({"worker": name, "held": True, "held_until": until.isoformat() if until else None})


@bp.post("/workers/<name>/resume")
def resume_worker(name: str) -> ResponseReturnValue:
    """End a hold: the worker claims again, its models loaded as its jobs need them."""
    if not workers.unhold(state.queue().connection, name):
        raise NotFoundError("No live worker of this name.")
    _done("resume_worker", "", f"worker {name}")
    return jsonify({"worker": name, "held": False})


@bp.post("/workers/<name>/drain")
def drain(name: str) -> ResponseReturnValue:
    """Have a live worker finish its execution and claim nothing more: then exit, as after SIGTERM
    (its next heartbeat takes the request), or with ``{"exit": false}`` stay, held until resumed. The
    jobs it has not started stay in the line for the others."""
    asked = _optional_body(workers.WorkerDrain)
    connection, settings = state.queue().connection, state.settings()
    found = workers.drain(connection, name, within_s=2 * settings.heartbeat_ttl_s) if asked.exit \
        else workers.hold(connection, name, None)
    if not found:
        raise NotFoundError("No live worker of this name.")
    _done("drain", "", f"worker {name}{'' if asked.exit else ', staying'}")
    return jsonify({"worker": name, "draining": True, "exit": asked.exit})


@bp.patch("/jobs/<job_id>")
def change(job_id: str) -> ResponseReturnValue:
    """Move any tenant's waiting job to another priority class, of those its tenant's key may use."""
    job = records.fetch_job(state.queue(), job_id)
    allowed = priorities_of(state.key_policies(), job.meta.get("tenant") or "")
    view = state.jobs().change(job_id, bodies.json_body(), None, allowed)
    _done("priority", view.model, f"job {job_id} now {view.request.priority}")
    return jsonify(view.model_dump(mode="json"))


def _optional_body(kind: type[Body]) -> Body:
    """The request's JSON body as ``kind``; an empty request takes its defaults."""
    try:
        return kind.model_validate(bodies.json_body() if request.content_length else {})
    except ValidationError as exc:
        raise InvalidRequestError.of(exc) from None


def _limit(raw: str) -> int:
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_JOBS:
        raise InvalidRequestError(details=[{"loc": ["query", "limit"],
                                            "msg": f"a whole number, 1 to {MAX_JOBS}"}])
    return int(raw)


def _views(job_ids: list[str], positions: bool = False) -> list[dict[str, Any]]:
    """The views of these jobs (those whose records remain), each with its tenant; ``positions``: they
    wait in this order, from place 0."""
    queue, views = state.queue(), []
    found = Job.fetch_many(job_ids, connection=queue.connection, serializer=queue.serializer)
    for place, job in enumerate(found):
        if job is not None:
            view = records.job_view(job, place if positions else None)
            views.append({**view.model_dump(mode="json"), "tenant": job.meta.get("tenant") or None})
    return views


def _line_of(model: str) -> str:
    if model not in state.settings().offered_models:
        raise UnknownModelError(f"No model named {model!r}.")
    return keys.line_name(state.queue().name, model)


def _line(model: str, line: str) -> dict[str, Any]:
    counts, paused = waiting.line_state(state.queue().connection, line)
    return {"model": model, "paused": paused, "waiting": counts}


def _done(action: str, model: str, what: str = "") -> None:
    """Log and count an operator's action."""
    state.metrics().admin_actions.labels(action, model).inc()
    log.info("admin %s%s%s", action, f" on the {model} line" if model else "", f": {what}" if what else "")
