"""The compatibility surfaces in the OpenAPI document, each under its own tag: what their clients
send and what they parse. The foreign APIs are lenient where their clients are (A1111 takes fields
it does not apply), so these schemas say what slotq reads, not every field a client may add."""

from __future__ import annotations

from typing import Any

from shared.contract.jobs import MAX_IMAGES

OPENAI_TAG, A1111_TAG = "OpenAI Images", "AUTOMATIC1111"
TAGS = [{"name": OPENAI_TAG, "description": "OpenAI's Images API over slotq's queue (base URL `/v1`): "
         "each call admits a job and answers when it ends (SLOTQ_SYNC_WAIT_S)."},
        {"name": A1111_TAG, "description": "AUTOMATIC1111's `/sdapi/v1` over slotq's queue: each call admits "
         "a job and answers when it ends; options are kept per tenant."}]

_STRING, _INTEGER, _NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
_OBJECT = {"type": "object"}
_LIST = {"type": "array", "items": _OBJECT}
OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": _STRING, "type": _STRING, "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}
A1111_ERROR = {"type": "object", "required": ["error", "detail"],
               "properties": {"error": _STRING, "detail": _STRING, "body": {}, "errors": {}, "code": _STRING}}
# slotq's job fields an OpenAI request may add (``extra_body`` in the openai package).
EXTENSIONS = {"negative_prompt": _STRING, "seed": _INTEGER, "steps": _INTEGER, "guidance_scale": _NUMBER,
              "scheduler": _STRING, "loras": _LIST}
GENERATION: dict[str, Any] = {
    "type": "object", "required": ["prompt"], "properties": {
        "prompt": {"type": "string", "minLength": 1}, "model": _STRING,
        "n": {"type": "integer", "minimum": 1, "maximum": MAX_IMAGES},
        "size": {"type": "string", "description": "`WIDTHxHEIGHT` or `auto`: the model's default size"},
        "response_format": {"enum": ["b64_json", "url"]},
        "output_format": {"enum": ["png", "jpeg", "webp"]},
        "output_compression": {"type": "integer", "minimum": 0, "maximum": 100},
        **{name: _STRING for name in ("quality", "style", "background", "moderation", "user")},
        **EXTENSIONS}}
_BINARY = {"type": "string", "contentMediaType": "application/octet-stream"}
EDIT = {"type": "object", "required": ["image", "prompt"], "properties": {
    "image": _BINARY, "image[]": {"type": "array", "items": _BINARY},
    "mask": {**_BINARY, "description": "its fully transparent pixels are repainted"},
    "strength": {"type": "number", "description": "the share of the schedule run again (0.8)"},
    **{name: schema for name, schema in GENERATION["properties"].items() if name not in ("prompt", "n")},
    "prompt": _STRING, "n": _STRING}}
IMAGES = {"type": "object", "required": ["created", "data"], "properties": {
    "created": _INTEGER, "data": {"type": "array", "items": {
        "type": "object", "properties": {"b64_json": _STRING, "url": {"type": "string", "format": "uri"}}}}}}
TXT2IMG: dict[str, Any] = {"type": "object",
                           "description": "Fields slotq does not apply are accepted; `info` lists them.",
           "properties": {**{name: _STRING for name in ("prompt", "negative_prompt", "sampler_name",
                                                        "sampler_index", "scheduler")},
                          **{name: _INTEGER for name in ("width", "height", "steps", "seed", "batch_size",
                                                         "n_iter")},
                          "cfg_scale": _NUMBER, "override_settings": _OBJECT}}
IMG2IMG = {**TXT2IMG, "properties": {
    **TXT2IMG["properties"], "init_images": {"type": "array", "items": _STRING, "minItems": 1},
    "mask": _STRING, "denoising_strength": _NUMBER, "inpainting_mask_invert": _INTEGER,
    "mask_blur": _INTEGER}}
GENERATED = {"type": "object", "required": ["images", "parameters", "info"], "properties": {
    "images": {"type": "array", "items": _STRING, "description": "base64 PNGs, no data: prefix"},
    "parameters": _OBJECT, "info": {"type": "string", "description": "JSON text: seed, all_seeds, "
                                    "sampler_name, steps, cfg_scale, width, height, sd_model_name, job_id"}}}
PROGRESS = {"type": "object", "required": ["progress", "eta_relative", "state", "current_image"],
            "properties": {"progress": {"type": "number", "minimum": 0, "maximum": 1},
                           "eta_relative": _NUMBER, "state": _OBJECT, "textinfo": {},
                           "current_image": {"type": ["string", "null"]}}}
