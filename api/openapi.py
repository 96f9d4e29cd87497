"""The OpenAPI 3.1 document of the HTTP API, derived from the pydantic models and the error classes."""

from __future__ import annotations

import copy
import json
from functools import lru_cache
from typing import Any

from api.compat import document as compat_document
from api.longpoll import MAX_WAIT_S
from api.streams import EVENT_ID
from shared.contract import errors
from shared.contract.adapters import available_adapters
from shared.contract.images import FORMATS, INPUT_NAMES
from shared.contract.jobs import (
    DEFAULT_LIMIT,
    MAX_FPS,
    MAX_IDEMPOTENCY_KEY,
    MAX_LIMIT,
    MIN_SIDE,
    PRIORITIES,
    JobChange,
    JobRequest,
    JobStatus,
    JobView,
)
from shared.contract.models import ModelInfo, model_info
from shared.contract.settings import Settings
from shared.store.listing import CURSOR
from shared.store.workers import WorkerDrain, WorkerHold, WorkerView

REF = "#/components/schemas/{model}"
JSON = "application/json"
RETRY_AFTER_STATUSES = (429, 503)
# Printable characters, as the route checks them (str.isprintable) on a header that WSGI reads as
# Latin-1; not starting with a space, as HTTP strips the spaces around a field value.
IDEMPOTENCY_KEY_PATTERN = "^[!-~\\u00a1-\\u00ac\\u00ae-\\u00ff][ -~\\u00a1-\\u00ac\\u00ae-\\u00ff]*$"
WEBHOOKS_OFF = ("this service sends no webhooks (SLOTQ_WEBHOOK_SECRET is unset): a `webhook` URL is "
                "refused with 400 `webhooks_disabled`.")
CANCEL_KEEPS_THE_RECORD = (
    "A cancel, not a deletion: the job stops (at once while it waits, at its next step while it runs) "
    "and its record stays. `GET /v1/jobs/{id}` keeps answering 200 with status `canceled` until the "
    "record expires (SLOTQ_RECORD_TTL_S), then 410; a second DELETE answers 409 `already_finished`.")

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
LINE_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["waiting", "capacity", "by_priority", "limits"],
    "properties": {"waiting": {"type": "integer", "minimum": 0},
                   "capacity": {"type": "integer", "minimum": 1},
                   "by_priority": _BY_CLASS, "limits": _BY_CLASS},
}
# A model's line also says whether an operator paused it (docs/operations.md).
MODEL_LINE_SCHEMA: dict[str, Any] = {
    **LINE_SCHEMA, "required": [*LINE_SCHEMA["required"], "paused"],
    "properties": {**LINE_SCHEMA["properties"], "paused": {"type": "boolean"}},
}
# The service's totals, and each model's line by its name.
QUEUE_SCHEMA: dict[str, Any] = {
    **LINE_SCHEMA, "required": [*LINE_SCHEMA["required"], "models"],
    "properties": {**LINE_SCHEMA["properties"],
                   "models": {"type": "object", "additionalProperties": MODEL_LINE_SCHEMA}},
}

CHANGE = {"required": True, "content": {JSON: {"schema": {"$ref": REF.format(model="JobChange")}}}}

# An operator's view of one model's line (api/admin.py).
ADMIN_LINE: dict[str, Any] = {
    "type": "object", "required": ["model", "paused", "waiting"],
    "properties": {"model": _STRING, "paused": {"type": "boolean"},
                   "waiting": {"type": "object", "additionalProperties": {"type": "integer", "minimum": 0}}},
}

_TENANTS_VIEW: dict[str, Any] = {"allOf": [{"$ref": REF.format(model="JobView")}, {
    "type": "object", "properties": {"tenant": {"anyOf": [_STRING, {"type": "null"}]}}}]}
