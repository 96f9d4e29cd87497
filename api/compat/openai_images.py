"""The OpenAI Images API (base URL ``http://host:8000/v1``), translated into slotq jobs.

``POST /v1/images/generations`` (JSON) is text-to-image; ``POST /v1/images/edits`` (multipart) is
image-to-image, or inpainting with a mask. Each request becomes a slotq job body, checked by the job
contract, admitted and waited for (``api/compat/calls.py``), and answered as OpenAI answers:
``{"created", "data": [{"b64_json"} | {"url"}]}``, errors as ``{"error": {"message", "type",
"param", "code"}}`` with the statuses the ``openai`` package maps to its exceptions.
"""

from __future__ import annotations

import base64
import io
import re
import time
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

from flask import Blueprint, Response, jsonify, request
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api import bodies, state
from api.compat import calls, uploads
from api.errors import as_service_error
from shared.contract.errors import (
    InvalidImageError,
    InvalidRequestError,
    JobEndedError,
    NotReplicatedError,
    ServiceError,
    SyncWaitExceededError,
    UnauthorizedError,
    UnknownModelError,
)
from shared.contract.jobs import MIN_SIDE
from shared.contract.models import ModelInfo

bp = Blueprint("openai", __name__)

# OpenAI's own model names, which clients send by default: each means the caller's model (the one it
# chose, else SLOTQ_MODEL_NAMES' first) unless SLOTQ_MODEL_ALIASES maps it. Any gpt-image-* too:
# Open WebUI offers gpt-image-1.5 beside gpt-image-1.
OPENAI_MODELS = ("dall-e-2", "dall-e-3")
OPENAI_MODEL_PREFIXES = ("gpt-image-",)
# OpenAI answers these with URLs when response_format is absent, and clients built for them read only
# `url` (LibreChat's DALL-E 3 tool); every other model is answered with b64_json.
URL_BY_DEFAULT = ("dall-e-2", "dall-e-3")
# slotq's fields a request may add to OpenAI's (``extra_body`` in the openai package); strength: edits only.
EXTENSIONS = ("negative_prompt", "seed", "steps", "guidance_scale", "scheduler", "loras", "strength")
# OpenAI's name of each job field that an error may name.
PARAMS = {"num_images": "n", "width": "size", "height": "size"}
OUTPUT_FORMATS = {"jpeg": "JPEG", "webp": "WEBP"}  # besides png, the job's own format: Pillow's names
# Multipart sends every field as text: the numbers and the JSON ones, parsed.
FORM_FIELDS: dict[str, Callable[[str], Any]] = {
    "n": int, "output_compression": int, "partial_images": int, "seed": int, "steps": int,
    "guidance_scale": float, "strength": float, "loras": bodies.loads,
    "stream": lambda text: {"true": True, "false": False}[text.lower()],
}
FILE_FIELDS = ("image", "image[]", "mask")
SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               429: "rate_limit_error"}
# A retry of these would admit a second job while the first goes on: the openai package reads the header.
NOT_RETRIED = (SyncWaitExceededError, JobEndedError, NotReplicatedError)


class GenerationRequest(BaseModel):
    """OpenAI's image request: the fields slotq applies, those it accepts without effect on a
    diffusion model, and its own extensions (checked by the job contract); any other is refused, as
    OpenAI refuses it."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str
    model: str | None = None
    n: int | None = None
    size: str | None = None
    response_format: Literal["b64_json", "url"] | None = None
    output_format: Literal["png", "jpeg", "webp"] | None = None
    output_compression: int | None = Field(None, ge=0, le=100)
    stream: Literal[False] | None = None  # the answer comes whole, when the job ends
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    user: str | None = None
    safety_identifier: str | None = None
    partial_images: int | None = None
    negative_prompt: Any = None
    seed: Any = None
    steps: Any = None
    guidance_scale: Any = None
    scheduler: Any = None
    loras: Any = None


Asked = TypeVar("Asked", bound=BaseModel)


class EditRequest(GenerationRequest):
    """An edit's fields besides its files: a generation's, the start image's strength, and OpenAI's
    input_fidelity."""

    strength: Any = None
    input_fidelity: str | None = None


@bp.post("/v1/images/generations")
@calls.admitting("openai")
def generations() -> Response:
    """Images from a prompt (``client.images.generate``)."""
    asked = parsed(GenerationRequest, _json_body())
    model = state.jobs().model(_model_name(asked.model))
    size = size_of(asked.size, model)
    body = _job_body(asked, model) | ({"width": size[0], "height": size[1]} if size else {})
    return jsonify(_answer(asked, calls.run(calls.submission(body))))


@bp.post("/v1/images/edits")
@calls.admitting("openai")
def edits() -> Response:
    """An image redrawn from a prompt (``client.images.edit``): image-to-image, or inpainting where a
    mask's fully transparent pixels are repainted."""
    asked = parsed(EditRequest, _form_body())
    model = state.jobs().model(_model_name(asked.model))
    body = _job_body(asked, model) | _inputs(size_of(asked.size, model), model)
    return jsonify(_answer(asked, calls.run(calls.submission(body))))


