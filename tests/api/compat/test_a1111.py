"""The AUTOMATIC1111 surface (``/sdapi/v1``): the real ``webuiapi`` package against real API
processes, on a worker of this module's own that has the tiny LoRA adapters and ControlNets; the
request bodies that Open WebUI, SillyTavern, LibreChat and webuiapi send, replayed; and its refusals in
A1111's envelope."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import webuiapi
from flask.testing import FlaskClient
from PIL import Image, ImageDraw
from redis import Redis

from shared.contract.settings import Settings
from slotq.localredis import free_port
from tests.conftest import (
    Process,
    app_client,
    box_mask,
    own_database,
    post_job,
    running_api,
    running_worker,
    start_image,
    wait_for,
)
from tests.test_metrics import scrape, value

DATABASE = 13  # apart from the others' (0 per test, 1 the worker, 2-3, 5-8 other modules)
REQUESTS = Path(__file__).parent / "requests"
KEY_A, KEY_B = "a1111-key-of-alpha", "a1111-key-of-beta"
SMALL = {"width": 64, "height": 64, "steps": 3}  # the tiny model's image in a blink
TINY = {"width": 64, "height": 64, "steps": 2}
LONG = {"width": 256, "height": 256, "steps": 60}  # runs for seconds, with previews on the way


# --- the module's worker and API processes -----------------------------------------------------------

@pytest.fixture(scope="module")
def lora_dir(model_cache: Path) -> Path:
    from worker.tiny.loras import ensure_tiny_loras

    return ensure_tiny_loras(model_cache)


@pytest.fixture(scope="module")
def controlnet_dir(model_cache: Path) -> Path:
    """The tiny SD's ControlNets (chalk, ember, chalk-file) at the top level: every model's."""
    from worker.tiny.controlnets import ensure_tiny_controlnets

    return ensure_tiny_controlnets(model_cache, "tiny") / "tiny"


@pytest.fixture(scope="module")
def a1111_settings(redis_url: str, model_cache: Path, lora_dir: Path, controlnet_dir: Path) -> Settings:
    """Two models offered (``second`` has no worker: a choice to switch to, never to run on)."""
    url = own_database(redis_url, DATABASE)
    return Settings(redis_url=url, queue_name="a1111-tests", queue_capacity=50, cache_dir=model_cache,
                    lora_dir=lora_dir, controlnet_dir=controlnet_dir, model_names=["default", "second"],
                    preview_interval_ms=100, drain_s=0, worker_metrics_port=free_port())


@pytest.fixture(scope="module")
def a1111_worker(a1111_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(a1111_settings, tmp_path_factory, "a1111-worker")


@pytest.fixture(scope="module")
def api(a1111_worker: Process, a1111_settings: Settings,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """An open API process (no keys)."""
    yield from running_api(a1111_settings, tmp_path_factory, "a1111-api")


@pytest.fixture(scope="module")
def keyed_api(a1111_worker: Process, a1111_settings: Settings,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """An API process with a key for each of two tenants."""
    keyed = a1111_settings.model_copy(update={"api_keys": {KEY_A: "alpha", KEY_B: "beta"}})
    yield from running_api(keyed, tmp_path_factory, "a1111-keyed")


def webui(api: Process, key: str | None = None) -> webuiapi.WebUIApi:
    """webuiapi pointed at an API process, as a user constructs it; with a key, as its Basic password."""
    port = int(api.url.rsplit(":", 1)[1])
    client = webuiapi.WebUIApi(host="127.0.0.1", port=port, sampler="Euler a", steps=3)
    if key:
        client.set_auth("anyone", key)
    return client


@pytest.fixture
def worker_app(a1111_worker: Process, a1111_settings: Settings) -> Iterator[FlaskClient]:
    """The API in-process on the module's worker, for replays."""
    yield from app_client(a1111_settings)


# --- helpers -----------------------------------------------------------------------------------------