ADMIN_JOBS: dict[str, Any] = {
    "type": "object", "required": ["lines"],
    "properties": {"lines": {"type": "array", "items": {
        "type": "object", "required": ["model", "running", "waiting", "waiting_count"],
        "properties": {"model": _STRING, "running": {"type": "array", "items": _TENANTS_VIEW},
                       "waiting": {"type": "array", "items": _TENANTS_VIEW},
                       "waiting_count": {"type": "integer", "minimum": 0}}}}},
}

# GET /v1/jobs: a page of views and the cursor of the next (null on the last page).
JOBS_PAGE: dict[str, Any] = {
    "type": "object", "required": ["jobs", "next"],
    "properties": {"jobs": {"type": "array", "maxItems": MAX_LIMIT,
                            "items": {"$ref": REF.format(model="JobView")}},
                   "next": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
}
LIST_PARAMETERS = [
    {"name": "status", "in": "query", "required": False, "style": "form", "explode": True,
     "description": "Only jobs of these statuses (repeat it, or separate them with commas).",
     "schema": {"type": "array", "items": {"type": "string", "enum": list(JobStatus)}}},
    {"name": "limit", "in": "query", "required": False, "description": "Jobs a page lists.",
     "schema": {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT, "default": DEFAULT_LIMIT}},
    {"name": "cursor", "in": "query", "required": False,
     "schema": {"type": "string", "pattern": f"^{CURSOR.pattern}$"},
     "description": "The `next` of the page before, as it was given: the jobs admitted before it."},
]
WORKERS_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["workers"],
    "properties": {"workers": {"type": "array", "items": {"$ref": REF.format(model="WorkerView")}}},
}
MODELS_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["models", "object", "data"],
    "properties": {"models": {"type": "array", "items": {"$ref": REF.format(model="ModelInfo")}},
                   # The same names in OpenAI's list shape, for its clients (``client.models.list()``).
                   "object": {"const": "list"},
                   "data": {"type": "array", "items": {
                       "type": "object", "required": ["id", "object", "created", "owned_by"],
                       "properties": {"id": _STRING, "object": {"const": "model"},
                                      "created": {"type": "integer"}, "owned_by": _STRING}}}},
}
# A job's request as its view shows it: its input images are references, never data: URLs.
STORED_REQUEST = "StoredRequest"


def _media(fields: dict[str, Any], model: ModelInfo, max_frames: int) -> None:
    """What a job of the model's media may send: an image model's no clip; a video model's a clip of
    frames on its multiple, and none of what its families refuse (the contract's FamilySpec)."""
    if model.frame_multiple is None:
        for name in ("frames", "fps"):
            fields[name] = {"type": "null", "default": None, "description": "Always null: these models make "
                            "images (a video model's job sends its clip's frames and rate)."}
        return
    multiple = model.frame_multiple
    frames = list(range(multiple + 1, max_frames + 1, multiple))
    fields["frames"] = {**fields["frames"], "anyOf": [{"type": "integer", "enum": frames}]}
    fields["fps"] = {**fields["fps"], "anyOf": [{"type": "integer", "minimum": 1, "maximum": MAX_FPS}]}
    fields["num_images"] = {**fields["num_images"], "const": 1}
    fields["speed"] = {**fields["speed"], "enum": ["normal", "auto"]}
    fields["prompt_syntax"] = {**fields["prompt_syntax"], "enum": ["plain"]}
    for name in ("hires", "mask", "image"):
        fields[name] = {"type": "null", "default": None, "description": "Always null: not for these models."}