def render(exc: Exception) -> tuple[Response, int]:
    """Any error of this surface in OpenAI's envelope and statuses."""
    error = calls.noted(as_service_error(exc))
    status = 404 if isinstance(error, UnknownModelError) else 400 if error.status == 422 else error.status
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    response = jsonify({"error": {"message": _message(error), "type": kind, "param": _param(error),
                                  "code": error.code}})
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(error.retry_after)
    if isinstance(error, UnauthorizedError):
        response.headers["WWW-Authenticate"] = 'Bearer realm="slotq"'
    if isinstance(error, NOT_RETRIED):
        response.headers["x-should-retry"] = "false"
    return response, status


bp.register_error_handler(Exception, render)


def model_list(names: Iterable[str], aliases: Iterable[str]) -> dict[str, Any]:
    """The models in OpenAI's list shape (``client.models.list()``): slotq's names, then the aliases
    of SLOTQ_MODEL_ALIASES. OpenAI's own names are accepted without being listed: a client choosing
    from the list gets what it asks for."""
    # created: the Unix time the model was made, which slotq does not know.
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "slotq"}
                                       for name in dict.fromkeys([*names, *aliases])]}


def _json_body() -> Any:
    try:
        return bodies.loads(request.get_data(cache=False))
    except ValueError as exc:
        raise InvalidRequestError(f"The body is not valid JSON: {exc}.") from None


def _form_body() -> dict[str, Any]:
    """An edit's text fields, each as JSON would carry it."""
    if request.mimetype != "multipart/form-data":
        raise InvalidRequestError("Send an edit as multipart/form-data, its image as a file.")
    unknown = sorted(set(request.files) - set(FILE_FIELDS))
    if unknown:
        raise InvalidRequestError(details=[{"loc": [name], "msg": "not a file this API takes"}
                                           for name in unknown])
    return {name: form_value(name, value) for name, value in request.form.items() if name not in FILE_FIELDS}


def form_value(name: str, text: str, fields: dict[str, Callable[[str], Any]] = FORM_FIELDS) -> Any:
    """A multipart field's text as JSON would carry it: the numbers and the JSON ones among ``fields``
    parsed, the rest as text."""
    parse = fields.get(name)
    try:
        return parse(text) if parse else text
    except (ValueError, KeyError):
        message = f"{text[:40]!r} is not a valid value"
        raise InvalidRequestError(details=[{"loc": [name], "msg": message}]) from None


def parsed(kind: type[Asked], body: Any) -> Asked:
    """A body as the surface's request model, or ``InvalidRequestError`` naming what is wrong."""
    if not isinstance(body, dict):
        raise InvalidRequestError("The body must be a JSON object.")
    try:
        return kind.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequestError.of(exc) from None


def _model_name(name: str | None) -> str:
    """slotq's model for the name a request gives (absent or empty: the caller's, as for OpenAI's own)."""
    settings = state.settings()
    if name in settings.model_aliases:
        return settings.model_aliases[name]
    if name in settings.offered_models:
        return name
    if not name or name in OPENAI_MODELS or name.startswith(OPENAI_MODEL_PREFIXES):
        return calls.caller_model()
    offered = ", ".join([*settings.offered_models, *settings.model_aliases, *OPENAI_MODELS, "gpt-image-*"])
    raise UnknownModelError(f"No model named {name[:64]!r}; this service takes {offered}.")


def size_of(text: str | None, model: ModelInfo) -> tuple[int, int] | None:
    """``WIDTHxHEIGHT`` as sides the model can make; None for ``auto`` or none (the model's default
    size, or an input image's). The Videos surface reads its ``size`` so too."""
    if text is None or text == "auto":
        return None
    match = SIZE.fullmatch(text)
    largest, multiple = state.settings().max_side, model.side_multiple
    sides = (int(match[1]), int(match[2])) if match else (0, 0)
    if not all(side % multiple == 0 and MIN_SIDE <= side <= largest for side in sides):
        message = (f"{text[:20]!r} is not a size this model makes: WIDTHxHEIGHT, sides multiples of "
                   f"{multiple} from {MIN_SIDE} to {largest}, or auto")
        raise InvalidRequestError(details=[{"loc": ["size"], "msg": message}])
    return sides


