"""The OpenAI Videos API (``client.videos``, base URL ``http://host:8000/v1``), translated into slotq
video jobs.

``POST /v1/videos`` (multipart, as the openai package sends it, or JSON) becomes a native job body on
a video model, checked by the job contract and admitted by the one admission; it answers at once
with OpenAI's Video object, whose id is the job's (the same job is at ``/v1/jobs/<id>``).
``GET /v1/videos/<id>`` reads it (``client.videos.poll``), ``/content`` serves its MP4 or its poster,
``GET /v1/videos`` lists the caller's video jobs in OpenAI's pages and ``DELETE`` cancels one. Errors
come in OpenAI's envelope, as the Images surface renders them (``openai_images.render``).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from fractions import Fraction
from itertools import dropwhile, islice
from typing import Any, Literal

from flask import Blueprint, Response, g, jsonify, request
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from api import bodies, routes, state
from api.compat import calls, openai_images, uploads
from api.errors import as_service_error
from api.jobs import Ticket
from shared.contract import logs
from shared.contract.errors import (
    AlreadyFinishedError,
    InvalidRequestError,
    JobNotFoundError,
    NotFoundError,
    UnknownModelError,
)
from shared.contract.images import read_data_url
from shared.contract.jobs import MAX_FPS, MAX_LIMIT, JobStatus, JobView
from shared.contract.models import ModelInfo

bp = Blueprint("openai_videos", __name__)

# OpenAI's own video models, which clients send by default: each means the caller's video model (the
# one it chose where that makes clips, else the first video model offered) unless SLOTQ_MODEL_ALIASES
# maps it.
OPENAI_MODEL_PREFIXES = ("sora-",)
# slotq's fields a request may add to OpenAI's (``extra_body`` in the openai package).
EXTENSIONS = ("negative_prompt", "seed", "steps", "guidance_scale", "fps")
# Multipart sends every field as text: the numbers, parsed.
FORM_FIELDS: dict[str, Callable[[str], Any]] = {"seed": int, "steps": int, "guidance_scale": float,
                                                "fps": int}
# input_reference as an object (``{"image_url": ...}``), as multipart spells its keys.
REFERENCE_FIELD = re.compile(r"input_reference\[(\w+)\]")
# OpenAI's name of each job field that an error may name (openai_images.render maps width and height).
PARAMS = {"frames": "seconds", "image": "input_reference"}
SECONDS = re.compile(r"\d{1,4}(\.\d{1,3})?")
STATUSES = {JobStatus.QUEUED: "queued", JobStatus.RUNNING: "in_progress", JobStatus.SUCCEEDED: "completed"}
# How soon ``client.videos.poll`` asks again (its openai-poll-after-ms header): the job's ETA, within these.
POLL_MS = (250, 5000)
# GET /v1/videos reads the native listing (newest first, every kind of job) a page at a time and keeps
# the clips; at most this many pages a call, so a caller with many image jobs costs a bounded read.
LIST_PAGES = 50
DEFAULT_LIST = 20


class ImageReference(BaseModel):
    """OpenAI's input_reference as an object: an image by URL (here a ``data:`` URL) or by file id."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    image_url: str | None = None
    file_id: str | None = None


