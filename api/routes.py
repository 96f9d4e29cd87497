"""HTTP routes: each parses the request, calls one ``shared`` function and returns JSON."""

from __future__ import annotations

import json
import time
from typing import Any

from flask import Blueprint, Response, current_app, g, jsonify, request
from pydantic import ValidationError
from rq import Queue
from rq.job import Job

from api import longpoll
from api.longpoll import Waits
from shared.contract import tenants
from shared.contract.errors import (
    DrainingError,
    InvalidJSONError,
    InvalidRequestError,
    UnsupportedMediaTypeError,
)
from shared.contract.jobs import PRIORITIES, Eta, JobStatus, JobView, validate_request
from shared.contract.settings import Settings
from shared.contract.tenants import Tenant
from shared.store import admission, endings, estimates, records, waiting, workers

bp = Blueprint("slotq", __name__)
MAX_IDEMPOTENCY_KEY = 255


def _queue() -> Queue:
    return current_app.extensions["slotq.queue"]


def _settings() -> Settings:
    return current_app.extensions["slotq.settings"]


def _waits() -> Waits:
    return current_app.extensions["slotq.waits"]


def _tenant() -> Tenant | None:
    return g.get("tenant")


@bp.before_request
def authenticate() -> None:
    """With SLOTQ_API_KEYS set, every /v1 call needs a valid bearer key; it names the tenant."""
    if request.path.startswith("/v1/"):
        g.tenant = tenants.authenticate(current_app.extensions["slotq.keys"], _settings(),
                                        request.headers.get("Authorization"))


@bp.post("/v1/jobs")
def submit_job() -> tuple[Response, int, dict[str, str]]:
    """Admit a job (202), replay an earlier submit with the same Idempotency-Key (200), or refuse."""
    # With ``Prefer: wait=N``, a job that ends within N seconds answers 200 with its final view.
    settings = _settings()
    try:
        job_request = validate_request(_json_body(), max_side=settings.max_side,
                                       max_steps=settings.max_steps)
    except ValidationError as exc:
        raise InvalidRequestError(details=_details(exc)) from None
    admitted = admission.enqueue_job(_queue(), settings, job_request, _idempotency_key(), _tenant(),
                                     g.get("request_id"))
    headers = {"Location": f"/v1/jobs/{admitted.job.id}"}
    g.admission = "replayed" if admitted.replayed else "admitted"
    wait = longpoll.preferred_wait(request.headers.getlist("Prefer"))
    if wait and _waits().hold(admitted.job, wait, longpoll.finished):
        view = _current_view(records.fetch_job(_queue(), admitted.job.id, _tenant()))
    else:
        view = _admitted_view(admitted)
    if wait and view.status.is_terminal:
        headers["Preference-Applied"] = f"wait={wait}"
    return _json(view), 200 if admitted.replayed or view.status.is_terminal else 202, headers


@bp.get("/v1/jobs/<job_id>")
def get_job(job_id: str) -> Response:
    """A job's status, progress and result links; with ``?wait=N``, once its status changes or N s pass."""
    wait = longpoll.wait_query(request.args.get("wait"))
    job = records.fetch_job(_queue(), job_id, _tenant())
    if wait and _waits().hold(job, wait, longpoll.changed_from(records.job_status(job))):
        job = records.fetch_job(_queue(), job_id, _tenant())
    return _json(_current_view(job))


@bp.get("/v1/jobs/<job_id>/images/<int:index>")
def get_image(job_id: str, index: int) -> Response:
    """One finished image as PNG."""
    png = records.fetch_image(records.fetch_job(_queue(), job_id, _tenant()), index)
    return Response(png, mimetype="image/png", headers={"Cache-Control": "private, max-age=3600"})


@bp.delete("/v1/jobs/<job_id>")
def cancel_job(job_id: str) -> tuple[Response, int]:
    """Cancel a job: 200 once it is canceled, 202 while its worker is stopping it."""
    queue = _queue()
    ended = endings.cancel(queue, _settings(), records.fetch_job(queue, job_id, _tenant()))
    return _json(records.job_view(records.fetch_job(queue, job_id, _tenant()))), 200 if ended else 202


