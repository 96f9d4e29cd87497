"""The ``/sdapi/v1`` routes: each translates (``translate``, ``images``), calls what the native
routes call (``api/compat/calls.py``, ``api/jobs.py``) and answers as A1111 does.

With API keys on, a caller sends its key as HTTP Basic's password (A1111's ``--api-auth``; any user
name); with keys off any Authorization header is ignored (Open WebUI and SillyTavern send an empty
``Basic ``). Every answer, errors included, is JSON: A1111's clients parse each.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

from flask import Blueprint, Response, jsonify, request

from api import bodies, state
from api.compat import calls, credentials
from api.compat.a1111 import controlnet, images, translate
from api.errors import as_service_error
from shared.contract.errors import (
    AlreadyFinishedError,
    InvalidRequestError,
    JobEndedError,
    JobNotFoundError,
    NoPreviewError,
    UnauthorizedError,
)
from shared.contract.jobs import JobView
from shared.contract.models import ModelInfo
from shared.store import preferences

bp = Blueprint("a1111", __name__, url_prefix="/sdapi/v1")
# The ControlNet extension's own routes (webuiapi's ControlNetInterface lists models and modules there).
controlnet_bp = Blueprint("a1111_controlnet", __name__, url_prefix="/controlnet")
SURFACE = "a1111"
BASIC_REALM = 'Basic realm="slotq"'
NEEDS_KEY = "Send the API key as the password of HTTP Basic authentication (any user name)."

# What slotq has none of, as A1111 answers when it has none: the lists its clients read (SillyTavern
# fails its upscaler list unless both of the first two answer; webuiapi reads /scripts when it starts).
EMPTY: dict[str, Any] = {
    "upscalers": [], "latent-upscale-modes": [], "sd-vae": [], "sd-modules": [],
    "embeddings": {"loaded": {}, "skipped": {}},
}
IDLE_STATE = {"skipped": False, "interrupted": False, "stopping_generation": False, "job": "",
              "job_count": 0, "job_timestamp": "0", "job_no": 0, "sampling_step": 0, "sampling_steps": 0}


@bp.before_request
@controlnet_bp.before_request
def authenticate() -> None:
    """With API keys on, the caller's tenant from its key: Basic's password (or a bearer token)."""
    if not state.key_policies():
        return
    sent = credentials.sent()
    credentials.authenticate((sent.password if sent.type == "basic" else sent.token) if sent else None,
                             NEEDS_KEY)


def render(exc: Exception) -> tuple[Response, int]:
    """Any error in A1111's envelope (its ``api_middleware``), with slotq's code beside it."""
    error = calls.noted(as_service_error(exc))
    details = [{**detail, "loc": renamed(detail.get("loc", []))} for detail in error.details or []]
    response = jsonify({"error": type(error).__name__, "detail": str(error), "body": "",
                        "errors": details or f"{error.status}: {error}", "code": error.code})
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(error.retry_after)
    if isinstance(error, UnauthorizedError):
        response.headers["WWW-Authenticate"] = BASIC_REALM
    return response, error.status


bp.register_error_handler(Exception, render)
controlnet_bp.register_error_handler(Exception, render)


def renamed(loc: list[Any]) -> list[Any]:
    """A refusal's location in the names the client sent (``cfg_scale``, not ``guidance_scale``;
    ``hr_scale``, not ``hires.scale``)."""
    nested = translate.A1111_FIELDS.get(".".join(map(str, loc[:2]))) if len(loc) > 1 else None
    if nested is not None:
        return [nested, *loc[2:]]
    return [translate.A1111_FIELDS.get(loc[0], loc[0]), *loc[1:]] if loc else loc


# --- generating --------------------------------------------------------------------------------------

@bp.post("/txt2img")
@calls.admitting(SURFACE)
def txt2img() -> Response:
    """Make images from a prompt, once the job ends."""
    return generate(img2img=False)


@bp.post("/img2img")
@calls.admitting(SURFACE)
def img2img() -> Response:
    """Make images from a start image (and a mask), once the job ends."""
    return generate(img2img=True)


def generate(img2img: bool) -> Response:
    """Translate the body, run its job through the one admission and answer with its images; a job
    interrupted (``/interrupt``) answers 200 with none, as its ``info`` says."""
    body = json_object()
    call = translate.translate(translate.Call(body, model_of(body), img2img=img2img))
    if img2img:
        images.add_inputs(call, state.settings())
    controlnet.add_controls(call, state.settings())
    submitted = calls.submission(call.job)
    try:
        finished = calls.run(submitted)
    except JobEndedError as error:
        if error.job_status != "canceled":
            raise
        return jsonify(translate.answer(call, submitted.request, [], None, error.job_id))
    pngs = [base64.b64encode(png).decode() for png in finished.pngs]
    view = finished.view
    return jsonify(translate.answer(call, view.request, pngs, view, view.id))


def json_object() -> dict[str, Any]:
    """The request's JSON object (A1111 reads a body whatever its Content-Type)."""
    try:
        body = bodies.loads(request.get_data(cache=False))
    except ValueError as exc:
        raise InvalidRequestError(f"The body is not valid JSON: {exc}.",
                                  details=[{"loc": ["body"], "msg": str(exc)}]) from None
    if not isinstance(body, dict):
        raise InvalidRequestError("The body must be a JSON object.",
                                  details=[{"loc": ["body"], "msg": "must be a JSON object"}])
    return body