def fetch(url: str, headers: dict[str, str] | None = None, body: Any = None,
          key: str | None = None) -> tuple[int, dict[str, str], Any]:
    """A request to an API process: status, headers and the JSON answer."""
    sent = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        sent["Content-Type"] = "application/json"
    request = urllib.request.Request(url, data=data, headers=sent, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def job(api: Process, job_id: str, key: str | None = None) -> dict[str, Any]:
    status, _, view = fetch(f"{api.url}/v1/jobs/{job_id}", key=key)
    assert status == 200, view
    return view


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"), dtype=np.int16)


def refusal(call: Callable[[], Any]) -> tuple[int, dict[str, Any]]:
    """The status and A1111 envelope of a call webuiapi raises on (it raises on any status but 200)."""
    with pytest.raises(RuntimeError) as raised:
        call()
    status, text = raised.value.args
    return status, json.loads(text)


def running(client: webuiapi.WebUIApi) -> dict[str, Any] | None:
    """/progress once it shows a running job with a preview."""
    shown = client.get_progress()
    return shown if shown["state"]["job_count"] and shown["current_image"] and shown["progress"] > 0 else None


def fixture(name: str) -> dict[str, Any]:
    return json.loads((REQUESTS / name).read_text())


def replay(client: FlaskClient, sent: dict[str, Any], **changes: Any) -> Any:
    """Send a recorded request as the client sends it (its headers included), with ``changes`` to
    its JSON body."""
    body = {**sent["json"], **changes} if "json" in sent else None
    return client.open(sent["path"], method=sent["method"], headers=sent["headers"],
                       data=None if body is None else json.dumps(body))


# --- txt2img -----------------------------------------------------------------------------------------

def test_txt2img_runs_the_sampler_and_seed_that_info_reports(api: Process) -> None:
    client, before = webui(api), scrape(api.url + "/metrics")
    result = client.txt2img(prompt="a lighthouse", seed=1234, sampler_name="DPM++ 2M", scheduler="Karras",
                            **SMALL)
    [image], info = result.images, result.info
    assert image.size == (64, 64) and image.format == "PNG"
    assert (info["seed"], info["all_seeds"], info["sampler_name"]) == (1234, [1234], "DPM++ 2M")
    assert info["extra_generation_params"] == {"Schedule type": "Karras"} and info["not_applied"] == []
    assert (info["width"], info["height"], info["steps"], info["sd_model_name"]) == (64, 64, 3, "default")
    assert "Seed: 1234" in info["infotexts"][0] and result.parameters["sampler_name"] == "DPM++ 2M"
    ran = job(api, info["job_id"])  # an ordinary slotq job, as translated
    assert ran["status"] == "succeeded" and ran["request"]["previews"] is True
    assert (ran["request"]["scheduler"], ran["request"]["seed"]) == ("dpmpp_2m_karras", 1234)
    name, labels = "slotq_admissions_total", {"outcome": "admitted", "surface": "a1111"}
    assert value(scrape(api.url + "/metrics"), name, **labels) - value(before, name, **labels) == 1
    # The name A1111 listed before 1.9 splits into the same sampler and schedule: the same image.
    again = client.txt2img(prompt="a lighthouse", seed=1234, sampler_name="DPM++ 2M Karras", **SMALL)
    assert again.info["sampler_name"] == "DPM++ 2M" and np.array_equal(pixels(again.images[0]), pixels(image))


def test_txt2img_with_seed_minus_1_reports_the_seed_it_drew(api: Process) -> None:
    result = webui(api).txt2img(prompt="a lighthouse", seed=-1, **SMALL)
    seed = result.info["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**32 and result.info["all_seeds"] == [seed]
    ran = job(api, result.info["job_id"])["request"]
    assert ran["seed"] == seed and ran["scheduler"] == "euler_a"  # webuiapi's default sampler, "Euler a"


def test_batch_size_times_n_iter_images_in_one_job(api: Process) -> None:
    client = webui(api)
    result = client.txt2img(prompt="two foxes", seed=7, batch_size=2, **SMALL)
    assert len(result.images) == 2 and result.info["all_seeds"] == [7, 8]
    assert result.info["batch_size"] == 2 and job(api, result.info["job_id"])["request"]["num_images"] == 2
    four = client.txt2img(prompt="four foxes", seed=7, batch_size=2, n_iter=2, width=64, height=64, steps=1)
    assert len(four.images) == 4 and four.info["all_seeds"] == [7, 8, 9, 10]
    status, body = refusal(lambda: client.txt2img(prompt="five foxes", batch_size=5, **SMALL))
    assert status == 422 and body["error"] == "InvalidRequestError" and body["code"] == "invalid_request"
    assert body["errors"][0]["loc"] == ["batch_size"] and "at most 4" in body["errors"][0]["msg"]


def test_fields_slotq_does_not_apply_are_accepted_and_listed(api: Process) -> None:
    result = webui(api).txt2img(prompt="a lighthouse", restore_faces=True, tiling=True, styles=["noir"],
                                sampler_name="LMS", alwayson_scripts={"ADetailer": {"args": [True]}}, **SMALL)
    assert len(result.images) == 1
    assert result.info["not_applied"] == ["restore_faces", "tiling", "styles", "sampler_name",
                                          "alwayson_scripts.ADetailer"]
    assert result.info["sampler_name"] == "DPM++ 2M"  # A1111's fallback for a sampler it lacks: its first


def test_enable_hr_makes_the_larger_image_in_one_job(api: Process) -> None:
    client = webui(api)
    result = client.txt2img(prompt="a castle", seed=31, enable_hr=True, hr_scale=2, **TINY)
    [image], info = result.images, result.info
    assert image.size == (128, 128) and info["not_applied"] == []
    assert (info["width"], info["height"], info["denoising_strength"]) == (64, 64, 0.7)  # webuiapi's
    assert info["extra_generation_params"] == {"Schedule type": "Normal", "Hires upscale": 2.0,
                                               "Hires upscaler": "Latent"}
    assert "Size: 64x64, " in info["infotexts"][0]
    assert "Denoising strength: 0.7, Hires upscale: 2.0, Hires upscaler: Latent" in info["infotexts"][0]
    ran = job(api, info["job_id"])
    assert ran["request"]["hires"] == {"scale": 2.0, "steps": None, "denoise": 0.7, "upscaler": "latent"}
    assert ran["progress"] == {"step": 3, "total": 3}  # 2 steps, then int(2 x 0.7) at 128x128
    # An upscaling model slotq has not runs as Lanczos, and says so; hr_resize_x sets the size.
    other = client.txt2img(prompt="a castle", seed=31, enable_hr=True, hr_resize_x=128,
                           hr_second_pass_steps=3, hr_upscaler=webuiapi.HiResUpscaler.ESRGAN_4x, **TINY)
    assert other.images[0].size == (128, 128) and other.info["not_applied"] == ["hr_upscaler"]
    assert job(api, other.info["job_id"])["request"]["hires"] == {"scale": 2.0, "steps": 3, "denoise": 0.7,
                                                                  "upscaler": "lanczos"}
    assert "Hires resize: 128x0, Hires steps: 3, Hires upscaler: R-ESRGAN 4x+" in other.info["infotexts"][0]


def control_picture() -> Image.Image:
    """A picture whose edges (a square's) are a canny ControlNet's control image."""
    picture = Image.new("RGB", (64, 64), "black")
    ImageDraw.Draw(picture).rectangle((16, 16, 47, 47), fill="white")
    return picture


def test_a_controlnet_unit_steers_the_image_and_at_weight_0_is_the_bare_model(api: Process) -> None:
    client = webui(api)

    def made(*units: webuiapi.ControlNetUnit) -> webuiapi.WebUIApiResult:
        return client.txt2img(prompt="a red fox", seed=13, controlnet_units=list(units), **TINY)

    bare = made()
    chalk = made(webuiapi.ControlNetUnit(image=control_picture(), module="canny", model="chalk", weight=1.0,
                                         threshold_a=100, threshold_b=200))
    zero = made(webuiapi.ControlNetUnit(image=control_picture(), module="canny", model="chalk [0123abcd]",
                                        weight=0.0))
    assert np.abs(pixels(chalk.images[0]) - pixels(bare.images[0])).mean() > 5  # another image
    assert np.array_equal(pixels(zero.images[0]), pixels(bare.images[0]))
    [control] = job(api, chalk.info["job_id"])["request"]["controlnets"]
    assert {key: control[key] for key in ("name", "scale", "start", "end", "preprocess", "low", "high")} == {
        "name": "chalk", "scale": 1.0, "start": 0.0, "end": 1.0, "preprocess": "canny", "low": 100,
        "high": 200}
    assert (control["image"]["width"], control["image"]["height"]) == (64, 64)
    unit = "Module: canny, Model: chalk, Weight: 1.0, Guidance Start: 0.0, Guidance End: 1.0"
    assert chalk.info["extra_generation_params"]["ControlNet 0"] == unit and chalk.info["not_applied"] == []
    assert f'ControlNet 0: "{unit}"' in chalk.info["infotexts"][0]
    # webuiapi's default thresholds (64, 64) are applied: the extension's canny with them.
    assert zero.info["not_applied"] == []
    [control] = job(api, zero.info["job_id"])["request"]["controlnets"]
    assert (control["low"], control["high"]) == (64, 64)


def test_the_extensions_routes_list_the_controlnets_and_preprocessors(api: Process) -> None:
    client = webui(api)  # webuiapi's own calls of the extension's routes
    assert client.controlnet_model_list() == ["chalk", "chalk-file", "ember"]
    assert client.controlnet_module_list() == ["none", "canny"]
    assert client.controlnet_version() == 2
    assert client.get_scripts() == {"txt2img": ["controlnet"], "img2img": ["controlnet"]}


def test_a_lora_in_the_prompt_changes_the_image_and_at_weight_0_is_the_bare_model(api: Process) -> None:
    client = webui(api)

    def made(prompt: str) -> webuiapi.WebUIApiResult:
        return client.txt2img(prompt=prompt, seed=11, **SMALL)

    bare, ink, zero = made("a red fox"), made("a red fox <lora:ink:1>"), made("a red fox <lora:ink:0>")
    assert np.abs(pixels(ink.images[0]) - pixels(bare.images[0])).mean() > 5  # visibly another image
    assert np.array_equal(pixels(zero.images[0]), pixels(bare.images[0]))
    ran = job(api, ink.info["job_id"])["request"]
    assert ran["prompt"] == "a red fox" and ran["loras"] == [{"name": "ink", "scale": 1.0}]
    assert ink.info["prompt"] == "a red fox <lora:ink:1>"  # as sent: it makes this image again
    listed = client.get_loras()
    assert [lora["name"] for lora in listed] == ["ink", "moss", "neon"]
    # Each file named within the folder, no server path: ["ink.safetensors", ...].
    assert [lora["path"] for lora in listed] == [f"{lora['name']}.safetensors" for lora in listed]
    status, body = refusal(lambda: made("a red fox <lora:ghost:0.5>"))
    assert status == 422 and body["code"] == "unknown_lora" and "ghost" in body["detail"]


def test_the_prompt_weighs_its_words_as_a1111s_does(api: Process) -> None:
    client = webui(api)

    def made(prompt: str) -> np.ndarray:
        return pixels(client.txt2img(prompt=prompt, seed=12, **SMALL).images[0])

    plain = made("a red fox")
    assert np.array_equal(made("(a red fox:1.0)"), plain)  # brackets at weight 1: the same words
    assert not np.array_equal(made("a (red:1.8) fox"), plain)
    weighed = client.txt2img(prompt="a [red] fox", seed=12, **SMALL)
    assert job(api, weighed.info["job_id"])["request"]["prompt_syntax"] == "weighted"


# --- img2img -----------------------------------------------------------------------------------------

def test_img2img_repaints_the_mask_and_keeps_the_pixels_outside_it(api: Process) -> None:
    client, source = webui(api), start_image(128, 128)
    mask = box_mask(128, 128)  # white (repaint) from 32 to 95, each way
    # webuiapi's own mask_blur (4) and denoising_strength (0.75)
    result = client.img2img(images=[source], mask_image=mask, prompt="a red fox", seed=3, width=128,
                            height=128, steps=4)
    out, kept = pixels(result.images[0]), pixels(source)
    # 16 px from its edge, the blurred mask (a Gaussian of radius 4) is pure black or white.
    far, inside = np.ones((128, 128), bool), np.zeros((128, 128), bool)
    far[16:112, 16:112], inside[48:80, 48:80] = False, True
    assert out.shape == (128, 128, 3) and np.array_equal(out[far], kept[far])
    assert np.abs(out[inside] - kept[inside]).mean() > 5  # repainted
    assert result.info["denoising_strength"] == 0.75
    ran = job(api, result.info["job_id"])["request"]
    assert ran["strength"] == 0.75 and ran["mask"]["width"] == 128
    inverted = client.img2img(images=[source], mask_image=mask, inpainting_mask_invert=1, prompt="a red fox",
                              seed=3, width=128, height=128, steps=4)
    out = pixels(inverted.images[0])
    assert np.array_equal(out[inside], kept[inside])
    assert np.abs(out[far] - kept[far]).mean() > 5


def test_img2img_resizes_the_start_image_to_width_and_height(api: Process) -> None:
    result = webui(api).img2img(images=[start_image(96, 64)], prompt="a red fox", denoising_strength=1.0,
                                **SMALL)
    assert result.images[0].size == (64, 64)
    ran = job(api, result.info["job_id"])["request"]
    assert (ran["image"]["width"], ran["image"]["height"], ran["strength"]) == (64, 64, 1.0)


# --- models, options, progress, interrupt ------------------------------------------------------------

def test_set_options_chooses_the_callers_model_among_sd_models(api: Process) -> None:
    client = webui(api)
    models = client.get_sd_models()
    assert [model["model_name"] for model in models] == ["default", "second"]
    assert all(model["title"] == f"{model['model_name']} [{model['hash']}]" == f"{model['model_name']} "
               f"[{model['sha256'][:10]}]" for model in models)
    default, second = (model["title"] for model in models)
    assert client.get_options()["sd_model_checkpoint"] == default
    try:
        assert client.set_options({**client.get_options(), "sd_model_checkpoint": second}) is None
        assert client.get_options()["sd_model_checkpoint"] == second == client.util_get_current_model()
        for wrong in ("sdxl-turbo.safetensors [abc1234567]", ""):
            status, _, body = fetch(api.url + "/sdapi/v1/options", body={"sd_model_checkpoint": wrong})
            assert status == 422 and body["code"] == "unknown_model", body
        assert client.get_options()["sd_model_checkpoint"] == second  # unchanged by the refusals
    finally:
        client.util_set_model("default")  # webuiapi's fuzzy match, then a POST of the title
    assert client.get_options()["sd_model_checkpoint"] == default


def test_progress_shows_the_running_job_and_interrupt_ends_its_call(api: Process) -> None:
    client = webui(api)
    idle = client.get_progress()
    assert (idle["progress"], idle["state"]["job_count"], idle["current_image"]) == (0, 0, None)
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(client.txt2img, prompt="a long walk", seed=5, **LONG)
        busy = wait_for(lambda: running(client), what="/progress to show a preview")
        assert 0 < busy["progress"] < 1 and busy["state"]["sampling_steps"] == 60 and busy["eta_relative"] > 0
        preview = Image.open(io.BytesIO(base64.b64decode(busy["current_image"], validate=True)))
        assert preview.format == "JPEG" and preview.size == (256, 256)
        job_id = busy["state"]["job"]
        assert job(api, job_id)["status"] == "running"
        asked = time.monotonic()
        assert client.interrupt() == {}
        result = call.result(timeout=30)
    assert time.monotonic() - asked < 10, "the call waited on after its job was interrupted"
    assert result.images == [] and result.info["interrupted"] is True
    assert (result.info["seed"], result.info["job_id"]) == (5, job_id)
    assert job(api, job_id)["status"] == "canceled"
    assert client.get_progress()["state"]["job_count"] == 0


# --- API keys ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [{}, {"Authorization": "Basic "}, basic("anyone", "not-a-key"),
                                     {"Authorization": "Bearer not-a-key"}])
