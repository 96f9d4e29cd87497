"""ComfyUI's HTTP API, each route at ``/x`` and ``/api/x`` as ComfyUI serves them: a graph posted to
``/prompt`` becomes one slotq job (``graph.translate``) admitted by the one admission, and the
routes that read it back (``/history``, ``/queue``, ``/view``, the websocket in ``socket.py``) answer
from that job and the surface's own records (``prompts.py``).

A caller is its bearer key's tenant, as on the native API (with keys off, every caller is the same
one). Another tenant's prompt reads as unknown everywhere; ``/view`` serves an output to a request
without a key by its file name alone (Open WebUI fetches it so). Every error is ComfyUI's envelope,
``{"error": {type, message, details, extra_info}, "node_errors": {...}}``, with slotq's code as the
type.
"""

from __future__ import annotations

import io
import json
import platform
from collections.abc import Callable
from typing import Any

from flask import Blueprint, Response, g, jsonify, request
from PIL import Image
from werkzeug.datastructures import FileStorage

from api import state
from api.compat import calls, credentials
from api.compat.a1111 import images
from api.compat.comfyui import graph, nodes, prompts
from api.compat.comfyui.prompts import Prompt, Prompts
from api.errors import as_service_error
from api.jobs import Ticket
from shared.contract import logs
from shared.contract.errors import (
    InvalidRequestError,
    JobNotFoundError,
    NotFoundError,
    ResultExpiredError,
    UnauthorizedError,
)
from shared.contract.jobs import JobStatus, JobView
from shared.contract.tenants import Tenant

bp = Blueprint("comfyui", __name__)
SURFACE = "comfyui"
NEEDS_KEY = "Send the API key as a bearer token: Authorization: Bearer <key>."
MAX_HISTORY = 100  # the ended prompts /history lists without max_items, newest
MAX_NAME = 255  # an upload's longest file name, as a file system's
FOLDERS = ("checkpoints", "diffusion_models", "loras", "controlnet")  # GET /models


