"""The OpenAPI 3.1 document of the HTTP API, derived from the pydantic contract in ``shared.jobs``."""

from __future__ import annotations

import copy
from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from shared.jobs import JobRequest, JobView
from shared.settings import Settings

REF = "#/components/schemas/{model}"
JSON = "application/json"
MIN_SIDE, SIDE_STEP = 64, 8

# Error codes per status, as the README documents them; each answer uses the `Error` envelope.
ERROR_CODES: dict[int, tuple[str, ...]] = {
    400: ("invalid_json",),
    404: ("not_found",),
    405: ("method_not_allowed",),
    409: ("already_finished", "not_ready", "idempotency_conflict"),
    410: ("expired",),
    413: ("payload_too_large",),
    415: ("unsupported_media_type",),
    422: ("invalid_request",),
    429: ("queue_full",),
    503: ("unavailable",),
}
RETRY_AFTER = {429, 503}

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {"error": {
        "type": "object",
        "required": ["code", "message"],
        "additionalProperties": False,
        "properties": {
            "code": {"type": "string"},
            "message": {"type": "string"},
            "details": {"type": "array", "items": {
                "type": "object",
                "required": ["loc", "msg"],
                "properties": {"loc": {"type": "array", "items": {"type": ["string", "integer"]}},
                               "msg": {"type": "string"}},
            }},
        },
    }},
}
QUEUE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["waiting", "capacity"],
    "properties": {"waiting": {"type": "integer", "minimum": 0},
                   "capacity": {"type": "integer", "minimum": 1}},
}


def openapi_document(settings: Settings) -> dict[str, Any]:
    """The OpenAPI 3.1 document for these settings' limits (a copy the caller may change)."""
    return copy.deepcopy(_document(settings.max_side, settings.max_steps))


@lru_cache(maxsize=8)
def _document(max_side: int, max_steps: int) -> dict[str, Any]:
    """Build the document once per distinct set of limits."""
    job_id = _path_parameter("id", {"type": "string"}, "The job id that POST /v1/jobs returned.")
    index = _path_parameter("index", {"type": "integer", "minimum": 0}, "The image's index, from 0.")
    idempotency_key = {"name": "Idempotency-Key", "in": "header", "required": False,
                       "description": "Retrying with the same key and body returns the same job.",
                       "schema": {"type": "string", "maxLength": 200}}
    location = {"Location": {"description": "The job's URL.", "schema": {"type": "string"}}}
    paths = {
        "/v1/jobs": {"post": _operation(
            "submitJob", "Admit a job, or refuse it at once.",
            {"202": _json("The job was admitted.", "JobView", location)},
            (400, 409, 413, 415, 422, 429, 503), parameters=[idempotency_key],
            requestBody={"required": True, "content": {JSON: {"schema": _ref("JobRequest")}}})},
        "/v1/jobs/{id}": {
            "parameters": [job_id],
            "get": _operation("getJob", "A job's status, progress and result links.",
                              {"200": _json("The job.", "JobView")}, (404, 503)),
            "delete": _operation("cancelJob", "Cancel a job.",
                                 {"200": _json("The job ended now: canceled.", "JobView"),
                                  "202": _json("Its worker stops it at the next step.", "JobView")},
                                 (404, 409, 503)),
        },
        "/v1/jobs/{id}/images/{index}": {
            "parameters": [job_id, index],
            "get": _operation("getImage", "One finished image as PNG.",
                              {"200": {"description": "The image.", "content": {"image/png": {
                                  "schema": {"type": "string", "contentMediaType": "image/png"}}}}},
                              (404, 409, 410, 503)),
        },
        "/v1/queue": {"get": _operation("getQueue", "How many jobs wait, against the cap.",
                                        {"200": _json("The queue.", QUEUE_SCHEMA)}, (503,))},
        "/healthz": {"get": _operation("healthz", "The process is alive.",
                                       {"200": _json("Alive.", _status_schema("ok"))}, ())},
        "/readyz": {"get": _operation("readyz", "Ready when Redis answers.",
                                      {"200": _json("Ready.", _status_schema("ready"))}, (503,))},
        "/openapi.json": {"get": _operation("openapi", "This document.",
                                            {"200": _json("The OpenAPI document.", {"type": "object"})},
                                            ())},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "slotq", "version": _version(),
                 "description": "A GPU image-generation job service with capped admission."},
        "paths": paths,
        "components": {
            "schemas": {**_model_schemas(max_side, max_steps), "Error": ERROR_SCHEMA},
            "responses": {"MethodNotAllowed": _error(405)},
        },
    }


def _model_schemas(max_side: int, max_steps: int) -> dict[str, Any]:
    """The pydantic models' JSON schemas, with the limits their validators take from settings."""
    schemas: dict[str, Any] = {}
    for model in (JobRequest, JobView):
        schema = model.model_json_schema(ref_template=REF)
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    fields = schemas["JobRequest"]["properties"]
    limits = {"width": {"minimum": MIN_SIDE, "maximum": max_side, "multipleOf": SIDE_STEP},
              "height": {"minimum": MIN_SIDE, "maximum": max_side, "multipleOf": SIDE_STEP},
              "steps": {"maximum": max_steps}}
    for name, limit in limits.items():
        if name in fields:
            fields[name].update(limit)
    return schemas


def _operation(operation_id: str, summary: str, responses: dict[str, Any], errors: tuple[int, ...],
               **extra: Any) -> dict[str, Any]:
    """One operation: its success responses plus the error envelope for each status in ``errors``."""
    return {"operationId": operation_id, "summary": summary, **extra,
            "responses": {**responses, **{str(status): _error(status) for status in errors}}}


def _error(status: int) -> dict[str, Any]:
    """The error envelope with the codes this status may carry, and ``Retry-After`` where it applies."""
    codes = ERROR_CODES[status]
    narrowed = {"properties": {"error": {"properties": {"code": {"enum": list(codes)}}}}}
    schema = {"allOf": [_ref("Error"), narrowed]}
    response = _json(f"Error: {', '.join(codes)}.", schema)
    if status in RETRY_AFTER:
        response["headers"] = {"Retry-After": {"required": True, "description": "Seconds to wait.",
                                               "schema": {"type": "integer", "minimum": 1}}}
    return response


def _json(description: str, schema: str | dict[str, Any], headers: dict[str, Any] | None = None,
          ) -> dict[str, Any]:
    """A JSON response; ``schema`` is a component name or an inline schema."""
    response: dict[str, Any] = {"description": description, "content": {
        JSON: {"schema": _ref(schema) if isinstance(schema, str) else schema}}}
    if headers:
        response["headers"] = headers
    return response


def _ref(name: str) -> dict[str, str]:
    """A reference to a component schema."""
    return {"$ref": REF.format(model=name)}


def _path_parameter(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    """A required path parameter."""
    return {"name": name, "in": "path", "required": True, "description": description, "schema": schema}


def _status_schema(value: str) -> dict[str, Any]:
    """``{"status": value}``."""
    return {"type": "object", "required": ["status"], "properties": {"status": {"const": value}}}


def _version() -> str:
    """The installed package's version."""
    try:
        return version("slotq")
    except PackageNotFoundError:
        return "0"