def openapi_document(settings: Settings) -> dict[str, Any]:
    """The OpenAPI 3.1 document with these settings' limits and features (a copy the caller may change).

    With several models it offers what every one of them takes (the default's defaults, the largest
    side multiple, the samplers and adapters they all have): a job valid by it is valid for any model.
    """
    webhooks = settings.webhook_secret is not None
    offered = [model_info(name, family, available_adapters(settings.lora_dir_of(name))).model_copy(
        update=settings.controls_of(name, family)) for name, family in settings.offered_models.items()]
    videos = all(info.media == "video" for info in offered)  # with an image model among them, no clip
    common = offered[0].model_copy(update={
        "media": "video" if videos else "image",
        "frame_multiple": max(info.frame_multiple or 0 for info in offered) if videos else None,
        "side_multiple": max(info.side_multiple for info in offered),
        "schedulers": [s for s in offered[0].schedulers if all(s in info.schedulers for info in offered)],
        "loras": [lora for lora in offered[0].loras if all(lora in info.loras for info in offered)],
        "controlnets": [name for name in offered[0].controlnets
                        if all(name in info.controlnets for info in offered)],
        "ip_adapters": [name for name in offered[0].ip_adapters
                        if all(name in info.ip_adapters for info in offered)]})
    return copy.deepcopy(_document(settings.max_side, settings.max_steps, settings.max_frames, webhooks,
                                   tuple(info.name for info in offered), common.model_dump_json()))


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


def _served_codes(webhooks: bool) -> dict[int, list[str]]:
    """The error codes by status that a service with (or without) webhooks may answer."""
    never = errors.WebhookNotAllowedError if not webhooks else errors.WebhooksDisabledError
    return {status: [code for code in codes if code != never.code] for status, codes in error_codes().items()}


def _text(description: str, media_type: str) -> dict[str, Any]:
    return {"description": description, "content": {media_type: {"schema": _STRING}}}


EVENT_ID_SCHEMA = {"type": "string", "pattern": "^" + EVENT_ID.pattern + "$"}
EVENT_PARAMETERS = [
    {"name": "Last-Event-ID", "in": "header", "required": False, "schema": EVENT_ID_SCHEMA,
     "description": "The id of the last event had: the stream goes on after it (EventSource sends it)."},
    {"name": "last_event_id", "in": "query", "required": False, "schema": EVENT_ID_SCHEMA,
     "description": "The same, for a first connection (EventSource cannot set the header)."},
]
EVENTS_DESCRIPTION = ("`queued` (the view: position, ETA; again each time the position changes), `started`, "
                      "`progress` (`{\"step\", \"total\"}`), `preview` (with `\"previews\": true`: "
                      "`{\"step\", \"image\"}`, the image a JPEG `data:` URL of at most 256 px), "
                      "then one of `succeeded`, `failed`, `canceled`, "
                      "`expired` (the final view), after which the stream ends; a comment every 15 s.")
JOB_ID = {"name": "id", "in": "path", "required": True, "schema": _STRING,
          "description": "The job id that POST /v1/jobs returned."}
INPUT_NAME = {"name": "name", "in": "path", "required": True,
              "schema": {"type": "string", "enum": list(INPUT_NAMES)},
              "description": "`image` (the start image) or `mask`."}
IMAGE_INDEX = {"name": "index", "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0},
               "description": "The image's index, from 0."}
IDEMPOTENCY_KEY = {"name": "Idempotency-Key", "in": "header", "required": False,
                   "description": "A retry with the same key and body answers 200 with the first job.",
                   "schema": {"type": "string", "minLength": 1, "maxLength": MAX_IDEMPOTENCY_KEY,
                              "pattern": IDEMPOTENCY_KEY_PATTERN}}
# Free text, as RFC 7240 has it: a preference the server does not know, or a malformed one, is
# ignored. Only `wait=N` (whole seconds) is acted on; above MAX_WAIT_S it is cut to MAX_WAIT_S.
PREFER = {"name": "Prefer", "in": "header", "required": False, "schema": _STRING,
          "description": f"`wait=N`: hold the answer until the job ends or N seconds pass (at most "
                         f"{MAX_WAIT_S}; an answer may take that long, by design); a job that ended "
                         f"answers 200 with `Preference-Applied`."}
WAIT = {"name": "wait", "in": "query", "required": False,
        "description": "Hold the answer until the job's status changes or this many seconds pass: "
                       "an answer may take that long, by design.",
        "schema": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_WAIT_S}}
