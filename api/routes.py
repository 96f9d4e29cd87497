"""HTTP routes: each parses the request, calls one function (of ``api/jobs.py`` mostly) and answers.

Errors are raised as the typed errors of ``shared/contract/errors.py``; ``api/app.py`` answers them.
"""

from __future__ import annotations

from flask import Blueprint, Response, g, jsonify, request
from pydantic import BaseModel
from werkzeug.exceptions import RequestedRangeNotSatisfiable

from api import bodies, longpoll, state
from api.compat.openai_images import model_list
from api.jobs import Ticket
from api.openapi import openapi_document
from shared.contract import logs, tenants
from shared.contract.errors import (
    DrainingError,
    InvalidRequestError,
    NotFoundError,
    RangeNotSatisfiableError,
)
from shared.contract.images import INPUT_NAMES
from shared.contract.jobs import DEFAULT_LIMIT, MAX_LIMIT, JobStatus, Submission

bp = Blueprint("slotq", __name__)


def authenticate() -> None:
    """With SLOTQ_API_KEYS set, every /v1 call needs a valid bearer key; it names the tenant. (An
    open service has no tenants: ``api/app.py`` registers this hook only where there are keys.)"""
    if request.path.startswith("/v1/") and not request.path.startswith("/v1/admin/"):  # api/admin.py's own
        state.set_tenant(tenants.authenticate(state.key_policies(), state.settings(),
                                              request.headers.get("Authorization")))


@bp.post("/v1/jobs")
def submit_job() -> tuple[Response, int, dict[str, str]]:
    """Admit a job (202), replay an earlier submit with the same Idempotency-Key (200), or refuse."""
    # With ``Prefer: wait=N``, a job that ends within N seconds answers 200 with its final view.
    submission, wait = _submission(), longpoll.preferred_wait(request.headers.getlist("Prefer"))
    # The request id: api/observability.py set it.
    ticket = Ticket(bodies.idempotency_key(), state.tenant(), logs.request_id.get())
    submitted = state.jobs().submit(submission, ticket, wait)
    g.admission = "replayed" if submitted.replayed else "admitted"
    g.about = submitted.about  # the request's log line says it (api/observability.py)
    headers = {"Location": f"/v1/jobs/{submitted.view.id}"}
    if submitted.waited:
        headers["Preference-Applied"] = f"wait={submitted.waited}"
    status = 200 if submitted.replayed or submitted.view.status.is_terminal else 202
    return _json(submitted.view), status, headers


@bp.get("/v1/jobs")
def list_jobs() -> Response:
    """The caller's jobs, newest first: ``?status=`` (repeated or comma-separated), ``?limit=``
    (default 20, at most 100) and ``?cursor=`` (the ``next`` of the page before)."""
    page = state.jobs().page(state.tenant(), _limit(_single("limit")),
                             _statuses(request.args.getlist("status")), _single("cursor"))
    return jsonify({"jobs": [view.model_dump(mode="json") for view in page.jobs], "next": page.next})


@bp.get("/v1/jobs/<job_id>")
def get_job(job_id: str) -> Response:
    """A job's status, progress and result links; with ``?wait=N``, once its status changes or N s pass."""
    return _json(state.jobs().read(job_id, state.tenant(), longpoll.wait_query(_single("wait"))))


