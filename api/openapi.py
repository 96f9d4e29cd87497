"""The OpenAPI 3.1 document of the HTTP API, derived from the pydantic models and the error classes."""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any

from api.longpoll import MAX_WAIT_S
from api.routes import MAX_IDEMPOTENCY_KEY
from shared.contract import errors
from shared.contract.jobs import PRIORITIES, JobRequest, JobView
from shared.contract.settings import Settings
from shared.store.workers import WorkerView

REF = "#/components/schemas/{model}"
JSON = "application/json"
MIN_SIDE, SIDE_STEP = 64, 8
RETRY_AFTER_STATUSES = (429, 503)

_STRING = {"type": "string"}
ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["code", "message"], "additionalProperties": False,
        "properties": {"code": _STRING, "message": _STRING, "details": {"type": "array", "items": {
            "type": "object", "required": ["loc", "msg"],
            "properties": {"loc": {"type": "array", "items": {"type": ["string", "integer"]}},
                           "msg": _STRING},
        }}},
    }},
}
_BY_CLASS = {"type": "object", "required": list(PRIORITIES), "additionalProperties": False,
             "properties": {p: {"type": "integer", "minimum": 0} for p in PRIORITIES}}
QUEUE_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["waiting", "capacity", "by_priority", "limits"],
    "properties": {"waiting": {"type": "integer", "minimum": 0},
                   "capacity": {"type": "integer", "minimum": 1},
                   "by_priority": _BY_CLASS, "limits": _BY_CLASS},
}

WORKERS_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["workers"],
    "properties": {"workers": {"type": "array", "items": {"$ref": REF.format(model="WorkerView")}}},
}


def openapi_document(settings: Settings) -> dict[str, Any]:
    """The OpenAPI 3.1 document with these settings' limits (a copy the caller may change)."""
    return copy.deepcopy(_document(settings.max_side, settings.max_steps))


def error_codes() -> dict[int, list[str]]:
    """Every client-facing error code by HTTP status, read from the classes in ``shared.contract.errors``."""
    codes: dict[int, list[str]] = {}
    pending = list(errors.ServiceError.__subclasses__())
    while pending:
        cls = pending.pop(0)
        pending.extend(cls.__subclasses__())
        # Only the module's own classes: the app also makes ad-hoc ones for werkzeug's rare errors.
        if cls.__module__ == errors.__name__ and cls.code not in codes.setdefault(cls.status, []):
            codes[cls.status].append(cls.code)
    return codes


def _text(description: str, media_type: str) -> dict[str, Any]:
    return {"description": description, "content": {media_type: {"schema": _STRING}}}