LOCATION = {"Location": {"description": "The job's URL.", "schema": _STRING}}
APPLIED = {**LOCATION, "Preference-Applied": {"description": "`wait=N` when a `Prefer: wait=N` was applied.",
                                              "schema": _STRING}}
# Where a submitted job is read, canceled and its first image fetched (the stateful tests follow them).
_OF_THE_JOB = {"id": "$response.body#/id"}
JOB_LINKS = {"getJob": {"operationId": "getJob", "parameters": _OF_THE_JOB},
             "cancelJob": {"operationId": "cancelJob", "parameters": _OF_THE_JOB},
             "getFirstImage": {"operationId": "getImage", "parameters": {**_OF_THE_JOB, "index": "0"}}}


# A request line or headers past gunicorn's limits (4094 and 8190 bytes): answered before the app.
SERVER_REFUSALS = (414, 431)


@lru_cache(maxsize=8)
def _document(max_side: int, max_steps: int, max_frames: int, webhooks: bool, names: tuple[str, ...],
              common: str) -> dict[str, Any]:
    """Build the document once per distinct set of limits, features, models and what they all take."""
    codes, model = _served_codes(webhooks), ModelInfo.model_validate_json(common)
    return {
        "openapi": "3.1.0",
        "info": {"title": "slotq", "version": "1",
                 "description": "A GPU image-generation job service with capped admission."},
        "tags": [*compat_document.TAGS, {"name": "Operations", "description": "The operators' routes, behind "
                 "an admin key (SLOTQ_ADMIN_KEYS): pause and resume a line, move a job to the front."}],
        "paths": {**_job_paths(codes), **_service_paths(codes), **_admin_paths(codes),
                  **compat_document.paths()},
        "components": {"schemas": {**_model_schemas(max_side, max_steps, webhooks, model, names, max_frames),
                                   "Error": ERROR_SCHEMA},
                       # No operation answers 405 itself; any other method on a documented path does.
                       "responses": {"MethodNotAllowed": _not_allowed(codes[405])}},
    }


def _operation(codes: dict[int, list[str]], operation_id: str, summary: str, responses: dict[str, Any],
               failures: tuple[int, ...], **extra: Any) -> dict[str, Any]:
    """One operation, with the error answers of each of its ``failures`` statuses, and those the web
    server gives any request it cannot read (api/server.py's error pages)."""
    refusals = {str(status): _error(status, codes[status]) for status in (*failures, *SERVER_REFUSALS)}
    return {"operationId": operation_id, "summary": summary, **extra, "responses": {**responses, **refusals}}