def model_of(body: dict[str, Any]) -> ModelInfo:
    """The model of a call: its ``override_settings.sd_model_checkpoint``, else the caller's."""
    overrides = body.get("override_settings")
    asked = overrides.get("sd_model_checkpoint") if isinstance(overrides, dict) else None
    name = checkpoint_named(asked) if asked not in (None, "") else calls.caller_model()
    return state.jobs().model(name)


def checkpoint_named(value: Any) -> str:
    """The slotq model an A1111 checkpoint name means, or ``UnknownModelError``."""
    settings = state.settings()
    return translate.model_named(value, list(settings.offered_models), settings.model_aliases)


# --- models, samplers and options --------------------------------------------------------------------

@bp.get("/sd-models")
def sd_models() -> Response:
    """The models a job may run on, as checkpoints."""
    return jsonify([translate.checkpoint(info) for info in state.jobs().models()])


@bp.get("/samplers")
def samplers() -> Response:
    """The samplers a job on the caller's model can run."""
    return jsonify([{"name": sampler.name, "aliases": list(sampler.aliases), "options": sampler.options}
                    for sampler in translate.samplers_of(caller_model())])


@bp.get("/schedulers")
def schedulers() -> Response:
    """The schedule types a job on the caller's model can apply."""
    listed = []
    for name in translate.schedules_of(caller_model()):
        label, aliases, rho, inner = translate.SCHEDULES[name]
        listed.append({"name": name, "label": label, "aliases": list(aliases) or None, "default_rho": rho,
                       "need_inner_model": inner})
    return jsonify(listed)


@bp.get("/loras")
def loras() -> Response:
    """The LoRA adapters a prompt on the caller's model may name as ``<lora:name:weight>``."""
    # The file's name within the LoRA folder: the server's own paths are not the caller's to know.
    return jsonify([{"name": name, "alias": name, "metadata": {}, "path": f"{name}.safetensors"}
                    for name in caller_model().loras])


@bp.get("/options")
def get_options() -> Response:
    """The caller's checkpoint (its chosen model, else the default) and the few options clients read."""
    name = calls.caller_model()
    return jsonify({"sd_model_checkpoint": translate.title(name),
                    "sd_checkpoint_hash": translate.model_hash(name), **translate.OPTIONS})


