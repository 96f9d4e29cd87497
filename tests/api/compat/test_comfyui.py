"""The ComfyUI surface against real API processes and a real worker: graphs posted to ``/prompt``
run as slotq jobs, a websocket client (websocket-client, as ComfyUI's own API examples use) follows
them, ``/history`` and ``/view`` hand back their images, and tenants stay apart."""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import requests
import websocket
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from PIL import Image
from redis import Redis

from shared.contract.settings import Settings
from slotq.localredis import free_port
from tests.conftest import (
    Process,
    app_client,
    http_post_job,
    own_database,
    running_api,
    running_worker,
    start_image,
    wait_for,
)
from tests.test_metrics import scrape, value

# Shared with test_a1111.py: a module's processes stop before the next module of its pytest process starts.
DATABASE = 17  # apart from test_a1111's 13: the two may run side by side
KEY_A, KEY_B = "comfy-key-of-alpha", "comfy-key-of-beta"
SMALL = {"width": 64, "height": 64, "steps": 3}


# --- the module's worker and API processes ------------------------------------------------------------

@pytest.fixture(scope="module")
def comfy_settings(redis_url: str, model_cache: Path) -> Settings:
    from worker.tiny.loras import ensure_tiny_loras

    url = own_database(redis_url, DATABASE)
    return Settings(redis_url=url, queue_name="comfyui-tests", queue_capacity=50, cache_dir=model_cache,
                    lora_dir=ensure_tiny_loras(model_cache), preview_interval_ms=100, drain_s=0,
                    worker_metrics_port=free_port())