def test_with_keys_a_call_without_a_valid_key_is_401_basic(keyed_api: Process,
                                                           headers: dict[str, str]) -> None:
    status, sent, body = fetch(keyed_api.url + "/sdapi/v1/options", headers)
    assert status == 401 and sent["WWW-Authenticate"].startswith("Basic"), (status, sent)
    assert body["error"] == "UnauthorizedError" and "HTTP Basic" in body["detail"]
    status, _, body = fetch(keyed_api.url + "/sdapi/v1/txt2img", headers, body={"prompt": "a fox", **SMALL})
    assert status == 401 and body["code"] == "unauthorized"
    assert fetch(keyed_api.url + "/sdapi/v1/options", basic("", KEY_A))[0] == 200  # any user name


def test_with_keys_a_tenant_sees_none_of_anothers_model_jobs_or_progress(keyed_api: Process) -> None:
    alpha, beta = webui(keyed_api, KEY_A), webui(keyed_api, KEY_B)
    default, second = (model["title"] for model in alpha.get_sd_models())
    try:
        alpha.set_options({"sd_model_checkpoint": second})
        assert alpha.get_options()["sd_model_checkpoint"] == second
        assert beta.get_options()["sd_model_checkpoint"] == default
    finally:
        alpha.set_options({"sd_model_checkpoint": default})
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(alpha.txt2img, prompt="alpha's long walk", **LONG)
        job_id = wait_for(lambda: running(alpha), what="alpha's job to run")["state"]["job"]
        seen = beta.get_progress()
        assert (seen["progress"], seen["state"]["job_count"], seen["current_image"]) == (0, 0, None)
        assert job_id in [view["id"] for view in listed(keyed_api, KEY_A)]
        assert job_id not in [view["id"] for view in listed(keyed_api, KEY_B)]
        assert fetch(f"{keyed_api.url}/v1/jobs/{job_id}", key=KEY_B)[0] == 404
        assert beta.interrupt() == {}
        step = step_of(keyed_api, job_id, KEY_A)
        # A canceled job stops at its next step: alpha's goes on past several.
        wait_for(lambda: step_of(keyed_api, job_id, KEY_A) >= step + 3, what="alpha's job to go on")
        assert job(keyed_api, job_id, KEY_A)["status"] == "running"
        assert alpha.interrupt() == {}
        assert call.result(timeout=30).info["interrupted"] is True
    assert job(keyed_api, job_id, KEY_A)["status"] == "canceled"