def route(rule: str, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A view at ``rule`` and at ``/api`` + ``rule`` (ComfyUI's frontend uses the second)."""
    def register(view: Callable[..., Any]) -> Callable[..., Any]:
        bp.add_url_rule(rule, view_func=view, **options)
        bp.add_url_rule(f"/api{rule}", view_func=view, **options)
        return view
    return register


@bp.before_request
def authenticate() -> None:
    """With API keys on, the caller's tenant from its bearer key. ``/view`` also answers a request
    with no key at all (an output's name is its capability; ``view``)."""
    if not state.key_policies():
        return
    sent = credentials.sent()
    key = sent.token if sent is not None and sent.type == "bearer" else None
    if not key and request.endpoint == "comfyui.view":
        g.comfyui_keyless = True
        return
    credentials.authenticate(key, NEEDS_KEY)


def render(exc: Exception) -> tuple[Response, int]:
    """Any error in ComfyUI's envelope, with slotq's code as its type; a request that fails validation
    is a 400, as ComfyUI answers every invalid one."""
    if isinstance(exc, graph.GraphError):
        g.error_code = "invalid_graph"
        return jsonify(exc.envelope()), 400
    error = calls.noted(as_service_error(exc))
    details = "; ".join(f"{'.'.join(map(str, each.get('loc', [])))}: {each.get('msg', '')}"
                        for each in error.details or [])
    response = jsonify({"error": {"type": error.code, "message": str(error), "details": details,
                                  "extra_info": {"code": error.code}}, "node_errors": {}})
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(error.retry_after)
    if isinstance(error, UnauthorizedError):
        response.headers["WWW-Authenticate"] = 'Bearer realm="slotq"'
    return response, 400 if error.status == 422 else error.status


bp.register_error_handler(Exception, render)


def store() -> Prompts:
    """The surface's records, on the queue's Redis."""
    return Prompts(state.queue().connection, state.settings().record_ttl_s)


# --- running a graph ---------------------------------------------------------------------------------

@route("/prompt", methods=["POST"])
@calls.admitting(SURFACE)
def submit_prompt() -> Response:
    """Admit a graph as one job: ``{prompt_id, number, node_errors: {}}``; a graph slotq cannot run
    is a 400 naming its nodes, a full line a 429; either admits nothing."""
    body = json_object()
    client_id = body.get("client_id") or ""
    extra_data = body.get("extra_data") or {}
    if not isinstance(client_id, str) or len(client_id) > prompts.MAX_CLIENT_ID:
        raise InvalidRequestError(details=[{"loc": ["client_id"], "msg": "a string of at most "
                                            f"{prompts.MAX_CLIENT_ID} characters"}])
    if not isinstance(extra_data, dict):
        raise InvalidRequestError(details=[{"loc": ["extra_data"], "msg": "an object"}])
    tenant, settings = state.tenant(), state.settings()
    mapped = graph.translate(body.get("prompt"), state.jobs().models(),
                             lambda name: store().uploaded(tenant, name), settings)
    job = {**mapped.body, "previews": True}  # as ComfyUI's frontend shows them: cheap (docs/http-api.md)
    if body.get("front") is True and (tenant is None or "high" in tenant.priorities):
        job["priority"] = "high"
    submitted = calls.submission(job)
    outcome = state.jobs().submit(submitted, Ticket(None, tenant, logs.request_id.get()))
    g.admission, g.about = "admitted", outcome.about
    records = store()
    prompt = Prompt(outcome.view.id, records.number(), prompts.tenant_name(tenant), client_id,
                    body["prompt"], extra_data, mapped.order, mapped.sampler,
                    mapped.outputs)
    records.save(prompt)
    return jsonify({"prompt_id": prompt.id, "number": prompt.number, "node_errors": {}})


@route("/prompt", methods=["GET"])
def prompt_status() -> Response:
    """How many of the caller's prompts have not ended."""
    return jsonify({"exec_info": {"queue_remaining": remaining(state.tenant())}})


@route("/queue", methods=["GET"])
def queue() -> Response:
    """The caller's prompts that run and that wait, in ComfyUI's tuple shape."""
    running, pending = unended(state.tenant())
    return jsonify({"queue_running": [prompt.queue_item() for prompt in running],
                    "queue_pending": [prompt.queue_item() for prompt in pending]})


@route("/queue", methods=["POST"])
def change_queue() -> Response:
    """``{"delete": [prompt_id, ...]}`` cancels those of the caller's waiting prompts; ``{"clear":
    true}`` every one of them."""
    body, tenant = json_object(), state.tenant()
    _, pending = unended(tenant)
    chosen = pending if body.get("clear") is True else [prompt for prompt in pending
                                                        if prompt.id in ids_in(body, "delete")]
    for prompt in chosen:
        state.jobs().cancel(prompt.id, tenant)
    return Response(status=200)


@route("/interrupt", methods=["POST"])
def interrupt() -> Response:
    """Stop the caller's running prompt (``{"prompt_id"}`` names which, else every one it runs)."""
    body, tenant = json_object(optional=True), state.tenant()
    asked = body.get("prompt_id")
    running, _ = unended(tenant)
    for prompt in running:
        if asked is None or prompt.id == asked:
            state.jobs().cancel(prompt.id, tenant)
    return Response(status=200)


def unended(tenant: Tenant | None) -> tuple[list[Prompt], list[Prompt]]:
    """The caller's prompts that run, and those that wait, in their order."""
    running, pending = list[Prompt](), list[Prompt]()
    views = sorted(state.jobs().page(tenant, 100, {JobStatus.QUEUED, JobStatus.RUNNING}).jobs,
                   key=lambda view: view.position if view.position is not None else -1)
    for view, prompt in zip(views, store().many([view.id for view in views], tenant), strict=True):
        if prompt is not None:
            (running if view.status is JobStatus.RUNNING else pending).append(prompt)
    return running, pending


def remaining(tenant: Tenant | None) -> int:
    running, pending = unended(tenant)
    return len(running) + len(pending)


# --- what ran ------------------------------------------------------------------------------------------

@route("/history", methods=["GET"])
def history() -> Response:
    """The caller's ended prompts, oldest first: the newest ``max_items`` (else the newest MAX_HISTORY)."""
    limit = request.args.get("max_items", type=int) or MAX_HISTORY
    tenant, records, found = state.tenant(), store(), {}
    listed = records.listed(tenant, newest=min(max(limit, 1), prompts.MAX_LISTED))
    kept = records.ended(listed)
    for prompt in listed:
        entry = kept.get(prompt.id) or history_entry(prompt, tenant)
        if entry is not None:
            found[prompt.id] = entry
    return jsonify(found)


@route("/history/<prompt_id>", methods=["GET"])
def prompt_history(prompt_id: str) -> Response:
    """One prompt's outputs and status once it has ended; ``{}`` before, and for an unknown id."""
    tenant, records = state.tenant(), store()
    prompt = records.get(prompt_id, tenant)
    entry = None
    if prompt is not None:
        entry = records.ended([prompt]).get(prompt.id) or history_entry(prompt, tenant)
    return jsonify({prompt_id: entry} if entry is not None else {})


@route("/history", methods=["POST"])
def change_history() -> Response:
    """``{"delete": [prompt_id, ...]}`` or ``{"clear": true}``: out of the caller's history (the
    jobs, and their images at ``/v1/jobs``, stay until they expire)."""
    body, tenant, records = json_object(), state.tenant(), store()
    chosen = records.listed(tenant) if body.get("clear") is True else [
        prompt for prompt in (records.get(each, tenant) for each in ids_in(body, "delete")) if prompt]
    for prompt in chosen:
        records.forget(prompt)
    return Response(status=200)


def history_entry(prompt: Prompt, tenant: Tenant | None) -> dict[str, Any] | None:
    """A prompt as ``/history`` shows it once its job has ended (then kept: it changes no more);
    None before (or once it is gone)."""
    view = job_view(prompt.id, tenant)
    if view is None or not view.status.is_terminal:
        return None
    succeeded = view.status is JobStatus.SUCCEEDED
    outputs = {output.node: {"images": prompt.images(output, len(view.images))}
               for output in prompt.outputs} if succeeded else {}
    entry = {"prompt": prompt.queue_item(), "outputs": outputs,
             "status": {"status_str": "success" if succeeded else "error", "completed": succeeded,
                        "messages": ended_messages(prompt, view)},
             "meta": {node: {"node_id": node, "display_node": node, "parent_node": None, "real_node_id": node}
                      for node in outputs}}
    store().keep_ended(prompt, entry)
    return entry


def ended_messages(prompt: Prompt, view: JobView) -> list[list[Any]]:
    """The messages ComfyUI keeps in a prompt's history: its start and how it ended."""
    started = stamp(view.started_at or view.created_at)
    ended = stamp(view.finished_at or view.started_at or view.created_at)
    messages: list[list[Any]] = [["execution_start", {"prompt_id": prompt.id, "timestamp": started}]]
    if view.status is JobStatus.SUCCEEDED:
        messages.append(["execution_cached", {"nodes": [], "prompt_id": prompt.id, "timestamp": started}])
        messages.append(["execution_success", {"prompt_id": prompt.id, "timestamp": ended}])
    elif view.status is JobStatus.CANCELED:
        messages.append(["execution_interrupted", interrupted(prompt, ended)])
    else:
        messages.append(["execution_error", failure(prompt, view, ended)])
    return messages


def interrupted(prompt: Prompt, timestamp: int) -> dict[str, Any]:
    return {"prompt_id": prompt.id, "node_id": prompt.sampler, "node_type": prompt.class_of(prompt.sampler),
            "executed": [], "timestamp": timestamp}


def failure(prompt: Prompt, view: JobView, timestamp: int) -> dict[str, Any]:
    """An ended job's error as ComfyUI's ``execution_error``, at the sampler that ran it."""
    error = view.error
    return {"prompt_id": prompt.id, "node_id": prompt.sampler, "node_type": prompt.class_of(prompt.sampler),
            "executed": [], "exception_message": error.message if error else f"The job {view.status.value}.",
            "exception_type": error.code if error else view.status.value, "traceback": [],
            "current_inputs": {}, "current_outputs": {}, "timestamp": timestamp}


def stamp(moment: Any) -> int:
    """A time as ComfyUI's messages give it: milliseconds since the epoch."""
    return int(moment.timestamp() * 1000) if moment is not None else 0


def job_view(prompt_id: str, tenant: Tenant | None) -> JobView | None:
    """The prompt's job as it is now; None once its record is gone."""
    try:
        return state.jobs().read(prompt_id, tenant)
    except (JobNotFoundError, ResultExpiredError):
        return None


# --- files -----------------------------------------------------------------------------------------------

@route("/view", methods=["GET"])
def view() -> Response:
    """An output's image by its file name (``type`` output or temp), or an upload (``type`` input)."""
    name, kind = request.args.get("filename", ""), request.args.get("type", "output")
    subfolder = request.args.get("subfolder", "")
    keyless = g.get("comfyui_keyless", False)
    if kind == "input":
        data = None if keyless else store().uploaded(state.tenant(), upload_name(subfolder, name))
        if data is None:
            raise NotFoundError("No upload of yours has this name.")
        media_type = Image.MIME.get(images.opened("image", data, state.settings()).format or "", "image/png")
        return Response(data, mimetype=media_type, headers={"Cache-Control": "private, max-age=3600"})
    found = store().by_file(name)
    if found is None or (not keyless and found[0].tenant != prompts.tenant_name(state.tenant())):
        raise NotFoundError("No output has this name.")
    prompt, index = found
    image = state.jobs().image(prompt.id, index)
    if isinstance(image, str):  # SLOTQ_S3_PRESIGN: the bucket serves it
        return Response(status=307, headers={"Location": image, "Cache-Control": "no-store"})
    return Response(image, mimetype="image/png", headers={"Cache-Control": "private, max-age=3600"})


@route("/upload/image", methods=["POST"])
def upload_image() -> Response:
    """Keep an image for a graph's ``LoadImage``: multipart ``image``, ``subfolder``, ``overwrite``;
    checked as any input image is. ``{name, subfolder, type}``."""
    name, data, _ = uploaded_image()
    return kept(name, data)


@route("/upload/mask", methods=["POST"])
def upload_mask() -> Response:
    """Keep an earlier upload (``original_ref``: ``{filename, subfolder}``) with the alpha of the
    ``image`` sent, under that image's name, as ComfyUI's mask editor saves a mask: ``LoadImage``'s
    mask is where it is transparent."""
    name, data, mask = uploaded_image()
    try:
        ref = json.loads(request.form.get("original_ref", ""))
    except ValueError:
        ref = None
    if not isinstance(ref, dict) or not isinstance(ref.get("filename"), str):
        raise InvalidRequestError(details=[{"loc": ["original_ref"], "msg": "JSON `{filename, subfolder}` of "
                                            "an image uploaded before"}])
    original_name = upload_name(str(ref.get("subfolder") or ""), graph.ANNOTATION.sub("", ref["filename"]))
    original = store().uploaded(state.tenant(), original_name)
    if original is None:
        raise NotFoundError(f"No upload of yours is named {original_name!r} (`original_ref`).")
    combined = images.opened("original_ref", original, state.settings()).convert("RGBA")
    if mask.size != combined.size:
        sizes = f"{mask.width}x{mask.height}, its original {combined.width}x{combined.height}"
        raise InvalidRequestError(details=[{"loc": ["image"], "msg": f"the mask is {sizes}"}])
    combined.putalpha(mask.convert("RGBA").getchannel("A"))
    buffer = io.BytesIO()
    combined.save(buffer, "PNG")
    return kept(name, buffer.getvalue())


def uploaded_image() -> tuple[str, bytes, Image.Image]:
    """The multipart ``image``: its name (``subfolder/name``), bytes, and the image they hold (refused
    as any input image is: its type, its pixels)."""
    upload = request.files.get("image")
    if not isinstance(upload, FileStorage):
        raise InvalidRequestError(details=[{"loc": ["image"], "msg": "a multipart file field `image`"}])
    name = (upload.filename or "image.png").replace("\\", "/").rsplit("/", 1)[-1][:MAX_NAME] or "image.png"
    data = upload.read(state.settings().max_body_bytes + 1)
    image = images.opened("image", data, state.settings())
    return upload_name(request.form.get("subfolder", ""), name), data, image


def kept(name: str, data: bytes) -> Response:
    """Keep an upload for the caller: ``{name, subfolder, type}`` (a free name unless ``overwrite``)."""
    overwrite = request.form.get("overwrite", "").lower() in ("true", "1")
    stored = store().upload(state.tenant(), name, data, overwrite)
    subfolder, _, base = stored.rpartition("/")
    return jsonify({"name": base, "subfolder": subfolder, "type": request.form.get("type", "input")})


def upload_name(subfolder: str, name: str) -> str:
    """An upload's name as LoadImage names it: ``subfolder/name``, or the name alone."""
    return f"{subfolder.strip('/')}/{name}" if subfolder.strip("/") else name


# --- what this service runs -------------------------------------------------------------------------------

@route("/object_info", methods=["GET"])
def object_info() -> Response:
    """Every node class slotq runs, with its inputs in ComfyUI's shape."""
    return jsonify(catalog())


@route("/object_info/<node_class>", methods=["GET"])
def object_info_of(node_class: str) -> Response:
    """One node class's entry; ``{}`` for a class slotq does not run."""
    entry = catalog().get(node_class)
    return jsonify({node_class: entry} if entry is not None else {})


def catalog() -> dict[str, Any]:
    served = state.jobs().models()
    loras = sorted({name for model in served for name in model.loras})
    controlnets = sorted({name for model in served for name in model.controlnets})
    return nodes.object_info(served, loras, controlnets)


@route("/models", methods=["GET"])
def model_folders() -> Response:
    """The model folders ``/models/<folder>`` lists."""
    return jsonify(list(FOLDERS))


@route("/models/<folder>", methods=["GET"])
def models_in(folder: str) -> Response:
    """The files a graph may name from one folder."""
    served = state.jobs().models()
    names = {
        "checkpoints": [model.name for model in served if model.family != "flux"],
        "diffusion_models": [model.name for model in served if model.family == "flux"],
        "loras": sorted({name for model in served for name in model.loras}),
        "controlnet": sorted({name for model in served for name in model.controlnets}),
    }.get(folder)
    if names is None:
        raise NotFoundError(f"The model folders are {', '.join(FOLDERS)}.")
    return jsonify([f"{name}.safetensors" for name in names])


@route("/embeddings", methods=["GET"])
@route("/extensions", methods=["GET"])
def nothing() -> Response:
    """Textual inversions and frontend extensions: slotq has none."""
    return jsonify([])


@route("/system_stats", methods=["GET"])
def system_stats() -> Response:
    """The service and the devices of its live workers."""
    devices = [{"name": f"{worker.device} {worker.name}", "type": worker.device.split(":")[0],
                "index": index, "vram_total": worker.device_memory or 0,
                "vram_free": worker.free_after_load or 0, "torch_vram_total": worker.device_memory or 0,
                "torch_vram_free": worker.free_after_load or 0}
               for index, worker in enumerate(state.jobs().workers(state.tenant()))]
    return jsonify({"system": {"os": platform.system().lower(), "python_version": platform.python_version(),
                               "comfyui_version": "slotq", "embedded_python": False, "argv": [],
                               "ram_total": 0, "ram_free": 0, "pytorch_version": ""},
                    "devices": devices})


# --- bodies ------------------------------------------------------------------------------------------------

def json_object(optional: bool = False) -> dict[str, Any]:
    """The request's JSON object body (``{}`` for none where ``optional``)."""
    if optional and not request.get_data(cache=True):
        return {}
    body = request.get_json(force=True, silent=True)
    if not isinstance(body, dict):
        raise InvalidRequestError(details=[{"loc": ["body"], "msg": "a JSON object"}])
    return body


def ids_in(body: dict[str, Any], name: str) -> set[str]:
    """The prompt ids a body's list names (strings only)."""
    value = body.get(name)
    return {each for each in value if isinstance(each, str)} if isinstance(value, list) else set()