def _job_paths(codes: dict[int, list[str]]) -> dict[str, Any]:
    """The jobs: submit, read, cancel, and their images."""
    png = {"image/png": {"schema": {"type": "string", "contentMediaType": "image/png"}}}
    return {
        "/v1/jobs": {"post": _operation(
            codes, "submitJob", "Admit a job, or refuse it at once.",
            {"202": {**_json("Admitted.", "JobView", LOCATION), "links": JOB_LINKS},
             "200": {**_json("An idempotent retry, or with `Prefer: wait=N` a job that ended within N s.",
                             "JobView", APPLIED), "links": JOB_LINKS}},
            (400, 403, 409, 413, 415, 422, 429, 503), parameters=[IDEMPOTENCY_KEY, PREFER],
            requestBody={"required": True, "content": {JSON: {"schema": _ref("JobRequest")}}}),
            "get": _operation(codes, "listJobs", "The caller's jobs, newest first, a page at a time.",
                              {"200": _json("A page of jobs.", JOBS_PAGE)}, (422, 503),
                              parameters=LIST_PARAMETERS)},
        "/v1/jobs/{id}": {
            "parameters": [JOB_ID],
            "get": _operation(codes, "getJob", "A job's status, progress and result links.",
                              {"200": _json("The job.", "JobView")}, (404, 410, 422, 429, 503),
                              parameters=[WAIT]),
            "patch": _operation(codes, "changeJob", "Move a waiting job to another class its key may use.",
                                {"200": _json("The job, at its place now.", "JobView")},
                                (400, 403, 404, 409, 410, 415, 422, 503), requestBody=CHANGE),
            "delete": _operation(codes, "cancelJob", "Cancel a job.",
                                 {"200": _json("Canceled now.", "JobView"),
                                  "202": _json("Its worker stops it at its next step.", "JobView")},
                                 (404, 409, 410, 503), description=CANCEL_KEEPS_THE_RECORD),
        },
        "/v1/jobs/{id}/events": {
            "parameters": [JOB_ID],
            "get": _operation(codes, "streamJobEvents", "A job's events, as server-sent events.",
                              {"200": _text(EVENTS_DESCRIPTION, "text/event-stream"),
                               "204": {"description": "The client had the final event: nothing more comes."}},
                              (404, 410, 422, 429, 503), parameters=EVENT_PARAMETERS),
        },
        "/v1/jobs/{id}/images/{index}": {
            "parameters": [JOB_ID, IMAGE_INDEX],
            "get": _operation(codes, "getImage", "One finished image as PNG.",
                              {"200": {"description": "The image.", "content": png},
                               "307": {"description": "With an S3 result store and SLOTQ_S3_PRESIGN: the "
                                                      "image at a short-lived presigned URL (`Location`).",
                                       "headers": {"Location": {"schema": {"type": "string",
                                                                           "format": "uri"}}}}},
                              (404, 409, 410, 503)),
        },
        "/v1/jobs/{id}/images/{index}.png": {  # for clients that name the file after its URL
            "parameters": [JOB_ID, IMAGE_INDEX],
            "get": _operation(codes, "getImageFile", "The same image, at a URL that ends as its file does.",
                              {"200": {"description": "The image.", "content": png}}, (404, 409, 410, 503)),
        },
        "/v1/jobs/{id}/video.mp4": {
            "parameters": [JOB_ID],
            "get": _operation(codes, "getVideo", "A finished video job's clip, as H.264 MP4.",
                              {"200": {"description": "The clip (yuv420p, its index first, so playback "
                                                      "starts before the end arrives).",
                                       "headers": {"Accept-Ranges": {"schema": {"type": "string"}}},
                                       "content": {"video/mp4": {"schema": {
                                           "type": "string", "contentMediaType": "video/mp4"}}}},
                               "206": {"description": "The bytes a `Range: bytes=...` header asked for.",
                                       "headers": {"Content-Range": {"schema": {"type": "string"}}},
                                       "content": {"video/mp4": {"schema": {
                                           "type": "string", "contentMediaType": "video/mp4"}}}}},
                              (404, 409, 410, 416, 503),
                              description="For a job on a video model (`media: video` in GET /v1/models); "
                                          "its first frame is `images[0]`, the poster."),
        },
        "/v1/jobs/{id}/preview": {
            "parameters": [JOB_ID],
            "get": _operation(codes, "getPreview", "A running job's latest preview, as JPEG.",
                              {"200": {"description": "The preview, at most 256 px on its long side; the "
                                                      "`Preview-Step` header says which step it shows.",
                                       "headers": {"Preview-Step": {"schema": {"type": "integer"}}},
                                       "content": {"image/jpeg": {"schema": {
                                           "type": "string", "contentMediaType": "image/jpeg"}}}}},
                              (404, 409, 410, 503),
                              description='For a job submitted with `"previews": true`, while it runs; '
                                          "otherwise `409 no_preview`."),
        },
        "/v1/jobs/{id}/inputs/{name}": {
            "parameters": [JOB_ID, INPUT_NAME],
            "get": _operation(codes, "getInput", "One input image of a job, as it was sent.",
                              {"200": {"description": "The image, in the media type it was sent as.",
                                       "content": {media_type: {"schema": {"type": "string",
                                                                           "contentMediaType": media_type}}
                                                   for media_type in FORMATS}}},
                              (404, 410, 503)),
        },
    }