@pytest.fixture(scope="module")
def comfy_worker(comfy_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(comfy_settings, tmp_path_factory, "comfyui-worker")


@pytest.fixture(scope="module")
def api(comfy_worker: Process, comfy_settings: Settings,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """An open API process (no keys)."""
    yield from running_api(comfy_settings, tmp_path_factory, "comfyui-api")


@pytest.fixture(scope="module")
def keyed_api(comfy_worker: Process, comfy_settings: Settings,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """An API process with a key for each of two tenants."""
    keyed = comfy_settings.model_copy(update={"api_keys": {KEY_A: "alpha", KEY_B: "beta"}})
    yield from running_api(keyed, tmp_path_factory, "comfyui-keyed")


# --- graphs and calls -------------------------------------------------------------------------------------

def stock_graph(prompt: str = "a red fox", seed: int = 7, steps: int = 3, cfg: float = 7.0, width: int = 64,
                height: int = 64, sampler: str = "euler", scheduler: str = "normal", batch: int = 1,
                ckpt: str = "default.safetensors") -> dict[str, Any]:
    """ComfyUI's stock SD 1.5 text-to-image graph in API format (its script_examples' default)."""
    return {
        "3": {"class_type": "KSampler", "inputs": {
            "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": sampler, "scheduler": scheduler,
            "denoise": 1.0, "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0],
            "latent_image": ["5", 0]}},
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "5": {"class_type": "EmptyLatentImage",
              "inputs": {"width": width, "height": height, "batch_size": batch}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": prompt, "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "8": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["4", 2]}},
        "9": {"class_type": "SaveImage", "inputs": {"filename_prefix": "ComfyUI", "images": ["8", 0]}},
    }


def call(url: str, path: str, body: Any = None, key: str | None = None,
         method: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """One HTTP call to an API process: status, headers, body."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body).encode(), "application/json"
    request = urllib.request.Request(url + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def submit(url: str, graph: dict[str, Any], client_id: str = "", key: str | None = None) -> str:
    status, _, body = call(url, "/prompt", {"prompt": graph, "client_id": client_id}, key)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["node_errors"] == {} and isinstance(answer["number"], int)
    return str(answer["prompt_id"])


def connect(url: str, client_id: str, key: str | None = None) -> websocket.WebSocket:
    """A websocket as ComfyUI's clients open it, its first message (``status``) read."""
    ws = websocket.create_connection(url.replace("http://", "ws://") + f"/ws?clientId={client_id}",
                                     header=[f"Authorization: Bearer {key}"] if key else [], timeout=60)
    first = json.loads(ws.recv())
    assert first["type"] == "status" and first["data"]["sid"] == client_id
    return ws


def until_done(ws: websocket.WebSocket, prompt_id: str, frames: list[bytes] | None = None
               ) -> list[dict[str, Any]]:
    """The socket's messages up to ``executing`` with ``node: null`` for this prompt (its binary
    frames into ``frames``)."""
    messages = []
    while True:
        raw = ws.recv()
        if isinstance(raw, bytes):
            if frames is not None:
                frames.append(raw)
            continue
        message = json.loads(raw)
        messages.append(message)
        data = message["data"]
        if message["type"] == "executing" and data["node"] is None and data["prompt_id"] == prompt_id:
            return messages


def ended(url: str, prompt_id: str, key: str | None = None) -> dict[str, Any]:
    """The prompt's history entry, once its job has ended."""
    def entry() -> dict[str, Any] | None:
        status, _, body = call(url, f"/history/{prompt_id}", key=key)
        assert status == 200, body
        return json.loads(body).get(prompt_id)
    return wait_for(entry, what=f"prompt {prompt_id} in /history")  # type: ignore[no-any-return]


def pixels(data: bytes) -> np.ndarray:
    assert data.startswith(b"\x89PNG"), data[:16]
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def output_image(url: str, entry: dict[str, Any], node: str = "9", key: str | None = None) -> bytes:
    image = entry["outputs"][node]["images"][0]
    query = urllib.parse.urlencode(image)
    status, headers, body = call(url, f"/view?{query}", key=key)
    assert status == 200 and headers["Content-Type"] == "image/png", body[:200]
    return body


def native_image(url: str, job: dict[str, Any], key: str | None = None) -> bytes:
    """The image the native API makes for this job body."""
    status, view, _ = http_post_job(url, job, key, headers={"Prefer": "wait=60"})
    assert status == 200 and view["status"] == "succeeded", view
    status, _, body = call(url, view["images"][0].removeprefix(url), key=key)
    assert status == 200
    return body


# --- running graphs ---------------------------------------------------------------------------------------

def test_the_stock_graph_makes_the_native_jobs_image_and_the_socket_follows_it(api: Process) -> None:
    client_id = uuid.uuid4().hex
    ws = connect(api.url, client_id)
    try:
        prompt_id = submit(api.url, stock_graph(seed=11), client_id)
        messages = until_done(ws, prompt_id)
    finally:
        ws.close()
    kinds = [message["type"] for message in messages]
    assert kinds[:2] == ["execution_start", "execution_cached"] and "execution_success" in kinds
    progress = [message["data"] for message in messages if message["type"] == "progress"]
    assert [(each["value"], each["max"], each["node"]) for each in progress] == [(1, 3, "3"), (2, 3, "3"),
                                                                                  (3, 3, "3")]
    executing = [message["data"]["node"] for message in messages if message["type"] == "executing"]
    assert set(executing[:4]) == {"4", "5", "6", "7"} and executing[4:] == ["3", "8", "9", None]
    executed = next(message["data"] for message in messages if message["type"] == "executed")
    entry = ended(api.url, prompt_id)
    assert executed["node"] == "9" and executed["output"] == entry["outputs"]["9"]
    assert entry["status"]["status_str"] == "success" and entry["status"]["completed"] is True
    assert entry["prompt"][1] == prompt_id and entry["prompt"][2]["3"]["class_type"] == "KSampler"
    made = output_image(api.url, entry)
    native = native_image(api.url, {"prompt": "a red fox", "negative_prompt": "", "seed": 11,
                                    "guidance_scale": 7.0, "scheduler": "euler", **SMALL})
    assert np.array_equal(pixels(made), pixels(native))
    other = output_image(api.url, ended(api.url, submit(api.url, stock_graph(seed=12))))
    assert not np.array_equal(pixels(other), pixels(made))  # the seed is the graph's


def test_the_socket_sends_live_previews_as_comfyuis_binary_frames(api: Process) -> None:
    client_id, frames = uuid.uuid4().hex, list[bytes]()
    ws = connect(api.url, client_id)
    try:
        prompt_id = submit(api.url, stock_graph(steps=40, width=256, height=256), client_id)
        until_done(ws, prompt_id, frames)
    finally:
        ws.close()
    assert frames, "no preview"
    for frame in frames:
        assert frame[:8] == b"\x00\x00\x00\x01\x00\x00\x00\x01"  # event 1 (a preview), format 1 (JPEG)
        assert Image.open(io.BytesIO(frame[8:])).format == "JPEG"


def test_an_image_to_image_graph_and_a_lora_chain_map_and_run(api: Process) -> None:
    buffer = io.BytesIO()
    start_image(64, 64).save(buffer, "PNG")
    # As Open WebUI uploads an image to edit: multipart `image` and `type`.
    answer = requests.post(api.url + "/api/upload/image", data={"type": "input"}, timeout=30,
                           files={"image": ("fox.png", buffer.getvalue(), "image/png")})
    uploaded = answer.json()
    assert answer.status_code == 200 and uploaded == {"name": "fox.png", "subfolder": "", "type": "input"}

    edit = stock_graph(seed=5)
    edit["10"] = {"class_type": "LoadImage", "inputs": {"image": uploaded["name"]}}
    edit["11"] = {"class_type": "VAEEncode", "inputs": {"pixels": ["10", 0], "vae": ["4", 2]}}
    edit["3"]["inputs"].update(latent_image=["11", 0], denoise=0.6)
    del edit["5"]
    made = pixels(output_image(api.url, ended(api.url, submit(api.url, edit))))
    bare = pixels(output_image(api.url, ended(api.url, submit(api.url, stock_graph(seed=5)))))
    assert made.shape == bare.shape and not np.array_equal(made, bare)

    chained = stock_graph(seed=5)
    chained["10"] = {"class_type": "LoraLoader", "inputs": {"model": ["4", 0], "clip": ["4", 1],
                                                            "lora_name": "ink.safetensors",
                                                            "strength_model": 1.0, "strength_clip": 1.0}}
    chained["3"]["inputs"]["model"] = ["10", 0]
    for node in ("6", "7"):
        chained[node]["inputs"]["clip"] = ["10", 1]
    prompt_id = submit(api.url, chained)
    inked = pixels(output_image(api.url, ended(api.url, prompt_id)))
    status, _, job = call(api.url, f"/v1/jobs/{prompt_id}")
    assert status == 200 and json.loads(job)["request"]["loras"] == [{"name": "ink", "scale": 1.0}]
    assert not np.array_equal(inked, bare)


def test_a_mask_drawn_on_an_upload_inpaints_it(api: Process) -> None:
    """ComfyUI's mask editor: the image is uploaded, then ``/upload/mask`` keeps it with the mask's
    alpha under the mask's name; ``LoadImage``'s mask is where that is transparent."""
    photo = start_image(64, 64).convert("RGB")
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (16, 16, 48, 48))  # the centre erased: repainted
    def png_bytes(image: Image.Image) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, "PNG")
        return buffer.getvalue()
    first = requests.post(api.url + "/upload/image", data={"overwrite": "true"}, timeout=30,
                          files={"image": ("photo.png", png_bytes(photo), "image/png")}).json()
    answer = requests.post(api.url + "/upload/mask", timeout=30, data={
        "original_ref": json.dumps({"filename": first["name"], "subfolder": "", "type": "input"}),
        "type": "input", "overwrite": "true"},
        files={"image": ("clipspace-mask.png", png_bytes(mask), "image/png")})
    assert answer.status_code == 200 and answer.json()["name"] == "clipspace-mask.png", answer.text
    kept = Image.open(io.BytesIO(requests.get(api.url + "/view", timeout=30, params={
        "filename": "clipspace-mask.png", "type": "input"}).content))
    assert kept.mode == "RGBA" and kept.getpixel((32, 32))[3] == 0 and kept.getpixel((4, 4))[3] == 255
    assert np.array_equal(np.asarray(kept.convert("RGB")), np.asarray(photo))

    graph = stock_graph(seed=9)
    graph["10"] = {"class_type": "LoadImage", "inputs": {"image": "clipspace-mask.png [input]"}}
    graph["11"] = {"class_type": "VAEEncodeForInpaint", "inputs": {"pixels": ["10", 0], "vae": ["4", 2],
                                                                   "mask": ["10", 1], "grow_mask_by": 0}}
    graph["3"]["inputs"]["latent_image"] = ["11", 0]
    del graph["5"]
    prompt_id = submit(api.url, graph)
    made = pixels(output_image(api.url, ended(api.url, prompt_id))).astype(int)
    request = json.loads(call(api.url, f"/v1/jobs/{prompt_id}")[2])["request"]
    assert request["mask"] and request["image"]
    outside, inside = np.ones((64, 64), bool), np.zeros((64, 64), bool)
    outside[12:52, 12:52], inside[20:44, 20:44] = False, True
    source = np.asarray(photo).astype(int)
    assert np.abs(made - source)[outside].max() <= 2  # kept where the mask was opaque
    assert np.abs(made - source)[inside].mean() > 10  # repainted where it was erased
    refused = requests.post(api.url + "/upload/mask", timeout=30, data={"original_ref": json.dumps(
        {"filename": "never-uploaded.png"})}, files={"image": ("m.png", png_bytes(mask), "image/png")})
    assert refused.status_code == 404 and refused.json()["node_errors"] == {}


def test_a_graph_slotq_cannot_run_is_a_400_naming_the_node_and_admits_nothing(
        api: Process, comfy_settings: Settings) -> None:
    graph = stock_graph()
    graph["12"] = {"class_type": "UpscaleModelLoader", "inputs": {"model_name": "4x.pth"}}
    graph["13"] = {"class_type": "ImageUpscaleWithModel", "inputs": {"upscale_model": ["12", 0],
                                                                     "image": ["8", 0]}}
    graph["9"]["inputs"]["images"] = ["13", 0]
    with Redis.from_url(comfy_settings.redis_url) as redis:
        before = sorted(redis.scan_iter("slotq:comfyui:*"))
        status, _, body = call(api.url, "/prompt", {"prompt": graph, "client_id": "x"})
        after = sorted(redis.scan_iter("slotq:comfyui:*"))
    answer = json.loads(body)
    assert status == 400 and set(answer) == {"error", "node_errors"}, answer
    assert {"type", "message", "details"} <= set(answer["error"])
    assert answer["node_errors"]["13"]["class_type"] == "ImageUpscaleWithModel" or \
        answer["node_errors"]["12"]["class_type"] == "UpscaleModelLoader"
    assert before == after  # nothing of the prompt was kept
    for garbage in ([1, 2], {"prompt": "nodes"}, {"prompt": {"1": {"class_type": 3}}}):
        status, _, body = call(api.url, "/prompt", garbage)
        assert status == 400 and "error" in json.loads(body), body


@pytest.fixture
def full_line(settings: Settings) -> Iterator[FlaskClient]:
    """The API in-process on a line of one place with no worker."""
    yield from app_client(settings.model_copy(update={"queue_capacity": 1}))


def test_a_full_line_is_a_429_in_comfyuis_envelope_and_leaves_nothing(full_line: FlaskClient,
                                                                       redis: Redis) -> None:
    first = full_line.post("/prompt", json={"prompt": stock_graph(), "client_id": "c"})
    assert first.status_code == 200, first.get_json()
    kept = {key: redis.dump(key) for key in redis.scan_iter()}
    refused = full_line.post("/api/prompt", json={"prompt": stock_graph(seed=2), "client_id": "c"})
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    answer = refused.get_json()
    assert answer["error"]["type"] == "queue_full" and answer["node_errors"] == {}, answer
    assert {key: redis.dump(key) for key in redis.scan_iter()} == kept
    queue = full_line.get("/queue").get_json()
    assert [item[1] for item in queue["queue_pending"]] == [first.get_json()["prompt_id"]]
    assert queue["queue_running"] == []


def test_open_webuis_comfyui_engine_flow_makes_an_image(keyed_api: Process) -> None:
    """What Open WebUI 0.12.4 does (backend/open_webui/utils/images/comfyui.py), with aiohttp as it
    does: its default workflow with its node map applied (model, prompt, size, steps, a random seed
    up to 2**50), a websocket opened with the key before the prompt is queued, ``executing`` with
    ``node: null`` awaited, then ``/history/<id>`` and the SaveImage node's ``/view`` URL, which it
    fetches without the key."""
    workflow = json.loads((Path(__file__).parent / "comfyui" / "openwebui_default.json").read_text())
    workflow["4"]["inputs"]["ckpt_name"] = "default"
    workflow["6"]["inputs"]["text"] = "a lighthouse at dusk"
    workflow["5"]["inputs"].update(width=64, height=64, batch_size=1)
    workflow["3"]["inputs"].update(steps=3, seed=random.randint(2**32, 1125899906842624))
    headers = {"User-Agent": "Mozilla/5.0", "Authorization": f"Bearer {KEY_A}"}
    client_id = str(uuid.uuid4())

    async def create_image() -> tuple[str, dict[str, Any]]:
        async with aiohttp.ClientSession() as session:
            ws_url = keyed_api.url.replace("http://", "ws://")
            async with session.ws_connect(f"{ws_url}/ws?clientId={client_id}", headers=headers) as ws:
                async with session.post(f"{keyed_api.url}/prompt", headers=headers,
                                        json={"prompt": workflow, "client_id": client_id}) as posted:
                    posted.raise_for_status()
                    prompt_id = (await posted.json())["prompt_id"]
                async for message in ws:
                    if message.type == aiohttp.WSMsgType.TEXT:
                        data = json.loads(message.data)
                        if data["type"] == "executing" and data["data"]["node"] is None \
                                and data["data"]["prompt_id"] == prompt_id:
                            break
            async with session.get(f"{keyed_api.url}/history/{prompt_id}", headers=headers) as answer:
                answer.raise_for_status()
                return prompt_id, (await answer.json())[prompt_id]

    prompt_id, history = asyncio.run(asyncio.wait_for(create_image(), 120))
    urls = [f"/view?{urllib.parse.urlencode(image)}" for node_id, output in history["outputs"].items()
            if workflow[node_id]["class_type"] == "SaveImage" for image in output["images"]]
    assert len(urls) == 1
    status, seen, image = call(keyed_api.url, urls[0])
    assert status == 200 and seen["Content-Type"].startswith("image/")  # Open WebUI keeps image/* only
    assert pixels(image).shape == (64, 64, 3)
    view = json.loads(call(keyed_api.url, f"/v1/jobs/{prompt_id}", key=KEY_A)[2])
    assert view["request"]["seed"] == workflow["3"]["inputs"]["seed"] % 2**32  # the documented rule


def test_sillytaverns_comfyui_source_makes_an_image(api: Process) -> None:
    """What SillyTavern's server does (src/endpoints/stable-diffusion.js, comfy.post('/generate')): its
    default workflow with the placeholders filled in its text, posted as the whole body without a
    content type or key, then ``GET /history`` (all of it) every 100 ms until the prompt is there,
    its first output's ``/view`` without a key."""
    text = (Path(__file__).parent / "comfyui" / "sillytavern_default.json").read_text()
    for name, filled in {"scale": 7, "sampler": "euler", "scheduler": "normal", "seed": 42, "steps": 3,
                        "model": "default.safetensors", "width": 64, "height": 64,
                        "prompt": "a knight, (red cape:1.2)", "negative_prompt": "blurry"}.items():
        text = text.replace(f'"%{name}%"', json.dumps(filled))
    posted = requests.post(api.url + "/prompt", data=f'{{"prompt": {text}}}'.encode(), timeout=30)
    assert posted.status_code == 200, posted.text
    prompt_id = posted.json()["prompt_id"]

    def item() -> dict[str, Any] | None:
        answer = requests.get(api.url + "/history", timeout=30)
        assert answer.ok
        found: dict[str, Any] | None = answer.json().get(prompt_id)
        return found
    found = wait_for(item, what="the prompt in GET /history")
    assert found["status"]["status_str"] == "success"
    image = [each["images"] for each in found["outputs"].values()][0][0]
    view = requests.get(f"{api.url}/view?filename={image['filename']}&subfolder={image['subfolder']}"
                        f"&type={image['type']}", timeout=30)
    assert view.ok and pixels(view.content).shape == (64, 64, 3)
    assert image["filename"].startswith("Dechat_") and image["filename"].endswith(".png")
    job = json.loads(call(api.url, f"/v1/jobs/{prompt_id}")[2])["request"]
    assert job["prompt_syntax"] == "weighted" and job["negative_prompt"] == "blurry"  # ComfyUI's weights


def test_comfy_cli_runs_a_graph_file_against_slotq(api: Process, tmp_path: Path) -> None:
    """comfy-cli's ``comfy run --workflow`` (PyPI): its preflight check of the graph against
    ``/object_info``, the prompt, its websocket wait and the output URLs it prints."""
    graph = stock_graph(seed=21)
    (tmp_path / "graph.json").write_text(json.dumps(graph))
    port = api.url.rsplit(":", 1)[1]
    ran = subprocess.run([str(Path(sys.executable).parent / "comfy"), "--skip-prompt", "--json", "run",
                          "--workflow", str(tmp_path / "graph.json"), "--host", "127.0.0.1", "--port", port,
                          "--wait"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HOME": str(tmp_path)}, check=False)
    envelope = json.loads(ran.stdout.strip().splitlines()[-1])
    assert ran.returncode == 0 and envelope["ok"] and envelope["data"]["status"] == "completed", ran.stdout
    assert envelope["data"]["executed_node_ids"][-3:] == ["3", "8", "9"]
    [url] = envelope["data"]["outputs_by_node"]["9"]
    status, _, made = call(api.url, url.removeprefix(api.url))
    assert status == 200
    entry = ended(api.url, envelope["data"]["prompt_id"])
    assert made == output_image(api.url, entry)


# --- tenants ----------------------------------------------------------------------------------------------

def test_tenant_b_cannot_read_view_delete_or_interrupt_tenant_as_prompts(keyed_api: Process) -> None:
    url, client_id = keyed_api.url, "shared-client-id"
    status, _, _ = call(url, "/prompt", {"prompt": stock_graph()})
    assert status == 401  # with keys on, a prompt needs one
    for header in ("Basic %%%", "Basic 6Q==", "Bearer ", "Bearer nobodys-key"):
        answer = requests.get(url + "/queue", headers={"Authorization": header}, timeout=30)
        assert answer.status_code == 401 and answer.json()["error"]["type"] == "unauthorized", header
    done = submit(url, stock_graph(seed=3), client_id, KEY_A)
    entry = ended(url, done, KEY_A)
    query = "/view?" + urllib.parse.urlencode(entry["outputs"]["9"]["images"][0])
    assert call(url, query, key=KEY_B)[0] == 404
    assert call(url, query)[0] == 200  # no key: the name is the capability
    assert json.loads(call(url, f"/history/{done}", key=KEY_B)[2]) == {}
    assert done not in json.loads(call(url, "/history", key=KEY_B)[2])

    watching_b = connect(url, client_id, KEY_B)
    watching_a = connect(url, client_id, KEY_A)
    try:
        running = submit(url, stock_graph(steps=60, width=256, height=256), client_id, KEY_A)
        # Of another size: it neither batches with the first nor joins it at a step, so it waits.
        waiting = submit(url, stock_graph(steps=60, width=192, height=256), client_id, KEY_A)
        wait_for(lambda: json.loads(call(url, "/queue", key=KEY_A)[2])["queue_running"],
                 what="A's prompt running")
        queue_b = json.loads(call(url, "/queue", key=KEY_B)[2])
        assert queue_b == {"queue_running": [], "queue_pending": []}
        assert call(url, "/interrupt", {"prompt_id": running}, KEY_B)[0] == 200
        assert call(url, "/queue", {"delete": [waiting]}, KEY_B)[0] == 200
        assert call(url, "/history", {"delete": [done]}, KEY_B)[0] == 200
        queue_a = json.loads(call(url, "/queue", key=KEY_A)[2])
        assert [item[1] for item in queue_a["queue_running"]] == [running]
        assert [item[1] for item in queue_a["queue_pending"]] == [waiting]
        assert done in json.loads(call(url, "/history", key=KEY_A)[2])

        assert call(url, "/queue", {"delete": [waiting]}, KEY_A)[0] == 200
        assert call(url, "/interrupt", {}, KEY_A)[0] == 200
        kinds = [message["type"] for message in until_done(watching_a, running)]
        assert "execution_interrupted" in kinds and "execution_success" not in kinds
        assert ended(url, running, KEY_A)["status"]["status_str"] == "error"
        watching_b.settimeout(1)
        with pytest.raises(websocket.WebSocketTimeoutException):
            watching_b.recv()  # B's socket under A's client id was told nothing of A's prompts
    finally:
        watching_a.close()
        watching_b.close()


# --- what the service offers ------------------------------------------------------------------------------

def test_the_lists_clients_read_name_what_this_service_runs(api: Process) -> None:
    info = json.loads(call(api.url, "/object_info")[2])
    assert "default.safetensors" in info["CheckpointLoaderSimple"]["input"]["required"]["ckpt_name"][0]
    assert "euler" in info["KSampler"]["input"]["required"]["sampler_name"][0]
    assert "ink.safetensors" in info["LoraLoader"]["input"]["required"]["lora_name"][0]
    assert json.loads(call(api.url, "/api/object_info/KSampler")[2]) == {"KSampler": info["KSampler"]}
    assert json.loads(call(api.url, "/object_info/UpscaleModelLoader")[2]) == {}
    stats = json.loads(call(api.url, "/system_stats")[2])
    assert [device["type"] for device in stats["devices"]] == ["cpu"]
    assert json.loads(call(api.url, "/models/checkpoints")[2]) == ["default.safetensors"]
    assert json.loads(call(api.url, "/embeddings")[2]) == []
    assert call(api.url, "/models/nowhere")[0] == 404
    metrics = scrape(api.url + "/metrics")
    assert value(metrics, "slotq_admissions_total", surface="comfyui", outcome="admitted") >= 1


# --- any request ------------------------------------------------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
# Bodies near what clients send: a graph's keys with any values, ids and lists of ids.
bodies = json_values | st.fixed_dictionaries({}, optional={
    "prompt": json_values | st.just(stock_graph()), "client_id": json_values, "extra_data": json_values,
    "front": json_values, "delete": json_values, "clear": json_values, "prompt_id": json_values})
routes = st.sampled_from(["/prompt", "/api/prompt", "/queue", "/history", "/interrupt"])


@hsettings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(route=routes, body=bodies, raw=st.binary(max_size=64) | st.none())
def test_any_body_is_answered_in_comfyuis_envelope_and_a_refusal_leaves_nothing(
        full_line: FlaskClient, redis: Redis, route: str, body: Any, raw: bytes | None) -> None:
    kept = {key: redis.dump(key) for key in redis.scan_iter()}
    response = (full_line.post(route, data=raw, content_type="application/json") if raw is not None
                else full_line.post(route, json=body))
    assert response.status_code in (200, 400, 429), (response.status_code, response.get_data())
    if response.status_code != 200:
        answer = response.get_json()
        assert set(answer) == {"error", "node_errors"} and isinstance(answer["error"]["message"], str)
        assert {key: redis.dump(key) for key in redis.scan_iter()} == kept


@hsettings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/view", "/history/", "/object_info/", "/models/", "/ws", "/queue"]),
       value=st.text(max_size=40), query=st.dictionaries(st.sampled_from(["filename", "subfolder", "type",
                                                                          "max_items", "clientId"]),
                                                         st.text(max_size=40), max_size=4))
def test_any_read_is_an_answer_not_a_server_error(full_line: FlaskClient, path: str, value: str,
                                                  query: dict[str, str]) -> None:
    target = path + urllib.parse.quote(value, safe="") if path.endswith("/") else path
    response = full_line.get(target, query_string=query)
    assert response.status_code < 500, (target, query, response.get_data())
    assert response.is_json or response.mimetype.startswith("image/"), response.mimetype