def step_of(api: Process, job_id: str, key: str) -> int:
    return (job(api, job_id, key)["progress"] or {"step": 0})["step"]


def listed(api: Process, key: str) -> list[dict[str, Any]]:
    status, _, body = fetch(api.url + "/v1/jobs?limit=100", key=key)
    assert status == 200, body
    return body["jobs"]


# --- replays of what clients send --------------------------------------------------------------------

def reads(path: str, answer: Any, titles: list[str]) -> None:
    """Check an answer has what the clients read of it (see each fixture's note)."""
    checks: dict[str, Callable[[], bool]] = {
        "/sdapi/v1/options": lambda: answer["sd_model_checkpoint"] in titles,
        "/sdapi/v1/sd-models": lambda: all(model["title"] and model["model_name"] for model in answer),
        "/sdapi/v1/samplers": lambda: {"Euler a", "Euler", "DDIM", "DPM++ 2M", "UniPC"}
        == {sampler["name"] for sampler in answer},
        "/sdapi/v1/schedulers": lambda: {"automatic", "karras"} <= {item["name"] for item in answer},
        "/sdapi/v1/progress": lambda: answer["progress"] == 0 and answer["state"]["job_count"] == 0,
        # The module's service has ControlNets: the extension's script is listed.
        "/sdapi/v1/scripts": lambda: answer == {"txt2img": ["controlnet"], "img2img": ["controlnet"]},
        "/sdapi/v1/loras": lambda: [lora["name"] for lora in answer] == ["ink", "moss", "neon"],
        "/sdapi/v1/interrupt": lambda: answer == {},
    }
    assert checks.get(path, lambda: isinstance(answer, list))(), (path, answer)