def _service_paths(codes: dict[int, list[str]]) -> dict[str, Any]:
    """The queue, the workers, the probes, this document, the metrics and the web page."""
    def get(operation_id: str, summary: str, response: dict[str, Any], *failures: int) -> dict[str, Any]:
        return {"get": _operation(codes, operation_id, summary, {"200": response}, failures)}

    filename = {"name": "filename", "in": "path", "required": True, "schema": _STRING,
                "description": "A file of the page (app.js, style.css)."}
    return {
        "/v1/queue": get("getQueue", "How many jobs wait, by class, and each class's limit.",
                         _json("The queue.", QUEUE_SCHEMA), 503),
        "/v1/workers": get("listWorkers", "The live workers, their device, state and job ids.",
                           _json("The workers.", WORKERS_SCHEMA), 503),
        "/v1/models": get("listModels", "The models a job may name: family, samplers, defaults, workers.",
                          _json("The models.", MODELS_SCHEMA), 503),
        "/healthz": get("healthz", "The process is alive.", _json("Alive.", _status("ok"))),
        "/readyz": get("readyz", "Redis answers and the process is not draining.",
                       _json("Ready.", _status("ready")), 503),
        "/openapi.json": get("openapi", "This document.", _json("OpenAPI 3.1.", {"type": "object"})),
        "/metrics": get("metrics", "Prometheus metrics of the API and the queue.",
                        _text("The metrics.", "text/plain"), 503),
        "/": get("page", "The web page: a prompt form and the submitted job's progress.",
                 _text("The page.", "text/html")),
        "/ui/{filename}": {"parameters": [filename],
                           **get("pageAsset", "A script or style sheet of the web page.",
                                 _text("The file.", "text/javascript"), 404)},
    }


def _admin_paths(codes: dict[int, list[str]]) -> dict[str, Any]:
    """The operators' routes (api/admin.py), behind an admin key."""
    model = {"name": "model", "in": "path", "required": True, "schema": _STRING,
             "description": "A model's name (SLOTQ_MODEL_NAMES)."}
    worker = {"name": "name", "in": "path", "required": True, "schema": _STRING,
              "description": "A live worker's name (GET /v1/workers)."}
    admin = (401, 403, 503)

    def line_action(operation_id: str, summary: str) -> dict[str, Any]:
        return {"parameters": [model],
                "post": _operation(codes, operation_id, summary, {"200": _json("The line now.", ADMIN_LINE)},
                                   (*admin, 422), tags=["Operations"])}

    return {
        "/v1/admin/lines": {"get": _operation(
            codes, "adminLines", "Every model's line: paused or not, and how many wait in each class.",
            {"200": _json("The lines.", {"type": "object", "required": ["lines"],
                                         "properties": {"lines": {"type": "array", "items": ADMIN_LINE}}})},
            admin, tags=["Operations"])},
        "/v1/admin/jobs": {"get": _operation(
            codes, "adminJobs", "Every tenant's running jobs and the first waiting of each model's line, "
                                "in the order workers take them, each view with its tenant.",
            {"200": _json("The jobs by line.", ADMIN_JOBS)}, (*admin, 422), tags=["Operations"],
            parameters=[{"name": "limit", "in": "query", "required": False,
                         "schema": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100},
                         "description": "Waiting jobs listed a line."}])},
        "/v1/admin/lines/{model}/pause": line_action(
            "pauseLine", "Stop workers taking this model's jobs: admission goes on, a running job finishes."),
        "/v1/admin/lines/{model}/resume": line_action(
            "resumeLine", "Let workers take this model's jobs again, in their order."),
        "/v1/admin/workers": {"get": _operation(
            codes, "adminWorkers", "Every live worker: its state, jobs and hold, and where its models are.",
            {"200": _json("The workers.", WORKERS_SCHEMA)}, admin, tags=["Operations"])},
        "/v1/admin/workers/{name}/release": {"parameters": [worker], "post": _operation(
            codes, "releaseWorker", "Have a live worker let go of its device and claim nothing for `hold_s` "
                                    "seconds, or until resumed.",
            {"200": _json("Held: it lets go at its next job boundary.", {
                "type": "object", "required": ["worker", "held", "held_until"],
                "properties": {"worker": _STRING, "held": {"const": True},
                               "held_until": {"anyOf": [{"type": "string", "format": "date-time"},
                                                        {"type": "null"}]}}})},
            (400, *admin, 404, 415, 422), tags=["Operations"], requestBody=_optional_body("WorkerHold"))},
        "/v1/admin/workers/{name}/resume": {"parameters": [worker], "post": _operation(
            codes, "resumeWorker", "End a worker's hold: it claims again.",
            {"200": _json("It claims again.", {
                "type": "object", "required": ["worker", "held"],
                "properties": {"worker": _STRING, "held": {"const": False}}})},
            (*admin, 404), tags=["Operations"])},
        "/v1/admin/workers/{name}/drain": {"parameters": [worker], "post": _operation(
            codes, "drainWorker", "Have a live worker finish its execution and claim nothing more: then "
                                  "exit, or stay, held until resumed.",
            {"200": _json("Asked: its next heartbeat takes it.", {
                "type": "object", "required": ["worker", "draining", "exit"],
                "properties": {"worker": _STRING, "draining": {"const": True},
                               "exit": {"type": "boolean"}}})},
            (400, *admin, 404, 415, 422), tags=["Operations"], requestBody=_optional_body("WorkerDrain"))},
        "/v1/admin/jobs/{id}": {"parameters": [JOB_ID], "patch": _operation(
            codes, "adminChangeJob", "Move any tenant's waiting job to another class its tenant may use.",
            {"200": _json("The job, at its place now.", "JobView")}, (400, *admin, 404, 409, 410, 415, 422),
            tags=["Operations"], requestBody=CHANGE)},
        "/v1/admin/jobs/{id}/front": {"parameters": [JOB_ID], "post": _operation(
            codes, "moveJobToFront", "Move any tenant's waiting job to the front of its class.",
            {"200": _json("The job, at its new place.", "JobView")}, (*admin, 404, 409),
            tags=["Operations"])},
    }


