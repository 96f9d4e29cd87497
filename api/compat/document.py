"""The compatibility surfaces in the OpenAPI document, each under its own tag: what their clients
send and what they parse. The foreign APIs are lenient where their clients are (A1111 takes fields
it does not apply), so these schemas say what slotq reads, not every field a client may add."""

from __future__ import annotations

from typing import Any

from shared.contract.jobs import MAX_IMAGES

OPENAI_TAG, A1111_TAG, COMFYUI_TAG = "OpenAI Images", "AUTOMATIC1111", "ComfyUI"
VIDEOS_TAG = "OpenAI Videos"
TAGS = [{"name": OPENAI_TAG, "description": "OpenAI's Images API over slotq's queue (base URL `/v1`): "
         "each call admits a job and answers when it ends (SLOTQ_SYNC_WAIT_S)."},
        {"name": VIDEOS_TAG, "description": "OpenAI's Videos API over slotq's queue (base URL `/v1`): a "
         "create admits a video job and answers at once; a video's id is its job's."},
        {"name": A1111_TAG, "description": "AUTOMATIC1111's `/sdapi/v1` over slotq's queue: each call admits "
         "a job and answers when it ends; options are kept per tenant."},
        {"name": COMFYUI_TAG, "description": "ComfyUI's API over slotq's queue, each route also under "
         "`/api`: a graph posted to `/prompt` is admitted as one job at once; `/history`, `/view` and the "
         "websocket `/ws` follow it."}]

_STRING, _INTEGER, _NUMBER = {"type": "string"}, {"type": "integer"}, {"type": "number"}
_OBJECT = {"type": "object"}
_LIST = {"type": "array", "items": _OBJECT}
OPENAI_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": _STRING, "type": _STRING, "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}
COMFYUI_ERROR = {"type": "object", "required": ["error", "node_errors"], "properties": {
    "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": _STRING, "message": _STRING, "details": _STRING, "extra_info": _OBJECT}},
    "node_errors": {"type": "object", "description": "by node id: `{errors, dependent_outputs, class_type}`"},
}}
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
    envelope = {OPENAI_TAG: OPENAI_ERROR, VIDEOS_TAG: OPENAI_ERROR, A1111_TAG: A1111_ERROR,
                COMFYUI_TAG: COMFYUI_ERROR}[tag]
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
        **comfyui_paths(),
        **video_paths(),
    }


PROMPT = {"type": "object", "required": ["prompt"], "properties": {
    "prompt": {"type": "object", "description": "the graph in API format: node id -> `{class_type, inputs}`"},
    "client_id": {"type": "string", "maxLength": 128}, "extra_data": _OBJECT,
    "front": {"type": "boolean", "description": "the high class, where the caller's key may use it"}}}
QUEUED = {"type": "object", "required": ["prompt_id", "number", "node_errors"],
          "properties": {"prompt_id": _STRING, "number": _INTEGER, "node_errors": _OBJECT}}
CHANGES = {"type": "object", "properties": {"delete": {"type": "array", "items": _STRING},
                                            "clear": {"type": "boolean"}}}
_UPLOADED: dict[str, Any] = {"image": _BINARY, "type": {"enum": ["input", "temp", "output"]},
                             "subfolder": _STRING, "overwrite": _STRING}
UPLOAD = {"type": "object", "required": ["image"], "properties": _UPLOADED}
MASK = {"type": "object", "required": ["image", "original_ref"], "properties": {**_UPLOADED, "original_ref": {
    "type": "string", "description": "JSON `{filename, subfolder}` of the image uploaded before"}}}
_DONE = {"description": "Done.", "content": {}}
_NAMES = {"type": "array", "items": _STRING}