CLIENTS = ("openwebui_a1111", "sillytavern_a1111", "webuiapi", "librechat_a1111")
RECORDED = sorted(path.name for path in REQUESTS.glob("*.json") if path.name.startswith(CLIENTS))
GENERATES = [name for name in RECORDED if fixture(name)["path"].endswith(("/txt2img", "/img2img"))]
READS = [name for name in RECORDED if name not in GENERATES]
# The slotq sampler each recorded generation runs with (webuiapi's: its default, "Euler a").
SAMPLERS_RUN = {"openwebui_a1111_txt2img.json": "euler",  # none named: A1111's default, "Euler"
                "openwebui_a1111_txt2img_v05.json": "euler_a",  # "Euler a" + "Karras": not applied
                "sillytavern_a1111_txt2img.json": "ddim", "librechat_a1111_txt2img.json": "dpmpp_2m_karras"}


@pytest.mark.parametrize("name", READS)
def test_a_clients_recorded_request_answers_what_it_reads(worker_app: FlaskClient, name: str) -> None:
    sent = fixture(name)
    titles = [model["title"] for model in worker_app.get("/sdapi/v1/sd-models").get_json()]
    if sent["method"] == "POST" and sent["path"].endswith("/options"):
        # The fixture names A1111's checkpoint: refused, changing nothing; the client would have
        # picked one of this service's titles from /sd-models, which is taken.
        refused = replay(worker_app, sent)
        assert refused.status_code == 422 and refused.get_json()["code"] == "unknown_model"
        taken = replay(worker_app, sent, sd_model_checkpoint=titles[0])
        assert taken.status_code == 200 and taken.get_json() is None
        return
    response = replay(worker_app, sent)
    assert response.status_code == 200 and response.is_json, response.get_data()
    reads(sent["path"], response.get_json(), titles)