class VideoRequest(BaseModel):
    """OpenAI's video request, and slotq's extensions (checked by the job contract; ``fps`` here too,
    as ``seconds`` becomes frames at it); any other field is refused, as OpenAI refuses it."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str
    model: str | None = None
    seconds: str | None = None
    size: str | None = None
    input_reference: ImageReference | None = None  # an upload comes as a file instead
    fps: int | None = Field(None, ge=1, le=MAX_FPS)
    negative_prompt: Any = None
    seed: Any = None
    steps: Any = None
    guidance_scale: Any = None


@bp.post("/v1/videos")
@calls.admitting("openai")
def create() -> Response:
    """Admit a clip (``client.videos.create``): answered at once, queued."""
    body = _form_body() if request.mimetype == "multipart/form-data" else bodies.json_body()
    asked = openai_images.parsed(VideoRequest, body)
    jobs = state.jobs()
    ticket = Ticket(bodies.idempotency_key(), state.tenant(), logs.request_id.get())
    submitted = jobs.submit(jobs.submission(_job_body(asked, _video_model(asked.model))), ticket)
    g.admission = "replayed" if submitted.replayed else "admitted"
    g.about = submitted.about  # the request's log line says it (api/observability.py)
    return jsonify(_video(submitted.view))


@bp.get("/v1/videos")
def list_videos() -> Response:
    """The caller's clips, newest first (``order=asc``: oldest first), ``limit`` a page from ``after``."""
    limit, after, order = _limit(request.args.get("limit")), request.args.get("after"), _order()
    clips: Iterable[JobView] = _clips()
    if order == "asc":
        clips = reversed(list(clips))
    if after is not None:  # those after that one; none where it is not listed
        clips = islice(dropwhile(lambda view: view.id != after, clips), 1, None)
    page = list(islice(clips, limit + 1))
    data = [_video(view) for view in page[:limit]]
    return jsonify({"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                    "last_id": data[-1]["id"] if data else None, "has_more": len(page) > limit})


@bp.get("/v1/videos/<video_id>")
def retrieve(video_id: str) -> Response:
    """A clip's Video object (``client.videos.retrieve``, which ``poll`` repeats)."""
    view = _clip(video_id)
    response = jsonify(_video(view))
    if not view.status.is_terminal:
        response.headers["openai-poll-after-ms"] = str(_poll_after_ms(view))
    return response


@bp.get("/v1/videos/<video_id>/content")
def content(video_id: str) -> Response:
    """A finished clip's MP4 (ranged reads answer 206), or with ``variant=thumbnail`` its poster PNG."""
    variant = request.args.get("variant", "video")
    if variant not in ("video", "thumbnail"):
        message = "this service makes `video` (the MP4) and `thumbnail` (its first frame, a PNG)"
        raise InvalidRequestError(details=[{"loc": ["variant"], "msg": message}])
    view = _clip(video_id)
    if view.status is not JobStatus.SUCCEEDED:
        # OpenAI answers 404 until the video is completed: a client's download loop expects it.
        raise NotFoundError(f"Video {video_id} is {STATUSES.get(view.status, 'failed')}, not completed: it "
                            f"has no content (GET /v1/videos/{video_id} says when it has).")
    jobs, tenant = state.jobs(), state.tenant()
    if variant == "thumbnail":
        found = jobs.image(video_id, 0, tenant)
        if isinstance(found, str):  # SLOTQ_S3_PRESIGN: the poster in the bucket
            return Response(status=307, headers={"Location": found, "Cache-Control": "no-store"})
        return Response(found, mimetype="image/png", headers={"Cache-Control": "private, max-age=3600"})
    return routes.get_video(video_id)  # the native route's answer: its ranged reads included


@bp.delete("/v1/videos/<video_id>")
def delete(video_id: str) -> Response:
    """Cancel a clip that has not ended (``client.videos.delete``). One that has ended is kept until its
    results expire (SLOTQ_RESULT_TTL_S), so its answer says ``deleted: false``: slotq deletes no results."""
    _clip(video_id)
    try:
        state.jobs().cancel(video_id, state.tenant())
    except AlreadyFinishedError:  # it ended, before or meanwhile
        return jsonify({"id": video_id, "object": "video.deleted", "deleted": False})
    return jsonify({"id": video_id, "object": "video.deleted", "deleted": True})


def render(exc: Exception) -> tuple[Response, int]:
    """Any error of this surface in OpenAI's envelope, as the Images surface renders them, the job's
    fields named as this API names them (``frames`` is ``seconds``, ``image`` is ``input_reference``)."""
    error = as_service_error(exc)
    if error.details:
        error.details = [{**detail, "loc": _renamed(detail.get("loc") or [])} for detail in error.details]
    return openai_images.render(error)


bp.register_error_handler(Exception, render)


def _renamed(loc: list[Any]) -> list[Any]:
    return [PARAMS.get(loc[0], loc[0]), *loc[1:]] if loc and isinstance(loc[0], str) else loc


def _form_body() -> dict[str, Any]:
    """A multipart request's text fields, each as JSON would carry it; its upload is read apart."""
    unknown = sorted(set(request.files) - {"input_reference"})
    if unknown:
        raise InvalidRequestError(details=[{"loc": [name], "msg": "not a file this API takes"}
                                           for name in unknown])
    body: dict[str, Any] = {}
    for name, text in request.form.items():
        nested = REFERENCE_FIELD.fullmatch(name)
        if nested:
            body.setdefault("input_reference", {})[nested[1]] = text
        else:
            body[name] = openai_images.form_value(name, text, FORM_FIELDS)
    return body


def _job_body(asked: VideoRequest, model: ModelInfo) -> dict[str, Any]:
    """The native job a request asks for: its seconds as frames, its size as sides, its
    input_reference as the start image; what it leaves out, the model's defaults."""
    size = openai_images.size_of(asked.size, model)
    body = {"prompt": asked.prompt, "model": model.name,
            **asked.model_dump(include=set(EXTENSIONS), exclude_none=True)}
    frames = _frames(asked.seconds, asked.fps or model.defaults.fps, model)
    if frames is not None:
        body["frames"] = frames
    if size is not None:
        body["width"], body["height"] = size
    image = _start_image(asked.input_reference, size, model)
    if image is not None:
        body["image"] = image
    return body


def _video_model(name: str | None) -> ModelInfo:
    """slotq's video model for the name a request gives (absent, empty or OpenAI's: the caller's)."""
    settings, jobs = state.settings(), state.jobs()
    if name in settings.model_aliases:
        chosen = settings.model_aliases[name]
    elif name in settings.offered_models:
        chosen = name
    elif not name or name.startswith(OPENAI_MODEL_PREFIXES):
        chosen = _caller_video_model()
    else:
        offered = ", ".join([*settings.offered_models, *settings.model_aliases, "sora-*"])
        raise UnknownModelError(f"No model named {name[:64]!r}; this service takes {offered}.")
    model = jobs.model(chosen)
    if model.media != "video":
        videos = ", ".join(info.name for info in jobs.models() if info.media == "video") or "none"
        message = f"{chosen} makes images, not videos; this service's video models: {videos}"
        raise InvalidRequestError(details=[{"loc": ["model"], "msg": message}])
    return model


def _caller_video_model() -> str:
    """The model the caller chose where it makes clips, else the first video model offered."""
    chosen = calls.caller_model()
    models = state.jobs().models()
    videos = [info.name for info in models if info.media == "video"]
    if chosen in videos:
        return chosen
    if not videos:
        raise UnknownModelError("This service offers no video model (SLOTQ_MODEL_NAMES): its models make "
                                "images.")
    return videos[0]


def _frames(seconds: str | None, fps: int | None, model: ModelInfo) -> int | None:
    """The frames of a clip of ``seconds`` at ``fps``: the most the model makes within ``seconds *
    fps + 1`` (its first frame is the clip's start), at least its shortest; None where absent."""
    if seconds is None:
        return None
    multiple, most = model.frame_multiple or 1, state.settings().max_frames
    length = Fraction(seconds) if SECONDS.fullmatch(seconds) else Fraction(0)
    if not length or fps is None:
        raise InvalidRequestError(details=[{"loc": ["seconds"], "msg": f"{seconds[:20]!r} is not a "
                                            "number of seconds, such as \"4\""}])
    frames = max(int(length * fps / multiple), 1) * multiple + 1
    if frames > most:
        longest = (most - 1) // multiple * multiple / fps
        message = f"{seconds} s at {fps} fps is {frames} frames; this service makes at most {longest:g} s"
        raise InvalidRequestError(details=[{"loc": ["seconds"], "msg": message}])
    return frames


def _start_image(reference: ImageReference | None, size: tuple[int, int] | None,
                 model: ModelInfo) -> str | None:
    """The uploaded input_reference (or its ``image_url``) as the job's ``image``, a ``data:`` URL,
    resized to ``size`` where given (OpenAI's video has the size asked for), else to the nearest the
    model makes. None without one; a model that takes none refuses it in the job contract."""
    files = request.files.getlist("input_reference")
    settings = state.settings()
    if files:
        data = files[0].read()
    elif reference is not None and reference.image_url is not None:
        data = read_data_url("input_reference", reference.image_url, max_bytes=settings.max_image_bytes,
                             max_pixels=uploads.UPLOAD_MAX_PIXELS).data
    elif reference is not None:
        message = "this service keeps no files: upload the image, or send `image_url` as a data: URL"
        raise InvalidRequestError(details=[{"loc": ["input_reference", "file_id"], "msg": message}])
    else:
        return None
    image, url = uploads.opened("input_reference", data, settings.max_image_bytes)
    fitted = size or uploads.fitted(image.size, settings.max_side, model.side_multiple)
    return url if fitted == image.size else uploads.png_url(image.convert("RGB").resize(
        fitted, Image.Resampling.LANCZOS))


def _clip(video_id: str) -> JobView:
    """The caller's video job of this id: another's, or an image job, is no video."""
    view = state.jobs().read(video_id, state.tenant())
    if not view.request.is_video:
        raise JobNotFoundError(f"No video with id {video_id!r}: it is an image job (GET /v1/jobs/"
                               f"{video_id}).")
    return view


def _clips() -> Iterator[JobView]:
    """The caller's video jobs, newest first, from at most LIST_PAGES pages of the native listing."""
    jobs, tenant, cursor = state.jobs(), state.tenant(), None
    for _ in range(LIST_PAGES):
        page = jobs.page(tenant, MAX_LIMIT, cursor=cursor)
        yield from (view for view in page.jobs if view.request.is_video)
        if page.next is None:
            return
        cursor = page.next


def _limit(text: str | None) -> int:
    if text is None:
        return DEFAULT_LIST
    if not (text.isdigit() and len(text) <= 3 and 1 <= int(text) <= MAX_LIMIT):
        raise InvalidRequestError(details=[{"loc": ["limit"], "msg": f"must be a whole number from 1 to "
                                                                     f"{MAX_LIMIT}"}])
    return int(text)


def _order() -> Literal["asc", "desc"]:
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError(details=[{"loc": ["order"], "msg": "must be asc or desc"}])
    return "asc" if order == "asc" else "desc"


def _video(view: JobView) -> dict[str, Any]:
    """A video job as OpenAI's Video object."""
    asked = view.request
    ended = _unix(view.finished_at) if view.status.is_terminal else None
    succeeded = view.status is JobStatus.SUCCEEDED
    fps = asked.fps or 1  # a video job's request has its fps: the contract fills the model's default
    return {"id": view.id, "object": "video", "model": view.model,
            "status": STATUSES.get(view.status, "failed"), "progress": _progress(view),
            "created_at": _unix(view.created_at), "completed_at": ended,
            "expires_at": ended + state.settings().result_ttl_s if succeeded and ended else None,
            "size": f"{asked.width}x{asked.height}", "seconds": f"{((asked.frames or 1) - 1) / fps:g}",
            "prompt": asked.prompt, "error": _error(view), "remixed_from_video_id": None}


def _progress(view: JobView) -> int:
    """Percent done: 100 once it succeeded, else its steps' share (never 100 before it has its clip)."""
    if view.status is JobStatus.SUCCEEDED:
        return 100
    progress = view.progress
    return min(99, 100 * progress.step // progress.total) if progress and progress.total else 0


def _error(view: JobView) -> dict[str, str] | None:
    """Why a job ended without its clip (OpenAI's failed covers canceled and expired too)."""
    if not view.status.is_terminal or view.status is JobStatus.SUCCEEDED:
        return None
    if view.error is not None:
        return {"code": view.error.code, "message": view.error.message}
    return {"code": view.status.value, "message": f"The job was {view.status.value}."}


def _poll_after_ms(view: JobView) -> int:
    finish = view.eta_s.finish if view.eta_s else 1.0
    low, high = POLL_MS
    return int(min(max(finish * 1000, low), high))


def _unix(moment: datetime | None) -> int:
    return int(moment.timestamp()) if moment else int(time.time())
