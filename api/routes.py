"""HTTP routes: each parses the request, calls one ``shared`` function and returns JSON."""

from __future__ import annotations

import json
from typing import Any

from flask import Blueprint, Response, current_app, jsonify, request
from pydantic import ValidationError
from rq import Queue

from shared import queue as jobs
from shared.errors import InvalidJSONError, InvalidRequestError, UnsupportedMediaTypeError
from shared.jobs import validate_request
from shared.settings import Settings

bp = Blueprint("slotq", __name__)


def _queue() -> Queue:
    return current_app.extensions["slotq.queue"]


def _settings() -> Settings:
    return current_app.extensions["slotq.settings"]


@bp.post("/v1/jobs")
def submit_job() -> tuple[Response, int, dict[str, str]]:
    """Admit a job, or refuse it at once."""
    settings = _settings()
    try:
        job_request = validate_request(_json_body(), max_side=settings.max_side,
                                       max_steps=settings.max_steps).with_seed()
    except ValidationError as exc:
        raise InvalidRequestError(details=_details(exc)) from None
    job, position = jobs.enqueue_job(_queue(), settings, job_request)
    view = jobs.job_view(job, position=position)
    return jsonify(view.model_dump(mode="json")), 202, {"Location": f"/v1/jobs/{job.id}"}


@bp.get("/v1/jobs/<job_id>")
def get_job(job_id: str) -> Response:
    """A job's status, progress and result links."""
    job = jobs.fetch_job(_queue(), job_id)
    return jsonify(jobs.job_view(job).model_dump(mode="json"))


@bp.get("/v1/jobs/<job_id>/images/<int:index>")
def get_image(job_id: str, index: int) -> Response:
    """One finished image as PNG."""
    png = jobs.fetch_image(jobs.fetch_job(_queue(), job_id), index)
    return Response(png, mimetype="image/png", headers={"Cache-Control": "private, max-age=3600"})


@bp.delete("/v1/jobs/<job_id>")
def cancel_job(job_id: str) -> tuple[Response, int]:
    """Cancel a job: 200 once it is canceled, 202 while its worker is stopping it."""
    queue = _queue()
    job = jobs.fetch_job(queue, job_id)
    ended = jobs.cancel_job(queue, _settings(), job)
    job = jobs.fetch_job(queue, job_id)
    return jsonify(jobs.job_view(job).model_dump(mode="json")), 200 if ended else 202


@bp.get("/v1/queue")
def queue_state() -> Response:
    """How many jobs wait, against the cap."""
    return jsonify({"waiting": _queue().count, "capacity": _settings().queue_capacity})


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
    """Ready when Redis answers; a Redis error becomes 503 in the app's error handler."""
    _queue().connection.ping()
    return jsonify({"status": "ready"})


def _json_body() -> Any:
    if request.mimetype != "application/json":
        raise UnsupportedMediaTypeError()
    try:
        return json.loads(request.get_data(cache=False))
    except (ValueError, RecursionError):
        # RecursionError: a body of deeply nested brackets is malformed input, not a crash.
        raise InvalidJSONError() from None


def _details(exc: ValidationError) -> list[dict[str, Any]]:
    return [{"loc": list(error["loc"]), "msg": error["msg"]}
            for error in exc.errors(include_url=False, include_input=False)]