@pytest.mark.parametrize("name", GENERATES)
def test_a_clients_recorded_generation_answers_what_it_parses(worker_app: FlaskClient, name: str) -> None:
    sent = fixture(name)
    # The tiny model at the clients' 512-1024 px would take most of a minute: the size and steps are
    # made small, every other field is replayed as sent (the full body is checked below, unrun).
    response = replay(worker_app, sent, **SMALL)
    assert response.status_code == 200, response.get_json()
    answer = response.get_json()
    [image] = answer["images"]
    assert Image.open(io.BytesIO(base64.b64decode(image, validate=True))).size == (64, 64)  # no data: prefix
    info = json.loads(answer["info"])  # LibreChat reads these four
    assert (info["width"], info["height"]) == (64, 64) and isinstance(info["seed"], int)
    assert info["infotexts"][0].startswith(sent["json"]["prompt"])
    assert "auth" not in answer["parameters"] and answer["parameters"]["prompt"] == sent["json"]["prompt"]
    if name.startswith("sillytavern"):
        assert info["not_applied"] == ["save_images"] and info["sampler_name"] == "DDIM"
    if name.startswith("librechat"):  # only the deprecated sampler_index, with its schedule in the name
        schedule = info["extra_generation_params"]["Schedule type"]
        assert (info["sampler_name"], schedule) == ("DPM++ 2M", "Karras")