def comfyui_paths() -> dict[str, Any]:
    """ComfyUI's routes, each at ``/x`` and ``/api/x``; the websocket at ``/ws`` only."""
    tag, of_caller = COMFYUI_TAG, (400, 401, 429, 500, 503)
    def operation(operation_id: str, summary: str, answer: dict[str, Any], errors: tuple[int, ...] = (401,),
                  body: tuple[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        return _operation(tag, operation_id, summary, answer, errors, body)
    routes: dict[str, dict[str, Any]] = {
        "/prompt": {
            "post": operation("comfyui_prompt", "Admit a graph as one job (400 names the nodes slotq cannot "
                              "run; 429 when the line is full).", _json(QUEUED, "Admitted."),
                              (400, 401, 413, 429, 500, 503), ("application/json", PROMPT)),
            "get": operation("comfyui_prompt_status", "`{exec_info: {queue_remaining}}`: the caller's.",
                             _json(_OBJECT, "The caller's prompts that have not ended."))},
        "/queue": {
            "get": operation("comfyui_queue", "The caller's running and pending prompts, in ComfyUI's "
                             "tuples.", _json(_OBJECT, "`{queue_running, queue_pending}`.")),
            "post": operation("comfyui_queue_change", "Cancel the caller's pending prompts: `delete` those "
                              "named, or `clear`.", _DONE, of_caller, ("application/json", CHANGES))},
        "/interrupt": {"post": operation("comfyui_interrupt", "Cancel the caller's running prompt "
                                         "(`{prompt_id}`: that one).", _DONE, of_caller,
                                         ("application/json", _OBJECT))},
        "/history": {
            "get": operation("comfyui_history", "The caller's ended prompts (`max_items`: the newest so "
                             "many): outputs and status.", _json(_OBJECT, "By prompt id.")),
            "post": operation("comfyui_history_change", "Out of the caller's history: `delete` those "
                              "named, or `clear`.", _DONE, of_caller, ("application/json", CHANGES))},
        "/history/{id}": {"get": operation("comfyui_prompt_history", "One prompt's entry once it has ended; "
                                           "`{}` before, or for an id of no prompt of the caller's.",
                                           _json(_OBJECT, "`{<id>: entry}` or `{}`."))},
        "/view": {"get": operation("comfyui_view", "An output by its file name (without a key too: the "
                                   "name is the capability), or an upload (`type=input`).",
                                   {"description": "The image.", "content": {"image/*": {"schema": _BINARY}}},
                                   (401, 404))},
        "/upload/image": {"post": operation("comfyui_upload_image", "Keep an image for a graph's "
                                            "`LoadImage`: `{name, subfolder, type}`.",
                                            _json(_OBJECT, "Kept."), (400, 401, 413),
                                            ("multipart/form-data", UPLOAD))},
        "/upload/mask": {"post": operation("comfyui_upload_mask", "Keep an earlier upload (`original_ref`) "
                                           "with the alpha of the `image` sent, under its name (a mask "
                                           "`LoadImage` reads).", _json(_OBJECT, "Kept."),
                                           (400, 401, 404, 413), ("multipart/form-data", MASK))},
        "/object_info": {"get": operation("comfyui_object_info", "The node classes slotq runs, with their "
                                          "inputs and the models, LoRAs and samplers they may name.",
                                          _json(_OBJECT, "By class."))},
        "/object_info/{name}": {"get": operation("comfyui_object_info_class", "One node class; `{}` for "
                                                 "one slotq does not run.",
                                                 _json(_OBJECT, "`{<class>: entry}`."))},
        "/models": {"get": operation("comfyui_model_folders", "The model folders.", _json(_NAMES, "Names."))},
        "/models/{name}": {"get": operation("comfyui_models", "The files a graph may name from one folder.",
                                            _json(_NAMES, "File names."), (401, 404))},
        "/embeddings": {"get": operation("comfyui_embeddings", "None.", _json(_NAMES, "None."))},
        "/extensions": {"get": operation("comfyui_extensions", "None.", _json(_NAMES, "None."))},
        "/system_stats": {"get": operation("comfyui_system_stats", "The service and its live workers' "
                                           "devices.", _json(_OBJECT, "`{system, devices}`."))},
    }
    paths = {**routes, **{f"/api{path}": {method: {**item, "operationId": f"{item['operationId']}_api"}
                                          for method, item in methods.items()}
                          for path, methods in routes.items()}}
    paths["/ws"] = {"get": {"tags": [tag], "operationId": "comfyui_websocket", "summary": "A websocket "
                            "(`?clientId=`): the messages of the caller's prompts of this client id.",
                            "responses": {"101": {"description": "Switching to the websocket protocol."},
                                          "401": _json(COMFYUI_ERROR, "No key, or an unknown one."),
                                          "429": _json(COMFYUI_ERROR, "The caller holds its share of the "
                                                       "process's streams."),
                                          "503": _json(COMFYUI_ERROR, "The process holds all it may.")}}}
    return paths


VIDEO = {"type": "object", "required": ["id", "object", "model", "status", "progress", "created_at", "size",
                                         "seconds"], "properties": {
    "id": _STRING, "object": {"const": "video"}, "model": _STRING,
    "status": {"enum": ["queued", "in_progress", "completed", "failed"]},
    "progress": {"type": "integer", "minimum": 0, "maximum": 100},
    **{name: {"type": ["integer", "null"]} for name in ("completed_at", "expires_at")},
    "created_at": _INTEGER, "size": _STRING, "seconds": _STRING, "prompt": _STRING,
    "error": {"type": ["object", "null"], "properties": {"code": _STRING, "message": _STRING}},
    "remixed_from_video_id": {"type": "null"}}}
VIDEO_CREATE = {"type": "object", "required": ["prompt"], "properties": {
    "prompt": {"type": "string", "minLength": 1}, "model": _STRING,
    "seconds": {"type": "string", "description": "the clip's length: the most frames the model makes "
                "within `seconds * fps + 1`"},
    "size": {"type": "string", "description": "`WIDTHxHEIGHT`; absent: the model's default size"},
    "input_reference": {**_BINARY, "description": "the start image (a model with image-to-video)"},
    "fps": _INTEGER,
    **{name: schema for name, schema in EXTENSIONS.items() if name not in ("scheduler", "loras")}}}
VIDEOS = {"type": "object", "required": ["object", "data", "has_more"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": VIDEO},
    "first_id": {"type": ["string", "null"]}, "last_id": {"type": ["string", "null"]},
    "has_more": {"type": "boolean"}}}
DELETED = {"type": "object", "required": ["id", "object", "deleted"], "properties": {
    "id": _STRING, "object": {"const": "video.deleted"}, "deleted": {"type": "boolean"}}}


def video_paths() -> dict[str, Any]:
    """OpenAI's Videos routes."""
    tag, video = VIDEOS_TAG, _json(VIDEO, "The video.")
    content = {"description": "The MP4 (206 for a `Range`), or the poster PNG (`variant=thumbnail`).",
               "content": {"video/mp4": {"schema": _BINARY}, "image/png": {"schema": _BINARY}}}
    return {
        "/v1/videos": {
            "post": _operation(tag, "openaiVideosCreate", "Admit a clip (`client.videos.create`), answered "
                               "at once.", video, (400, 401, 404, 413, 429, 500, 503),
                               ("multipart/form-data", VIDEO_CREATE)),
            "get": _operation(tag, "openaiVideosList", "The caller's videos, newest first (`limit`, `after`, "
                              "`order`).", _json(VIDEOS, "A page."), (400, 401))},
        "/v1/videos/{id}": {
            "get": _operation(tag, "openaiVideosRetrieve", "A video (`client.videos.retrieve`).", video,
                              (401, 404)),
            "delete": _operation(tag, "openaiVideosDelete", "Cancel a video that has not ended; one that has "
                                 "is kept (`deleted: false`).", _json(DELETED, "Done."), (401, 404))},
        "/v1/videos/{id}/content": {"get": _operation(
            tag, "openaiVideosContent", "A completed video's MP4 or poster (404 before).", content,
            (400, 401, 404, 410, 416))},
    }