def _optional_body(model: str) -> dict[str, Any]:
    """A JSON body that may be left out (an empty request takes the model's defaults)."""
    return {"required": False, "content": {JSON: {"schema": {"$ref": REF.format(model=model)}}}}


def _model_schemas(max_side: int, max_steps: int, webhooks: bool, model: ModelInfo, names: tuple[str, ...],
                   max_frames: int = 257) -> dict[str, Any]:
    """The models' JSON schemas, plus the limits their validators take from the settings and the
    model (its family's sampler names and side multiple; the defaults are the family's too), and the
    names a job's ``model`` may give."""
    schemas: dict[str, Any] = {}
    for kind in (JobRequest, JobView, JobChange, WorkerView, WorkerHold, WorkerDrain, ModelInfo):
        # What a client sends, as it may send it; what it reads, as the service writes it.
        schema = kind.model_json_schema(ref_template=REF,
                                        mode="validation" if kind is JobRequest else "serialization")
        if kind is JobView:
            schema = _renamed(schema, JobRequest.__name__, STORED_REQUEST)
        schemas.update(schema.pop("$defs", {}))
        schemas[kind.__name__] = schema
    side = {"minimum": MIN_SIDE, "maximum": max_side, "multipleOf": model.side_multiple}
    limits = {"width": side, "height": side, "steps": {"maximum": max_steps}}
    fields = schemas["JobRequest"]["properties"]
    for name in limits.keys() & fields.keys():
        fields[name] = {**fields[name], **limits[name]}
    hires_steps = schemas["HiresRequest"]["properties"]["steps"]["anyOf"][0]
    hires_steps["maximum"] = max_steps
    # Models of families without a sampler in common (SD and Flux) take only their own: none named.
    samplers = [{"enum": model.schedulers, "type": "string"}] if model.schedulers else []
    fields["scheduler"] = {**fields["scheduler"], "anyOf": [*samplers, {"type": "null"}]}
    fields["model"] = {**fields["model"], "anyOf": [{"enum": list(names), "type": "string"},
                                                    {"type": "null"}]}
    for name, value in model.within(max_side, max_frames).defaults.model_dump().items():
        fields[name] = {**fields[name], "default": value}
    # The adapters a job may name are the files of SLOTQ_LORA_DIR now; with none, a job names none.
    if model.loras:
        named = {"properties": {"name": {"enum": model.loras}}}
        fields["loras"] = {**fields["loras"], "items": {"allOf": [fields["loras"]["items"], named]}}
    else:
        fields["loras"] = {**fields["loras"], "maxItems": 0,
                           "description": "Always empty: this service has no LoRA adapters (SLOTQ_LORA_DIR)."}
    # Likewise the ControlNets of SLOTQ_CONTROLNET_DIR.
    if model.controlnets:
        named = {"properties": {"name": {"enum": model.controlnets}}}
        fields["controlnets"] = {**fields["controlnets"],
                                 "items": {"allOf": [fields["controlnets"]["items"], named]}}
    else:
        fields["controlnets"] = {**fields["controlnets"], "maxItems": 0, "description": "Always empty: "
                                 "this service has no ControlNets for these models (SLOTQ_CONTROLNET_DIR)."}
    # And the IP-Adapters of SLOTQ_IP_ADAPTER_DIR: with none, a job sends none.
    if model.ip_adapters:
        schemas["IpAdapterRequest"]["properties"]["name"] = {
            **schemas["IpAdapterRequest"]["properties"]["name"], "enum": model.ip_adapters}
    else:
        fields["ip_adapter"] = {"type": "null", "default": None, "description": "Always null: this service "
                                "has no IP-Adapters for these models (SLOTQ_IP_ADAPTER_DIR)."}
    _media(fields, model, max_frames)
    # A mask repaints an image: sent without one, it is refused.
    schemas["JobRequest"]["dependentSchemas"] = {"mask": {"anyOf": [
        {"properties": {"mask": {"type": "null"}}},
        {"required": ["image"], "properties": {"image": {"type": "string"}}}]}}
    if not webhooks:
        # Without SLOTQ_WEBHOOK_SECRET no webhook is sent, so none is offered: a URL is refused.
        fields["webhook"] = {"type": "null", "default": None, "title": fields["webhook"].get("title"),
                             "description": "Always null: " + WEBHOOKS_OFF}
        fields["webhook_events"] = {**fields["webhook_events"], "description": "Ignored: " + WEBHOOKS_OFF}
    return schemas