def _job_body(asked: GenerationRequest, model: ModelInfo) -> dict[str, Any]:
    """The slotq job a request asks for, but for its size and input images."""
    body = {"prompt": asked.prompt, "model": model.name, **asked.model_dump(include=set(EXTENSIONS),
                                                                             exclude_none=True)}
    if asked.n is not None:
        body["num_images"] = asked.n
    return body


def _inputs(size: tuple[int, int] | None, model: ModelInfo) -> dict[str, str]:
    """An edit's files as a job's ``image`` (and ``mask``: OpenAI's transparent pixels as slotq's
    white), resized to ``size`` where it is given (OpenAI answers at the size asked for), else to
    the nearest the model makes (a photo of any size)."""
    uploaded = _upload("image") or _upload("image[]")
    if uploaded is None:
        raise InvalidRequestError(details=[{"loc": ["image"], "msg": "required: upload the image as a file"}])
    most = state.settings().max_image_bytes
    image, url = uploads.opened("image", uploaded, most)
    masked = _upload("mask")
    mask = _repainted(uploads.opened("mask", masked, most)[0]) if masked is not None else None
    if mask is not None and mask.size != image.size:
        raise InvalidImageError(f"`mask` is {mask.width}x{mask.height} and the image {image.width}x"
                                f"{image.height}: they must be the same size")
    changed = image.has_transparency_data  # a start image has none: it is drawn over
    settings = state.settings()
    size = size or uploads.fitted(image.size, settings.max_side, model.side_multiple)
    if size != image.size:
        image, changed = image.resize(size, Image.Resampling.LANCZOS), True
        mask = mask.resize(size, Image.Resampling.NEAREST) if mask is not None else None
    inputs = {"image": uploads.png_url(image.convert("RGB")) if changed else url}
    if mask is not None:
        inputs["mask"] = uploads.png_url(mask)
    return inputs


def _upload(field: str) -> bytes | None:
    files = request.files.getlist(field)
    return files[0].read() if files else None


def _repainted(mask: Image.Image) -> Image.Image:
    """An OpenAI mask (fully transparent: repaint) as slotq's (white: repaint, black: keep)."""
    if not mask.has_transparency_data:
        raise InvalidImageError("`mask` has no transparency: its fully transparent pixels are the area to "
                                "repaint, so it must have an alpha channel")
    return mask.convert("RGBA").getchannel("A").point([255] + [0] * 255)


def _answer(asked: GenerationRequest, finished: calls.Finished) -> dict[str, Any]:
    """OpenAI's answer: each image as base64 in the format asked for, or as the URL of its PNG."""
    view = finished.view
    created = int(view.finished_at.timestamp()) if view.finished_at else int(time.time())
    response_format = asked.response_format or ("url" if asked.model in URL_BY_DEFAULT else "b64_json")
    if response_format == "url":
        # The client GETs it with the credentials of this call; ".png": some name the file after the URL.
        # SLOTQ_PUBLIC_URL where set: the request's Host is the client's to choose.
        root = state.settings().public_url or request.host_url.rstrip("/")
        return {"created": created, "data": [{"url": f"{root}{path}.png"} for path in view.images]}
    encoded = [_encoded(png, asked.output_format, asked.output_compression) for png in finished.pngs]
    return {"created": created, "data": [{"b64_json": base64.b64encode(data).decode()} for data in encoded]}


def _encoded(png: bytes, output_format: str | None, compression: int | None) -> bytes:
    if output_format is None or output_format == "png":
        return png
    buffer = io.BytesIO()
    with Image.open(io.BytesIO(png)) as image:
        # OpenAI's output_compression is a quality from 0 to 100, 100 by default.
        image.convert("RGB").save(buffer, OUTPUT_FORMATS[output_format], quality=100 if compression is None
                                  else compression)
    return buffer.getvalue()


def _param(error: ServiceError) -> str | None:
    """The request field an error is about, by OpenAI's name."""
    if isinstance(error, UnknownModelError):
        return "model"
    if error.code == "unknown_lora":
        return "loras"
    if error.details:
        loc = error.details[0].get("loc")
        name = loc[0] if loc else None
    else:
        named = re.match(r"`(\w+)`", str(error))  # the contract's image errors begin with the field's name
        name = named[1] if named else None
    return PARAMS.get(name, name) if isinstance(name, str) else None


def _message(error: ServiceError) -> str:
    if not error.details:
        return str(error)
    return "; ".join(f"{_named(detail.get('loc') or ['body'])}: {detail['msg']}" for detail in error.details)


def _named(loc: list[Any]) -> str:
    """A field's place as OpenAI's names spell it: ``n``, ``size``, ``loras.0.scale``."""
    first, *rest = loc
    return ".".join([str(PARAMS.get(first, first)), *map(str, rest)])