LISTS = {"sd-models": "The models: `title`, `model_name` (slotq's name), `hash`, `filename`.",
         "samplers": "The samplers slotq has, in A1111's names.", "schedulers": "The schedulers.",
         "loras": "The LoRA adapters a prompt may name as `<lora:name:weight>`.",
         "upscalers": "None.", "latent-upscale-modes": "None.", "sd-vae": "None.", "sd-modules": "None."}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _operation(tag: str, operation_id: str, summary: str, answer: dict[str, Any], errors: tuple[int, ...],
               body: tuple[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    envelope = OPENAI_ERROR if tag == OPENAI_TAG else A1111_ERROR
    responses = {"200": answer, **{str(status): _json(envelope, "An error in the surface's envelope.")
                                   for status in errors}}
    operation = {"tags": [tag], "operationId": operation_id, "summary": summary, "responses": responses}
    if body is not None:
        media_type, schema = body
        operation["requestBody"] = {"required": True, "content": {media_type: {"schema": schema}}}
    return operation


def paths() -> dict[str, Any]:
    """Both surfaces' operations, keyed by path."""
    refused, generated = (400, 401, 404, 429, 500, 503, 504), (401, 409, 422, 429, 500, 503, 504)
    images = _json(IMAGES, "The images, as `b64_json` or `url`.")
    a1111 = {f"/sdapi/v1/{name}": {"get": _operation(A1111_TAG, f"a1111_{name.replace('-', '_')}", summary,
                                                     _json(_LIST, summary), (401,))}
             for name, summary in LISTS.items()}
    return {
        "/v1/images/generations": {"post": _operation(
            OPENAI_TAG, "openaiImagesGenerate", "Images from a prompt (`client.images.generate`).", images,
            refused, ("application/json", GENERATION))},
        "/v1/images/edits": {"post": _operation(
            OPENAI_TAG, "openaiImagesEdit", "An image redrawn, or inpainted where a mask is transparent.",
            images, refused, ("multipart/form-data", EDIT))},
        "/sdapi/v1/txt2img": {"post": _operation(
            A1111_TAG, "a1111_txt2img", "Images from a prompt; `<lora:name:weight>` applies an adapter.",
            _json(GENERATED, "The images."), generated, ("application/json", TXT2IMG))},
        "/sdapi/v1/img2img": {"post": _operation(
            A1111_TAG, "a1111_img2img", "An image redrawn, or inpainted where `mask` is white.",
            _json(GENERATED, "The images."), generated, ("application/json", IMG2IMG))},
        "/sdapi/v1/options": {
            "get": _operation(A1111_TAG, "a1111_get_options", "The caller's options: `sd_model_checkpoint`.",
                              _json(_OBJECT, "The options."), (401,)),
            "post": _operation(A1111_TAG, "a1111_set_options", "Choose the caller's model (its tenant's "
                               "only; other keys are ignored).", _json({}, "Set."), (401, 422),
                               ("application/json", _OBJECT))},
        "/sdapi/v1/progress": {"get": _operation(
            A1111_TAG, "a1111_progress", "The caller's running job: progress, ETA and its latest preview.",
            _json(PROGRESS, "Progress."), (401,))},
        "/sdapi/v1/interrupt": {"post": _operation(
            A1111_TAG, "a1111_interrupt", "Cancel the caller's running job.", _json(_OBJECT, "Done."),
            (401,))},
        "/sdapi/v1/skip": {"post": _operation(
            A1111_TAG, "a1111_skip", "As `/interrupt`: slotq runs one job a call.", _json(_OBJECT, "Done."),
            (401,))},
        "/sdapi/v1/embeddings": {"get": _operation(A1111_TAG, "a1111_embeddings", "None.",
                                                   _json(_OBJECT, "No embeddings."), (401,))},
        "/sdapi/v1/scripts": {"get": _operation(
            A1111_TAG, "a1111_scripts", "`{txt2img, img2img}`: `controlnet` where the caller's model has "
            "ControlNets (its units are mapped), else none.", _json(_OBJECT, "The scripts."), (401,))},
        "/controlnet/version": {"get": _operation(
            A1111_TAG, "a1111_controlnet_version", "The ControlNet extension's API version whose units "
            "slotq reads.", _json(_OBJECT, "`{version}`."), (401,))},
        "/controlnet/model_list": {"get": _operation(
            A1111_TAG, "a1111_controlnet_model_list", "The ControlNets a unit on the caller's model may "
            "name.", _json(_OBJECT, "`{model_list}`."), (401,))},
        "/controlnet/module_list": {"get": _operation(
            A1111_TAG, "a1111_controlnet_module_list", "The preprocessors a unit may name: `none`, "
            "`canny`.", _json(_OBJECT, "`{module_list, module_detail}`."), (401,))},
        **a1111,
    }
