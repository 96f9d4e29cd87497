"""A real Open WebUI (0.12.4, in .openwebui-venv: ``scripts/openwebui`` makes it) with its ComfyUI
image engine pointed at slotq's ComfyUI surface: it is set up through its own HTTP API as an admin
sets it up in Admin Panel → Settings → Images (its default workflow, the node map filled in), then
its image generation and image edit routes make images that are slotq's outputs, byte for byte.

Open WebUI starts offline: no model hub, no embedding model (docs/compatibility.md, "Clients"). Its
own dependencies conflict with slotq's, so it runs from a virtualenv of its own; without that the
test is skipped, unless SLOTQ_REQUIRE_OPENWEBUI=1 (then it fails)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from PIL import Image

from shared.contract.settings import Settings
from slotq.harness import Process
from slotq.localredis import free_port
from tests.conftest import data_url, own_database, running_api, running_worker, start_image

ROOT = Path(__file__).resolve().parents[3]
OPENWEBUI = ROOT / ".openwebui-venv" / "bin" / "open-webui"
DATABASE = 26  # apart from the other modules' (0 per test, 1 the session worker, 2-21)
KEY = "openwebui-comfy-key"
START_S = 180.0  # Open WebUI's start: about 15-25 s on a CPU machine
# Open WebUI offline: no model hub (its local embedding model is never loaded: the "openai" embedding
# engine, never called here), no Ollama or OpenAI connections to try, no version check.
OFFLINE = {
    "OFFLINE_MODE": "true", "HF_HUB_OFFLINE": "1", "RAG_EMBEDDING_ENGINE": "openai",
    "ENABLE_OLLAMA_API": "false", "ENABLE_OPENAI_API": "false", "ENABLE_VERSION_UPDATE_CHECK": "false",
    "ANONYMIZED_TELEMETRY": "false", "DO_NOT_TRACK": "true", "SCARF_NO_ANALYTICS": "true",
    "WEBUI_SECRET_KEY": "slotq-tests-openwebui-secret",
}
# The node map of Open WebUI's Images settings (its rows, keys as it fills them in) for its default
# workflow, the node ids as docs/compatibility.md gives them.
NODES = [{"type": "prompt", "key": "text", "node_ids": ["6"]},
         {"type": "model", "key": "ckpt_name", "node_ids": ["4"]},
         {"type": "width", "key": "width", "node_ids": ["5"]},
         {"type": "height", "key": "height", "node_ids": ["5"]},
         {"type": "steps", "key": "steps", "node_ids": ["3"]},
         {"type": "seed", "key": "seed", "node_ids": ["3"]}]
# Editing: ComfyUI's stock image-to-image graph, the uploaded image into its LoadImage.
EDIT_NODES = [{"type": "image", "key": "image", "node_ids": ["10"]},
              {"type": "prompt", "key": "text", "node_ids": ["6"]},
              {"type": "model", "key": "ckpt_name", "node_ids": ["14"]}]
FIXTURES = Path(__file__).parent / "comfyui"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def openwebui_started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """``open-webui serve`` on a free port with a data folder of its own, not yet answering: it starts
    while slotq's worker loads its model."""
    if not OPENWEBUI.exists():
        reason = f"Open WebUI is not installed: {OPENWEBUI} is absent (scripts/openwebui installs it)"
        if os.environ.get("SLOTQ_REQUIRE_OPENWEBUI") == "1":
            pytest.fail(reason + "; SLOTQ_REQUIRE_OPENWEBUI=1 requires it", pytrace=False)
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("openwebui")
    port = free_port()
    env = {name: value for name, value in os.environ.items()
           if name not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(OFFLINE, DATA_DIR=str(folder / "data"))
    log = folder / "openwebui.log"
    with log.open("wb") as handle:
        popen = subprocess.Popen([str(OPENWEBUI), "serve", "--host", "127.0.0.1", "--port", str(port)],
                                 cwd=folder, env=env, stdout=handle, stderr=subprocess.STDOUT)
    process = Process(popen, log, f"http://127.0.0.1:{port}")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def slotq_settings(redis_url: str, model_cache: Path) -> Settings:
    return Settings(redis_url=own_database(redis_url, DATABASE), queue_name="openwebui-tests",
                    queue_capacity=10, cache_dir=model_cache, drain_s=0, worker_metrics_port=free_port(),
                    api_keys={KEY: "webui"})


@pytest.fixture(scope="module")
def slotq_worker(openwebui_started: Process, slotq_settings: Settings,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """A worker with the tiny model, started once Open WebUI is starting."""
    yield from running_worker(slotq_settings, tmp_path_factory, "openwebui-worker")


@pytest.fixture(scope="module")
def slotq(slotq_worker: Process, slotq_settings: Settings,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """slotq's API, with one key (Open WebUI sends it everywhere: socket, prompt, history, view)."""
    yield from running_api(slotq_settings, tmp_path_factory, "openwebui-api")


@pytest.fixture(scope="module")
def openwebui(openwebui_started: Process, slotq: Process) -> str:
    """Open WebUI answering, its first user signed up (an admin), images on slotq's ComfyUI surface:
    the admin's token."""
    deadline = time.monotonic() + START_S
    while True:
        openwebui_started.check_running("Open WebUI")
        try:
            if requests.get(openwebui_started.url + "/health", timeout=5).ok:
                break
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, f"Open WebUI did not start:\n{openwebui_started.output()[-3000:]}"
        time.sleep(0.25)
    signed = requests.post(openwebui_started.url + "/api/v1/auths/signup", timeout=30, json={
        "name": "Admin", "email": "admin@example.com", "password": "a-long-Passw0rd!"})
    assert signed.ok and signed.json()["role"] == "admin", signed.text
    token: str = signed.json()["token"]
    config = webui(openwebui_started, "GET", "/api/v1/images/config", token)
    # Its default workflow is the one the replay test of test_comfyui.py imitates it with, but for the
    # checkpoint's name (the node map puts the model there).
    workflow, replayed = json.loads(config["COMFYUI_WORKFLOW"]), json.loads(
        (FIXTURES / "openwebui_default.json").read_text())
    for graph in (workflow, replayed):
        graph["4"]["inputs"]["ckpt_name"] = "default.safetensors"
    assert workflow == replayed
    assert webui(openwebui_started, "POST", "/api/v1/images/verify", token,
                 {"engine": "comfyui", "url": slotq.url, "key": KEY}) is True  # its "verify" button
    config.update(ENABLE_IMAGE_GENERATION=True, IMAGE_GENERATION_ENGINE="comfyui", COMFYUI_BASE_URL=slotq.url,
                  COMFYUI_API_KEY=KEY, COMFYUI_WORKFLOW_NODES=NODES, IMAGE_SIZE="64x64", IMAGE_STEPS=3,
                  ENABLE_IMAGE_EDIT=True, IMAGE_EDIT_ENGINE="comfyui", IMAGES_EDIT_COMFYUI_BASE_URL=slotq.url,
                  IMAGES_EDIT_COMFYUI_API_KEY=KEY, IMAGES_EDIT_COMFYUI_WORKFLOW_NODES=EDIT_NODES,
                  IMAGES_EDIT_COMFYUI_WORKFLOW=(FIXTURES / "img2img.json").read_text())
    webui(openwebui_started, "POST", "/api/v1/images/config/update", token, config)
    # Its model list (slotq's /object_info checkpoints), then the model chosen from it, as in the UI.
    models = [model["id"] for model in webui(openwebui_started, "GET", "/api/v1/images/models", token)]
    assert "default.safetensors" in models, models
    config.update(IMAGE_GENERATION_MODEL="default.safetensors", IMAGE_EDIT_MODEL="default.safetensors")
    webui(openwebui_started, "POST", "/api/v1/images/config/update", token, config)
    return token


def webui(process: Process, method: str, path: str, token: str, body: Any = None) -> Any:
    answer = requests.request(method, process.url + path, json=body, timeout=120,
                              headers={"Authorization": f"Bearer {token}"})
    assert answer.ok, f"{method} {path}: {answer.status_code} {answer.text}\n{process.output()[-3000:]}"
    return answer.json()


def slotq_get(slotq: Process, path: str) -> requests.Response:
    answer = requests.get(slotq.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert answer.ok, answer.text
    return answer


def made_by_slotq(slotq: Process, before: set[str]) -> tuple[dict[str, Any], bytes]:
    """The one prompt slotq ran since ``before`` (the history's ids then): its job's request and its
    SaveImage output's bytes."""
    history = slotq_get(slotq, "/history").json()
    [prompt_id] = set(history) - before
    assert history[prompt_id]["status"]["status_str"] == "success", history[prompt_id]
    [image] = history[prompt_id]["outputs"]["9"]["images"]
    job = slotq_get(slotq, f"/v1/jobs/{prompt_id}").json()
    return job["request"], slotq_get(slotq, "/view?" + urllib.parse.urlencode(image)).content


def stored(openwebui_started: Process, token: str, made: list[dict[str, Any]]) -> bytes:
    """The one image Open WebUI answered with, as it stored it (a PNG)."""
    [image] = made
    assert image["content_type"] == "image/png", image
    answer = requests.get(openwebui_started.url + image["url"], timeout=30,
                          headers={"Authorization": f"Bearer {token}"})
    assert answer.ok and answer.content.startswith(b"\x89PNG"), answer.content[:64]
    return answer.content


def test_open_webui_generates_an_image_through_slotqs_comfyui_surface(
        openwebui: str, openwebui_started: Process, slotq: Process) -> None:
    before = set(slotq_get(slotq, "/history").json())
    made = webui(openwebui_started, "POST", "/api/v1/images/generations", openwebui,
                 {"prompt": "a lighthouse at dusk", "size": "96x64"})
    image = stored(openwebui_started, openwebui, made)
    assert Image.open(io.BytesIO(image)).size == (96, 64)
    request, output = made_by_slotq(slotq, before)
    assert image == output
    assert (request["prompt"], request["width"], request["height"], request["steps"], request["model"]) == \
        ("a lighthouse at dusk", 96, 64, 3, "default")


def test_open_webui_edits_an_image_through_slotqs_comfyui_surface(
        openwebui: str, openwebui_started: Process, slotq: Process) -> None:
    """The image goes up by ``/api/upload/image``, into the workflow's LoadImage: image-to-image."""
    before = set(slotq_get(slotq, "/history").json())
    made = webui(openwebui_started, "POST", "/api/v1/images/edit", openwebui,
                 {"prompt": "the lighthouse in snow", "image": data_url(start_image(64, 96))})
    image = stored(openwebui_started, openwebui, made)
    assert Image.open(io.BytesIO(image)).size == (64, 96)  # the uploaded image's
    request, output = made_by_slotq(slotq, before)
    assert image == output
    assert request["prompt"] == "the lighthouse in snow" and request["image"] is not None
    # The graph's 20 steps at denoise 0.87: ComfyUI's 20 last steps of 22 (test_comfyui_graph.py).
    assert (request["steps"], request["strength"]) == (22, pytest.approx(20 / 22))