@lru_cache(maxsize=8)
def _document(max_side: int, max_steps: int) -> dict[str, Any]:
    """Build the document once per distinct set of limits."""
    codes = error_codes()

    def operation(operation_id: str, summary: str, responses: dict[str, Any], failures: tuple[int, ...],
                  **extra: Any) -> dict[str, Any]:
        refusals = {str(status): _error(status, codes[status]) for status in failures}
        return {"operationId": operation_id, "summary": summary, **extra,
                "responses": {**responses, **refusals}}

    job_id = _path("id", _STRING, "The job id that POST /v1/jobs returned.")
    index = _path("index", {"type": "integer", "minimum": 0}, "The image's index, from 0.")
    key = {"name": "Idempotency-Key", "in": "header", "required": False,
           "description": "A retry with the same key and body answers 200 with the first job.",
           "schema": {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY}}
    # Free text, as RFC 7240 has it: a preference the server does not know, or a malformed one, is
    # ignored. Only `wait=N` (whole seconds) is acted on; above MAX_WAIT_S it is cut to MAX_WAIT_S.
    prefer = {"name": "Prefer", "in": "header", "required": False, "schema": _STRING,
              "description": f"`wait=N`: hold the answer until the job ends or N seconds pass (at most "
                             f"{MAX_WAIT_S}); a job that ended answers 200 with `Preference-Applied`."}
    wait = {"name": "wait", "in": "query", "required": False,
            "description": "Hold the answer until the job's status changes or this many seconds pass.",
            "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_WAIT_S}}
    job = {"Location": {"description": "The job's URL.", "schema": _STRING}}
    applied = {**job, "Preference-Applied": {"description": "`wait=N` when a `Prefer: wait=N` was applied.",
                                             "schema": _STRING}}
    paths = {
        "/v1/jobs": {"post": operation(
            "submitJob", "Admit a job, or refuse it at once.",
            {"202": _json("Admitted.", "JobView", job),
             "200": _json("An idempotent retry, or with `Prefer: wait=N` a job that ended within N s.",
                          "JobView", applied)},
            (400, 403, 409, 413, 415, 422, 429, 503), parameters=[key, prefer],
            requestBody={"required": True, "content": {JSON: {"schema": _ref("JobRequest")}}})},
        "/v1/jobs/{id}": {
            "parameters": [job_id],
            "get": operation("getJob", "A job's status, progress and result links.",
                             {"200": _json("The job.", "JobView")}, (404, 422, 503), parameters=[wait]),
            "delete": operation("cancelJob", "Cancel a job.",
                                {"200": _json("Canceled now.", "JobView"),
                                 "202": _json("Its worker stops it at its next step.", "JobView")},
                                (404, 409, 503)),
        },
        "/v1/jobs/{id}/images/{index}": {
            "parameters": [job_id, index],
            "get": operation("getImage", "One finished image as PNG.", {"200": {
                "description": "The image.",
                "content": {"image/png": {"schema": {"type": "string", "contentMediaType": "image/png"}}}}},
                (404, 409, 410, 503)),
        },
        "/v1/queue": {"get": operation("getQueue", "How many jobs wait, by class, and each class's limit.",
                                       {"200": _json("The queue.", QUEUE_SCHEMA)}, (503,))},
        "/v1/workers": {"get": operation("listWorkers", "The live workers, their device, state and job ids.",
                                         {"200": _json("The workers.", WORKERS_SCHEMA)}, (503,))},
        "/healthz": {"get": operation("healthz", "The process is alive.",
                                      {"200": _json("Alive.", _status("ok"))}, ())},
        "/readyz": {"get": operation("readyz", "Redis answers and the process is not draining.",
                                     {"200": _json("Ready.", _status("ready"))}, (503,))},
        "/openapi.json": {"get": operation("openapi", "This document.",
                                           {"200": _json("OpenAPI 3.1.", {"type": "object"})}, ())},
        "/metrics": {"get": operation("metrics", "Prometheus metrics of the API and the queue.",
                                      {"200": _text("The metrics.", "text/plain")}, (503,))},
        "/": {"get": operation("page", "The web page: a prompt form and the submitted job's progress.",
                               {"200": _text("The page.", "text/html")}, ())},
        "/ui/{filename}": {
            "parameters": [_path("filename", _STRING, "A file of the page (app.js, style.css).")],
            "get": operation("pageAsset", "A script or style sheet of the web page.",
                             {"200": _text("The file.", "text/javascript")}, (404,))},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "slotq", "version": "1",
                 "description": "A GPU image-generation job service with capped admission."},
        "paths": paths,
        "components": {"schemas": {**_model_schemas(max_side, max_steps), "Error": ERROR_SCHEMA},
                       # No operation answers 405 itself; any other method on a documented path does.
                       "responses": {"MethodNotAllowed": _error(405, codes[405])}},
    }


def _model_schemas(max_side: int, max_steps: int) -> dict[str, Any]:
    """The models' JSON schemas, plus the limits their validators take from the settings."""
    schemas: dict[str, Any] = {}
    for model in (JobRequest, JobView, WorkerView):
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    side = {"minimum": MIN_SIDE, "maximum": max_side, "multipleOf": SIDE_STEP}
    limits = {"width": side, "height": side, "steps": {"maximum": max_steps}}
    fields = schemas["JobRequest"]["properties"]
    for name in limits.keys() & fields.keys():
        fields[name] = {**fields[name], **limits[name]}
    return schemas


def _error(status: int, codes: list[str]) -> dict[str, Any]:
    """The error envelope, its code one of ``codes``, with ``Retry-After`` where it applies."""
    narrowed = {"properties": {"error": {"properties": {"code": {"enum": codes}}}}}
    response = _json(f"Error: {', '.join(codes)}.", {"allOf": [_ref("Error"), narrowed]})
    if status in RETRY_AFTER_STATUSES:
        response["headers"] = {"Retry-After": {"required": True, "description": "Seconds to wait.",
                                               "schema": {"type": "integer", "minimum": 1}}}
    return response


def _json(description: str, schema: str | dict[str, Any],
          headers: dict[str, Any] | None = None) -> dict[str, Any]:
    """A JSON response; ``schema`` is a component's name or an inline schema."""
    content = {JSON: {"schema": _ref(schema) if isinstance(schema, str) else schema}}
    return {"description": description, "content": content, **({"headers": headers} if headers else {})}


def _ref(name: str) -> dict[str, str]:
    """A reference to a component schema."""
    return {"$ref": REF.format(model=name)}


def _status(value: str) -> dict[str, Any]:
    """``{"status": value}``."""
    return {"type": "object", "required": ["status"], "properties": {"status": {"const": value}}}


def _path(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A required path parameter."""
    return {"name": name, "in": "path", "required": True, "description": description, "schema": schema}