@bp.post("/options")
def set_options() -> Response:
    """Choose the caller's model (``sd_model_checkpoint``; any other option is ignored): its later
    calls run on it. Per tenant: no other caller's model changes, and no worker switches."""
    body = json_object()
    if "sd_model_checkpoint" in body:
        name = checkpoint_named(body["sd_model_checkpoint"])
        preferences.choose_model(state.queue().connection, state.settings(), state.tenant(), name)
    return jsonify(None)


def caller_model() -> ModelInfo:
    return state.jobs().model(calls.caller_model())


# --- progress and interruption -----------------------------------------------------------------------

@bp.get("/progress")
def progress() -> Response:
    """The caller's running job: its share done, the time left, the latest preview (plain base64)."""
    running = state.jobs().running(state.tenant())
    if not running:
        return jsonify({"progress": 0.0, "eta_relative": 0.0, "state": IDLE_STATE, "current_image": None,
                        "textinfo": None})
    view = running[0]
    step, total = (view.progress.step, view.progress.total) if view.progress else (0, view.request.steps_run)
    share = step / total if total else 0.0
    elapsed = (datetime.now(UTC) - view.started_at).total_seconds() if view.started_at else 0.0
    skip_image = request.args.get("skip_current_image", "").lower() == "true"
    job_state = {**IDLE_STATE, "job": view.id, "job_count": len(running),
                 "job_timestamp": translate.timestamp(view.started_at), "sampling_step": step,
                 "sampling_steps": total}
    return jsonify({"progress": share, "eta_relative": elapsed / share - elapsed if share else 0.0,
                    "state": job_state, "current_image": None if skip_image else preview(view),
                    "textinfo": f"slotq job {view.id}: step {step} of {total}"})


def preview(view: JobView) -> str | None:
    """A running job's latest preview as plain base64 (a JPEG), or None while it has none."""
    try:
        jpeg, _ = state.jobs().preview(view.id, state.tenant())
    except (NoPreviewError, JobNotFoundError):
        return None
    return base64.b64encode(jpeg).decode()


@bp.post("/interrupt")
def interrupt() -> Response:
    """Cancel the caller's running jobs (never another tenant's); their calls answer at once."""
    stop_running()
    return jsonify({})


@bp.post("/skip")
def skip() -> Response:
    """A1111 skips the image being made; a call is one slotq job, so this stops it as /interrupt does."""
    stop_running()
    return jsonify(None)


def stop_running() -> None:
    for view in state.jobs().running(state.tenant()):
        try:
            state.jobs().cancel(view.id, state.tenant())
        except (AlreadyFinishedError, JobNotFoundError):
            pass  # it ended meanwhile


# --- scripts: the ControlNet extension where there are ControlNets ------------------------------------

@bp.get("/scripts")
def scripts() -> Response:
    """The scripts by mode, as A1111 lists them: ``controlnet`` (its alwayson units, which slotq maps)
    where the caller's model has ControlNets; clients look for it before they send units."""
    names = [controlnet.SCRIPT] if caller_model().controlnets else []
    return jsonify({"txt2img": names, "img2img": names})


@controlnet_bp.get("/version")
def controlnet_version() -> Response:
    """The extension's API version its clients check (sd-webui-controlnet's ``/controlnet/version``)."""
    return jsonify({"version": controlnet.VERSION})


@controlnet_bp.get("/model_list")
def controlnet_models() -> Response:
    """The ControlNets a unit on the caller's model may name (SLOTQ_CONTROLNET_DIR)."""
    return jsonify({"model_list": caller_model().controlnets})


@controlnet_bp.get("/module_list")
def controlnet_modules() -> Response:
    """The preprocessors a unit may name: those slotq runs."""
    return jsonify({"module_list": list(dict.fromkeys(controlnet.MODULES)), "module_detail": {}})


# --- what slotq has none of ---------------------------------------------------------------------------

def empty(name: str) -> Response:
    return jsonify(EMPTY[name])


for _name in EMPTY:
    bp.add_url_rule(f"/{_name}", f"empty_{_name}", lambda name=_name: empty(name), methods=["GET"])