def _renamed(schema: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """The schema with the component ``old`` (in its ``$defs`` and every reference to it) named ``new``."""
    defs = schema.get("$defs", {})
    if old in defs:
        defs[new] = defs.pop(old)
    before, after = json.dumps(REF.format(model=old)), json.dumps(REF.format(model=new))
    return json.loads(json.dumps(schema).replace(before, after))


def _error(status: int, codes: list[str]) -> dict[str, Any]:
    """The error envelope, its code one of ``codes``, with ``Retry-After`` where it applies."""
    narrowed = {"properties": {"error": {"properties": {"code": {"enum": codes}}}}}
    response = _json(f"Error: {', '.join(codes)}.", {"allOf": [_ref("Error"), narrowed]})
    if status in RETRY_AFTER_STATUSES:
        response["headers"] = {"Retry-After": {"required": True, "description": "Seconds to wait.",
                                               "schema": {"type": "integer", "minimum": 1}}}
    return response


def _not_allowed(codes: list[str]) -> dict[str, Any]:
    """The 405 answer of any method a path does not have, with the ones it has in ``Allow``."""
    response = _error(405, codes)
    response["headers"] = {"Allow": {"required": True, "schema": _STRING,
                                     "description": "The methods this path has (RFC 9110, 10.2.1)."}}
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