@bp.get("/v1/jobs/<job_id>/events")
def job_events(job_id: str) -> Response:
    """A job's events as server-sent events, from after ``Last-Event-ID`` (the header, or the
    ``last_event_id`` query for a first connection); 204 once the client had the final one."""
    last = request.headers.get("Last-Event-ID") or _single("last_event_id")
    stream = state.streams().open(job_id, state.tenant(), last)
    if stream is None:
        return Response(status=204)
    # No caching, and no buffering in a proxy (nginx honours X-Accel-Buffering): each event at once.
    return Response(stream, mimetype="text/event-stream",
                    headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


@bp.get("/v1/jobs/<job_id>/images/<int:index>")
@bp.get("/v1/jobs/<job_id>/images/<int:index>.png")  # for clients that name the file after its URL
def get_image(job_id: str, index: int) -> Response:
    """One finished image as PNG, or (SLOTQ_S3_PRESIGN) a redirect to it in the bucket."""
    found = state.jobs().image(job_id, index, state.tenant())
    if isinstance(found, str):
        return Response(status=307, headers={"Location": found, "Cache-Control": "no-store"})
    return Response(found, mimetype="image/png", headers={"Cache-Control": "private, max-age=3600"})


@bp.get("/v1/jobs/<job_id>/video.mp4")
def get_video(job_id: str) -> Response:
    """A finished video job's clip as H.264 MP4; ranged reads (``Range: bytes=...``) answer 206."""
    data = state.jobs().video(job_id, state.tenant())
    response = Response(data, mimetype="video/mp4", headers={"Cache-Control": "private, max-age=3600"})
    try:  # a satisfiable Range: 206 with Content-Range
        response.make_conditional(request, accept_ranges=True, complete_length=len(data))
    except RequestedRangeNotSatisfiable:
        raise RangeNotSatisfiableError(f"The clip is {len(data)} bytes.") from None
    return response


@bp.get("/v1/jobs/<job_id>/preview")
def get_preview(job_id: str) -> Response:
    """A running job's latest preview as JPEG; ``Preview-Step`` says which step it shows."""
    jpeg, step = state.jobs().preview(job_id, state.tenant())
    return Response(jpeg, mimetype="image/jpeg",
                    headers={"Cache-Control": "no-store", "Preview-Step": str(step)})


@bp.get("/v1/jobs/<job_id>/inputs/<name>")
def get_input(job_id: str, name: str) -> Response:
    """One input image of a job (``image``, ``mask``, a control's ``control0``...), as the client sent it."""
    if name not in INPUT_NAMES:
        raise NotFoundError(f"A job's inputs are {', '.join(f'`{each}`' for each in INPUT_NAMES)}.")
    data, media_type = state.jobs().input(job_id, name, state.tenant())
    return Response(data, mimetype=media_type, headers={"Cache-Control": "private, max-age=3600"})


@bp.delete("/v1/jobs/<job_id>")
def cancel_job(job_id: str) -> tuple[Response, int]:
    """Cancel a job, which keeps its record: 200 once it is canceled, 202 while its worker stops it."""
    view, ended = state.jobs().cancel(job_id, state.tenant())
    return _json(view), 200 if ended else 202


@bp.patch("/v1/jobs/<job_id>")
def change_job(job_id: str) -> Response:
    """Move a waiting job of the caller to another priority class its key may use."""
    return _json(state.jobs().change(job_id, bodies.json_body(), state.tenant()))


@bp.get("/v1/queue")
def queue_state() -> Response:
    """How many jobs wait, by priority, against the limits of each class; in all and per model."""
    return jsonify(state.jobs().line())


@bp.get("/v1/workers")
def list_workers() -> Response:
    """The live workers of every model: host, device, state and the ids of the caller's jobs they hold."""
    workers = state.jobs().workers(state.tenant())
    return jsonify({"workers": [view.model_dump(mode="json") for view in workers]})


@bp.get("/v1/models")
def list_models() -> Response:
    """The models a job may name: family, samplers, defaults, adapters and the live workers of each;
    and, for OpenAI's clients (``client.models.list()``), their names and aliases in OpenAI's shape."""
    models = state.jobs().models()
    listed = model_list([info.name for info in models], state.settings().model_aliases)
    return jsonify({"models": [info.model_dump(mode="json") for info in models], **listed})


@bp.get("/metrics")
def metrics() -> Response:
    """Prometheus metrics of this API and of the queue."""
    from prometheus_client import CONTENT_TYPE_LATEST

    return Response(state.metrics().exposition(), content_type=CONTENT_TYPE_LATEST)


@bp.get("/openapi.json")
def openapi() -> Response:
    """The OpenAPI 3.1 document of this API."""
    return jsonify(openapi_document(state.settings()))


@bp.get("/healthz")
def healthz() -> Response:
    """The process is alive."""
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz() -> Response:
    """Ready when Redis and the result store answer and the process is not shutting down."""
    if state.draining().is_set():
        raise DrainingError(retry_after=1)
    state.jobs().check_ready()  # a Redis or store error becomes 503 in the app's error handler
    return jsonify({"status": "ready"})


def _single(name: str) -> str | None:
    """A query parameter that takes one value (None when absent); given more than once, a 422."""
    values = request.args.getlist(name)
    if len(values) > 1:
        raise InvalidRequestError(details=[{"loc": ["query", name], "msg": "must be given at most once"}])
    return values[0] if values else None


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    if not (value.isdigit() and len(value) <= 3 and 1 <= int(value) <= MAX_LIMIT):
        message = f"must be a whole number from 1 to {MAX_LIMIT}"
        raise InvalidRequestError(details=[{"loc": ["query", "limit"], "msg": message}])
    return int(value)


def _statuses(values: list[str]) -> set[JobStatus]:
    names = {name.strip() for value in values for name in value.split(",")}
    unknown = sorted(names - set(JobStatus))
    if unknown:
        message = f"{', '.join(unknown)[:100]}: not a status; one of {', '.join(JobStatus)}"
        raise InvalidRequestError(details=[{"loc": ["query", "status"], "msg": message}])
    return {JobStatus(name) for name in names}


def _json(view: BaseModel) -> Response:
    # pydantic writes the JSON itself, in one pass: a third of the time of a dump to dicts and jsonify.
    return Response(view.model_dump_json(), mimetype="application/json")


def _submission() -> Submission:
    """The body as a job request for the model it names, with this service's limits, or
    ``InvalidRequestError`` (``UnknownModelError``, ``InvalidImageError`` for an input image)."""
    return state.jobs().submission(bodies.json_body())