@bp.get("/v1/queue")
def queue_state() -> Response:
    """How many jobs wait, by priority, against the limits of each class."""
    settings = _settings()
    counts = waiting.waiting_counts(_queue(), settings)
    return jsonify({"waiting": sum(counts.values()), "capacity": settings.queue_capacity,
                    "by_priority": counts,
                    "limits": {p: settings.waiting_limit(p) for p in PRIORITIES}})


@bp.get("/v1/workers")
def list_workers() -> Response:
    """The live workers of this queue: host, device, state and the ids of the jobs they hold."""
    views = workers.live_workers(_queue().connection, _settings().queue_name)
    return jsonify({"workers": [view.model_dump(mode="json") for view in views]})


@bp.get("/metrics")
def metrics() -> Response:
    """Prometheus metrics of this API and of the queue."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(current_app.extensions["slotq.metrics"].exposition(), content_type=CONTENT_TYPE_LATEST)


@bp.get("/openapi.json")
def openapi() -> Response:
    """The OpenAPI 3.1 document of this API."""
    from api.openapi import openapi_document

    return jsonify(openapi_document(_settings()))


@bp.get("/healthz")
def healthz() -> Response:
    """The process is alive."""
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> Response:
    """Ready when Redis answers and the process is not shutting down."""
    if current_app.extensions["slotq.draining"].is_set():
        raise DrainingError(retry_after=1)
    _queue().connection.ping()  # a Redis error becomes 503 in the app's error handler
    return jsonify({"status": "ready"})


def _admitted_view(admission: admission.Admission) -> JobView:
    """The view of a job just admitted or replayed."""
    if admission.replayed:
        return _view(admission.job)
    # The admission script already answered where the job stands: no second round trip.
    return _with_eta(records.job_view(admission.job, admission.position), admission.eta)


def _current_view(job: Job) -> JobView:
    """The job's view; a waiting job whose deadline has passed is expired first."""
    view = _view(job)
    if view.status is JobStatus.QUEUED and view.deadline_at and _past(view.deadline_at.timestamp()):
        queue = _queue()
        waiting.expire_due(queue, _settings())
        view = _view(records.fetch_job(queue, job.id, _tenant()))
    return view


def _view(job: Job) -> JobView:
    """The job's view, with its place and start and finish estimates while it waits or runs."""
    if records.job_status(job).is_terminal:
        return records.job_view(job)
    position, estimate = estimates.standing(_queue(), job)
    return _with_eta(records.job_view(job, position), estimate)


def _with_eta(view: JobView, estimate: tuple[float, float] | None) -> JobView:
    if estimate is None or view.status.is_terminal:
        return view
    return view.model_copy(update={"eta_s": Eta(start=estimate[0], finish=estimate[1])})


def _json(view: Any) -> Response:
    return jsonify(view.model_dump(mode="json"))


def _past(moment: float) -> bool:
    return moment <= time.time()


def _json_body() -> Any:
    if request.mimetype != "application/json":
        raise UnsupportedMediaTypeError()
    try:
        return json.loads(request.get_data(cache=False))
    except (ValueError, RecursionError):
        # RecursionError: a body of deeply nested brackets is malformed input, not a crash.
        raise InvalidJSONError() from None


def _idempotency_key() -> str | None:
    key = request.headers.get("Idempotency-Key")
    if key is not None and not (0 < len(key) <= MAX_IDEMPOTENCY_KEY and key.isprintable()):
        message = f"must be 1 to {MAX_IDEMPOTENCY_KEY} printable characters"
        raise InvalidRequestError(details=[{"loc": ["header", "Idempotency-Key"], "msg": message}])
    return key


def _details(exc: ValidationError) -> list[dict[str, Any]]:
    return [{"loc": list(error["loc"]), "msg": error["msg"]}
            for error in exc.errors(include_url=False, include_input=False)]