@pytest.mark.parametrize("name", GENERATES)
def test_a_clients_whole_recorded_body_becomes_the_job_it_asks_for(settings: Settings, lora_dir: Path,
                                                                   name: str) -> None:
    sent = fixture(name)
    body = sent["json"]
    # No worker, and a wait that ends at once: the call answers 504 naming its job, which waits on.
    for client in app_client(settings.model_copy(update={"sync_wait_s": 0.05, "queue_capacity": 50})):
        response = replay(client, sent)
        answer = response.get_json()
        assert response.status_code == 504 and answer["code"] == "sync_wait_exceeded", answer
        job_id = answer["detail"].split()[1]
        ran = client.get(f"/v1/jobs/{job_id}").get_json()
        assert ran["status"] == "queued" and ran["request"]["previews"] is True
        request = ran["request"]
        size = (request["image"]["width"], request["image"]["height"]) if "init_images" in body else (
            request["width"], request["height"])
        assert size == (body["width"], body["height"]) and request["steps"] == body["steps"]
        assert request["prompt"] == body["prompt"] and request["prompt_syntax"] == "weighted"
        assert request["negative_prompt"] == (body.get("negative_prompt") or None)
        assert request["guidance_scale"] == body.get("cfg_scale", 7.5)  # absent: the model's own
        assert request["scheduler"] == SAMPLERS_RUN.get(name, "euler_a")


# --- refusals ----------------------------------------------------------------------------------------

def test_a_full_line_answers_429_with_retry_after_in_a1111s_envelope(client: FlaskClient) -> None:
    for index in range(5):  # the test queue's capacity, and no worker
        assert post_job(client, width=64, height=64, prompt=f"job {index}").status_code == 202
    response = client.post("/sdapi/v1/txt2img", json={"prompt": "one too many", **SMALL})
    body = response.get_json()
    assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1
    assert body["error"] == "QueueFullError" and body["code"] == "queue_full" and body["detail"]
    assert set(body) == {"error", "detail", "body", "errors", "code"}


@pytest.mark.parametrize(("changes", "loc"), [
    ({"cfg_scale": "seven"}, ["cfg_scale"]),
    ({"width": 100}, ["width"]),
    ({"override_settings": {"sd_model_checkpoint": "nope.safetensors"}}, None),
    ({"prompt": "<lora:ink:heavy>"}, ["prompt"]),
    ({"enable_hr": True, "hr_scale": 1}, ["hr_scale"]),
    ({"enable_hr": True, "hr_resize_x": 128, "hr_resize_y": 96}, ["hr_resize_x"]),
])
def test_an_invalid_call_is_422_naming_the_field_as_sent(client: FlaskClient, redis: Redis,
                                                         changes: dict[str, Any], loc: Any) -> None:
    response = client.post("/sdapi/v1/txt2img", json={"prompt": "a fox", **SMALL, **changes})
    body = response.get_json()
    assert response.status_code == 422 and body["error"] in ("InvalidRequestError", "UnknownModelError"), body
    if loc is not None:
        assert body["errors"][0]["loc"] == loc, body
    assert redis.keys("*") == []  # nothing admitted


def unit(**fields: Any) -> dict[str, Any]:
    """A ControlNet unit as webuiapi sends it."""
    return {**webuiapi.ControlNetUnit(image=control_picture(), model="chalk").to_dict(), **fields}


def with_controlnets(settings: Settings, controlnet_dir: Path) -> Settings:
    """The tiny ControlNets offered, and a short wait: without a worker, a call that admits its job
    answers 504 at once, naming it."""
    return settings.model_copy(update={"controlnet_dir": controlnet_dir, "sync_wait_s": 0.05})


@pytest.mark.parametrize(("units", "code", "loc"), [
    ([unit(model="control_v11p_sd15_canny [d14c016b]")], "unknown_controlnet", None),
    ([unit(module="openpose")], "invalid_request", ["alwayson_scripts", "controlnet", "args", 0, "module"]),
    ([unit(enabled=False), unit(image="")], "invalid_request",
     ["alwayson_scripts", "controlnet", "args", 1, "image"]),
    ([unit(), unit(), unit(model="ember")], "invalid_request", ["alwayson_scripts", "controlnet", "args"]),
    ([unit(weight=2.5)], "invalid_request", ["alwayson_scripts.controlnet.args", 0, "scale"]),
])
def test_a_controlnet_unit_slotq_cannot_run_is_refused_in_a1111s_envelope(
        settings: Settings, controlnet_dir: Path, redis: Redis, units: list[dict[str, Any]], code: str,
        loc: Any) -> None:
    body = {"prompt": "a fox", **TINY, "alwayson_scripts": {"controlnet": {"args": units}}}
    for client in app_client(with_controlnets(settings, controlnet_dir)):
        response = client.post("/sdapi/v1/txt2img", json=body)
        answer = response.get_json()
        assert response.status_code == 422 and answer["code"] == code, answer
        assert set(answer) == {"error", "detail", "body", "errors", "code"}
        if loc is None:
            assert answer["error"] == "UnknownControlNetError"
            assert "chalk, chalk-file, ember" in answer["detail"]
        else:
            assert answer["errors"][0]["loc"] == loc, answer
    assert redis.keys("*") == []  # nothing admitted


def test_an_img2img_unit_without_an_image_takes_the_start_image(settings: Settings, controlnet_dir: Path
                                                                 ) -> None:
    buffer = io.BytesIO()
    start_image(64, 64).save(buffer, "PNG")
    picture = unit()["image"]  # webuiapi's raw base64 PNG
    # The second unit as older clients send one: `input_image`, few fields.
    units = [unit(image="", weight=0.5), {"model": "ember", "input_image": picture, "module": "none"}]
    body = {"prompt": "a fox", "init_images": [base64.b64encode(buffer.getvalue()).decode()],
            "alwayson_scripts": {"ControlNet": {"args": units}}}
    for client in app_client(with_controlnets(settings, controlnet_dir)):
        answer = client.post("/sdapi/v1/img2img", json=body).get_json()
        assert answer["code"] == "sync_wait_exceeded", answer  # admitted: no worker here
        ran = client.get(f"/v1/jobs/{answer['detail'].split()[1]}").get_json()["request"]
        first, second = ran["controlnets"]
        assert first["image"]["sha256"] == ran["image"]["sha256"] and first["scale"] == 0.5
        assert second["name"] == "ember" and second["preprocess"] == "none"
        assert second["image"]["sha256"] == hashlib.sha256(base64.b64decode(picture)).hexdigest()


def test_img2img_takes_raw_base64_and_any_format_pillow_reads(client: FlaskClient) -> None:
    buffer = io.BytesIO()
    start_image(64, 64).save(buffer, "BMP")  # not one slotq takes: made PNG
    raw = base64.b64encode(buffer.getvalue()).decode()
    refused = client.post("/sdapi/v1/img2img", json={"prompt": "a fox", "init_images": ["not an image"]})
    assert refused.status_code == 422 and refused.get_json()["code"] == "invalid_image"
    missing = client.post("/sdapi/v1/img2img", json={"prompt": "a fox"})
    assert missing.status_code == 422 and missing.get_json()["errors"][0]["loc"] == ["init_images"]
    # Without a worker, a wait that ends at once shows the job as admitted.
    for fast in app_client(client.application.extensions["slotq.settings"].model_copy(
            update={"sync_wait_s": 0.05})):
        answer = fast.post("/sdapi/v1/img2img", json={"prompt": "a fox", "init_images": [raw]}).get_json()
        ran = fast.get(f"/v1/jobs/{answer['detail'].split()[1]}").get_json()["request"]
        assert ran["image"]["media_type"] == "image/png" and ran["image"]["width"] == 64


def test_img2img_fits_a_photo_of_any_size_to_the_model(client: FlaskClient) -> None:
    # More pixels than a job may have, sides of no multiple of 8: fitted, its shape kept, as A1111
    # resizes any start image.
    buffer = io.BytesIO()
    Image.linear_gradient("L").resize((1600, 1203)).convert("RGB").save(buffer, "JPEG")
    photo = base64.b64encode(buffer.getvalue()).decode()
    for fast in app_client(client.application.extensions["slotq.settings"].model_copy(
            update={"sync_wait_s": 0.05})):
        answer = fast.post("/sdapi/v1/img2img", json={"prompt": "a fox", "init_images": [photo]}).get_json()
        ran = fast.get(f"/v1/jobs/{answer['detail'].split()[1]}").get_json()["request"]
        assert (ran["width"], ran["height"], ran["image"]["width"], ran["image"]["height"]) == (1024, 768) * 2
