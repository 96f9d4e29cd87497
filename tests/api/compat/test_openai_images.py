"""The OpenAI Images surface: the real ``openai`` package against real API processes on the session
worker's queue, and the request bodies that Open WebUI, LibreChat and SillyTavern send, replayed."""

from __future__ import annotations

import base64
import io
import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from flask.testing import FlaskClient
from openai import OpenAI
from PIL import Image

from api import state
from api.app import create_app
from shared.contract.settings import Settings
from slotq import harness
from tests.conftest import Process, http_post_job, running_api, start_image
from tests.test_metrics import scrape, value

REQUESTS = Path(__file__).parent / "requests"
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
FAST = {"steps": 2}  # slotq's extension, through extra_body: the tiny model's images in a blink


def png(data: bytes) -> Image.Image:
    """PNG bytes as an image, checking that they are PNG."""
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), data[:8]
    return Image.open(io.BytesIO(data))


def encoded(image: Image.Image, format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format)
    return buffer.getvalue()


def fetch(url: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET a URL of an API process: status, headers and body."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def listed(api: Process, key: str | None = None) -> list[dict[str, Any]]:
    """The jobs that GET /v1/jobs lists for this key, newest first."""
    status, _, body = fetch(api.url + "/v1/jobs?limit=100", key)
    assert status == 200, body
    return json.loads(body)["jobs"]


def job_id_of(url: str) -> str:
    found = re.search(r"/v1/jobs/([^/]+)/images/\d+\.png$", url)
    assert found, url
    return found[1]


def api_process(settings: Settings, folder: Path, **extra: Any) -> Process:
    """A real API process of a test's own, its log in ``folder``."""
    return harness.start_api(settings, folder / "api.log", **extra)


@pytest.fixture(scope="module")
def api(worker: Process, worker_settings: Settings,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """An open API process (no keys) on the session worker's queue."""
    yield from running_api(worker_settings, tmp_path_factory, "openai-api")


@pytest.fixture(scope="module")
def client(api: Process) -> Iterator[OpenAI]:
    with OpenAI(base_url=api.url + "/v1", api_key="sk-anything", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def keyed_api(worker: Process, worker_settings: Settings,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """An API process with API keys, one per tenant, on the session worker's queue."""
    yield from running_api(worker_settings, tmp_path_factory, "openai-keyed", api_keys=json.dumps(KEYS))


def sdk(api: Process, key: str) -> OpenAI:
    return OpenAI(base_url=api.url + "/v1", api_key=key, max_retries=0)


# --- images.generate ---------------------------------------------------------------------------

def test_generate_answers_b64_json_png_by_default(client: OpenAI, api: Process) -> None:
    before = scrape(api.url + "/metrics")
    answer = client.images.generate(prompt="a lighthouse, b64", size="64x96", extra_body=FAST)
    assert isinstance(answer.created, int) and answer.created > 0
    [image] = answer.data
    assert image.url is None and image.b64_json
    assert png(base64.b64decode(image.b64_json)).size == (64, 96)
    # An ordinary job: listed, succeeded, and counted under its surface.
    [job] = [job for job in listed(api) if job["request"]["prompt"] == "a lighthouse, b64"]
    assert job["status"] == "succeeded" and (job["request"]["width"], job["request"]["height"]) == (64, 96)
    after = scrape(api.url + "/metrics")
    moved = value(after, "slotq_admissions_total", outcome="admitted", surface="openai") - value(
        before, "slotq_admissions_total", outcome="admitted", surface="openai")
    assert moved == 1


def test_generate_answers_urls_the_client_can_get(client: OpenAI, api: Process) -> None:
    answer = client.images.generate(prompt="a lighthouse, url", size="64x64", response_format="url",
                                    extra_body=FAST)
    [image] = answer.data
    assert image.b64_json is None and image.url and image.url.startswith(api.url + "/v1/jobs/")
    status, headers, body = fetch(image.url)
    assert status == 200 and headers["Content-Type"] == "image/png"
    assert png(body).size == (64, 64)
    assert job_id_of(image.url) in {job["id"] for job in listed(api)}


def test_urls_never_name_the_host_a_client_chose(client: OpenAI, api: Process, worker_settings: Settings,
                                                  tmp_path: Path) -> None:
    """The URL's host is SLOTQ_PUBLIC_URL's where set, whatever Host the call sent; else the request's,
    with X-Forwarded-Host believed only from SLOTQ_TRUSTED_PROXIES."""
    forged = {"Host": "evil.example", "X-Forwarded-Host": "evil.example"}
    public = api_process(worker_settings, tmp_path, public_url="https://images.example.org/")
    try:
        with sdk(public, "sk-anything") as through_public:
            [image] = through_public.images.generate(prompt="a lighthouse, public", size="64x64",
                                                     response_format="url", extra_body=FAST,
                                                     extra_headers=forged).data
        assert image.url and image.url.startswith("https://images.example.org/v1/jobs/"), image.url
    finally:
        public.stop()
    [image] = client.images.generate(prompt="a lighthouse, forwarded", size="64x64", response_format="url",
                                     extra_body=FAST, extra_headers={"X-Forwarded-Host": "evil.example"}).data
    assert image.url and image.url.startswith(api.url + "/v1/jobs/"), image.url  # not trusted: ignored
    (tmp_path / "proxied").mkdir()
    proxied = api_process(worker_settings, tmp_path / "proxied", trusted_proxies="1")
    try:
        with sdk(proxied, "sk-anything") as behind_a_proxy:
            [image] = behind_a_proxy.images.generate(
                prompt="a lighthouse, proxied", size="64x64", response_format="url", extra_body=FAST,
                extra_headers={"X-Forwarded-Host": "images.example.org", "X-Forwarded-Proto": "https"}).data
        assert image.url and image.url.startswith("https://images.example.org/v1/jobs/"), image.url
    finally:
        proxied.stop()


def test_n_makes_that_many_different_images(client: OpenAI) -> None:
    answer = client.images.generate(prompt="two boats", n=2, size="64x64", extra_body=FAST)
    assert len(answer.data) == 2
    first, second = (base64.b64decode(image.b64_json or "") for image in answer.data)
    assert png(first).size == png(second).size == (64, 64)
    assert first != second


def test_size_auto_is_the_models_default_size(client: OpenAI, api: Process) -> None:
    status, _, body = fetch(api.url + "/v1/models")
    defaults = json.loads(body)["models"][0]["defaults"]
    answer = client.images.generate(prompt="a wide field", size="auto", extra_body={"steps": 1})
    made = png(base64.b64decode(answer.data[0].b64_json or ""))
    assert made.size == (defaults["width"], defaults["height"])


def test_openai_model_names_mean_the_default_model(client: OpenAI, api: Process,
                                                   worker_settings: Settings) -> None:
    answer = client.images.generate(prompt="dall-e's fox", model="dall-e-3", size="64x64",
                                    response_format="b64_json", extra_body=FAST)
    assert png(base64.b64decode(answer.data[0].b64_json or "")).size == (64, 64)
    # Without response_format, DALL-E's answer is a URL, as OpenAI's is (LibreChat's DALL-E 3 tool reads it).
    by_default = client.images.generate(prompt="dall-e's owl", model="dall-e-2", size="64x64",
                                        extra_body=FAST)
    assert by_default.data[0].url and by_default.data[0].b64_json is None
    models = {job["request"]["prompt"]: job["model"] for job in listed(api)}
    assert models["dall-e's fox"] == models["dall-e's owl"] == worker_settings.default_model


def test_extensions_pass_through_extra_body(client: OpenAI, api: Process) -> None:
    def made(seed: int) -> bytes:
        answer = client.images.generate(prompt="seeded", size="64x64",
                                        extra_body={"seed": seed, "steps": 3, "guidance_scale": 5.0,
                                                    "negative_prompt": "blur", "scheduler": "euler"})
        return base64.b64decode(answer.data[0].b64_json or "")

    first, again, other = made(7), made(7), made(8)
    assert first == again and first != other
    job = next(job for job in listed(api) if job["request"]["prompt"] == "seeded")
    request = job["request"]
    assert (request["seed"], request["steps"], request["guidance_scale"]) == (8, 3, 5.0)
    assert (request["negative_prompt"], request["scheduler"]) == ("blur", "euler")


@pytest.mark.parametrize(("output_format", "magic"), [("jpeg", b"\xff\xd8\xff"), ("webp", b"RIFF")])
def test_output_format_is_honoured(client: OpenAI, output_format: str, magic: bytes) -> None:
    answer = client.images.generate(prompt="a jar", size="64x64", output_format=output_format,
                                    output_compression=80, extra_body=FAST)
    data = base64.b64decode(answer.data[0].b64_json or "")
    assert data.startswith(magic)
    assert Image.open(io.BytesIO(data)).format == output_format.upper()


# --- images.edit -------------------------------------------------------------------------------

def test_edit_with_a_mask_repaints_only_its_transparent_pixels(client: OpenAI, api: Process) -> None:
    source = start_image(64, 64, seed=3)
    alpha = np.full((64, 64), 255, np.uint8)
    alpha[16:48, 16:48] = 0  # OpenAI's convention: fully transparent is the area to repaint
    mask = Image.fromarray(np.dstack([np.zeros((64, 64, 3), np.uint8), alpha]), "RGBA")
    answer = client.images.edit(image=("in.png", encoded(source), "image/png"),
                                mask=("mask.png", encoded(mask), "image/png"), prompt="a red square",
                                response_format="url", extra_body={"steps": 4, "seed": 1})
    url = answer.data[0].url or ""
    made = np.asarray(png(fetch(url)[2]).convert("RGB"))
    kept = alpha == 255
    assert made.shape == (64, 64, 3)
    assert (made[kept] == np.asarray(source)[kept]).all()  # the input's own pixels outside the mask
    assert (made[~kept] != np.asarray(source)[~kept]).any()  # and new ones inside it
    # slotq's mask: white repaints, black keeps.
    status, _, stored = fetch(f"{api.url}/v1/jobs/{job_id_of(url)}/inputs/mask")
    assert status == 200 and (np.asarray(png(stored)) == np.where(kept, 0, 255)).all()


def test_edit_without_a_mask_is_image_to_image(client: OpenAI, api: Process) -> None:
    source = start_image(64, 64, seed=4).convert("RGBA")  # transparency a start image cannot keep
    answer = client.images.edit(image=("in.png", encoded(source), "image/png"), prompt="dusk",
                                extra_body={"steps": 4, "strength": 0.5})
    assert png(base64.b64decode(answer.data[0].b64_json or "")).size == (64, 64)
    job = next(job for job in listed(api) if job["request"]["prompt"] == "dusk")
    assert job["request"]["mask"] is None and job["request"]["image"]["width"] == 64
    assert job["request"]["strength"] == 0.5


def test_edit_size_resizes_the_image(client: OpenAI) -> None:
    answer = client.images.edit(image=[("a.jpg", encoded(start_image(64, 64), "JPEG"), "image/jpeg"),
                                       ("b.png", encoded(start_image(64, 64)), "image/png")],
                                prompt="larger", size="128x96", model="gpt-image-1", extra_body={"steps": 2})
    assert png(base64.b64decode(answer.data[0].b64_json or "")).size == (128, 96)


def test_an_edit_takes_a_photo_of_any_size(client: OpenAI) -> None:
    # A phone's photo: more pixels than a job may have, sides of no model's multiple.
    photo = Image.linear_gradient("L").resize((1600, 1203)).convert("RGB")
    sized = client.images.edit(image=("photo.jpg", encoded(photo, "JPEG"), "image/jpeg"), prompt="a fox",
                               size="64x64", extra_body={"steps": 2})
    assert png(base64.b64decode(sized.data[0].b64_json or "")).size == (64, 64)
    # Without a size: the nearest the model makes, its shape kept (1024 wide at most, multiples of 8).
    auto = client.images.edit(image=("photo.jpg", encoded(photo, "JPEG"), "image/jpeg"), prompt="a fox",
                              extra_body={"steps": 1, "strength": 1.0})
    assert png(base64.b64decode(auto.data[0].b64_json or "")).size == (1024, 768)


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize(("asked", "param"), [
    ({"size": "100x100"}, "size"),
    ({"size": "big"}, "size"),
    ({"prompt": ""}, "prompt"),
    ({"n": 5}, "n"),
    ({"response_format": "gif"}, "response_format"),
    ({"extra_body": {"sed": 1}}, "sed"),  # OpenAI refuses a field it does not know: so does slotq
    ({"extra_body": {"steps": "2"}}, "steps"),
    ({"extra_body": {"loras": [{"name": "nowhere", "scale": 1.0}]}}, "loras"),
])
def test_a_bad_request_is_a_bad_request_error(client: OpenAI, api: Process, asked: dict[str, Any],
                                              param: str) -> None:
    before = scrape(api.url + "/metrics")
    with pytest.raises(openai.BadRequestError) as raised:
        client.images.generate(**{"prompt": "a cat", **asked})
    assert (raised.value.status_code, raised.value.param, raised.value.type) == (400, param,
                                                                                 "invalid_request_error")
    assert raised.value.message and raised.value.code
    after = scrape(api.url + "/metrics")
    refused = sum(value(after, "slotq_admissions_total", outcome=outcome, surface="openai")
                  - value(before, "slotq_admissions_total", outcome=outcome, surface="openai")
                  for outcome in ("invalid", "unknown_lora"))
    assert refused == 1


def test_an_unknown_model_is_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.images.generate(prompt="a cat", model="midjourney-7")
    assert (raised.value.param, raised.value.code) == ("model", "unknown_model")


def test_an_edit_of_what_is_no_image_is_a_bad_request(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client.images.edit(image=("in.png", b"not an image", "image/png"), prompt="x")
    assert raised.value.param == "image"
    mask = Image.new("RGB", (64, 64))  # no alpha: no pixel OpenAI's convention could repaint
    with pytest.raises(openai.BadRequestError) as raised:
        client.images.edit(image=("in.png", encoded(start_image(64, 64)), "image/png"),
                           mask=("mask.png", encoded(mask), "image/png"), prompt="x")
    assert raised.value.param == "mask"


def test_a_full_line_is_a_rate_limit_error_and_a_long_wait_is_not_retried(
        worker_settings: Settings, tmp_path: Path) -> None:
    # A queue no worker serves, with room for one job; a call waits for its job at most a second.
    idle = worker_settings.model_copy(update={"queue_name": "openai-idle", "queue_capacity": 1})
    api = api_process(idle, tmp_path, sync_wait_s=1)
    try:
        client = sdk(api, "sk-anything")
        with pytest.raises(openai.InternalServerError) as waited:
            client.images.generate(prompt="waits", size="64x64")
        assert waited.value.status_code == 504 and waited.value.code == "sync_wait_exceeded"
        assert waited.value.response.headers["x-should-retry"] == "false"
        job_id = re.search(r"Job ([0-9a-f-]{36}) ", waited.value.message)
        assert job_id, waited.value.message
        assert fetch(f"{api.url}/v1/jobs/{job_id[1]}")[0] == 200  # it goes on, queued
        with pytest.raises(openai.RateLimitError) as refused:
            client.images.generate(prompt="refused", size="64x64")
        assert refused.value.code == "queue_full" and refused.value.type == "rate_limit_error"
        assert int(refused.value.response.headers["Retry-After"]) >= 1
        assert http_post_job(api.url, {"prompt": "native", "width": 64, "height": 64})[0] == 429
        cancel = urllib.request.Request(f"{api.url}/v1/jobs/{job_id[1]}", method="DELETE")
        with urllib.request.urlopen(cancel):
            pass
    finally:
        api.stop()


# --- keys and tenants --------------------------------------------------------------------------

def test_a_wrong_key_is_an_authentication_error(keyed_api: Process) -> None:
    before = scrape(keyed_api.url + "/metrics")
    with pytest.raises(openai.AuthenticationError) as raised:
        sdk(keyed_api, "sk-wrong").images.generate(prompt="a cat", size="64x64")
    assert raised.value.type == "authentication_error"
    assert raised.value.response.headers["WWW-Authenticate"].startswith("Bearer")
    after = scrape(keyed_api.url + "/metrics")  # refused before the view: still this surface's admission
    assert value(after, "slotq_admissions_total", outcome="unauthorized", surface="openai") - value(
        before, "slotq_admissions_total", outcome="unauthorized", surface="openai") == 1


def test_another_tenant_sees_none_of_a_callers_jobs(keyed_api: Process) -> None:
    answer = sdk(keyed_api, "sk-alice").images.generate(prompt="alice's", size="64x64", response_format="url",
                                                        extra_body=FAST)
    url = answer.data[0].url or ""
    job_id = job_id_of(url)
    assert job_id in {job["id"] for job in listed(keyed_api, "sk-alice")}
    assert job_id not in {job["id"] for job in listed(keyed_api, "sk-bob")}
    assert fetch(url, "sk-alice")[0] == 200  # the URL answers the key that made it
    assert fetch(url, "sk-bob")[0] == 404
    assert fetch(url)[0] == 401


# --- models.list -------------------------------------------------------------------------------

def test_models_list_names_every_model(client: OpenAI, api: Process, worker_settings: Settings) -> None:
    models = client.models.list()
    assert [model.id for model in models] == list(worker_settings.offered_models)
    assert all(model.object == "model" and model.owned_by == "slotq" for model in models)
    native = json.loads(fetch(api.url + "/v1/models")[2])
    assert [model["name"] for model in native["models"]] == list(worker_settings.offered_models)


def test_models_list_adds_the_aliases(worker_settings: Settings) -> None:
    aliases = {"sdxl-turbo": worker_settings.default_model}
    aliased = Settings(**(worker_settings.model_dump() | {"model_aliases": aliases}))
    app = create_app(aliased)
    try:
        answer = app.test_client().get("/v1/models").get_json()
    finally:
        state.close(app)
    assert answer["object"] == "list"
    assert [model["id"] for model in answer["data"]] == [*aliased.offered_models, "sdxl-turbo"]


# --- what the clients send, replayed -----------------------------------------------------------

# What each client reads of the answer (research.md, with the source of each in its file).
READS = {
    "openwebui_images_generations": "b64_json",
    "openwebui_images_generations_gptimage": "b64_json",  # no response_format: it decodes b64_json
    "librechat_images_generations_gptimage": "b64_json",
    "librechat_dalle3_images_generations": "url",  # no response_format: it downloads data[0].url
    "sillytavern_openai_images_generations": "b64_json",
    "openwebui_images_edits": "b64_json",
    "openwebui_images_edits_multi": "b64_json",
    "librechat_images_edits": "b64_json",
}


def replay(client: FlaskClient, fixture: dict[str, Any], files: dict[str, bytes] | None = None,
           **extensions: Any) -> Any:
    """Send a recorded request: its JSON, or its form and files (a file's bytes replaced by ``files``),
    with slotq's ``extensions`` added."""
    headers = {name: value for name, value in fixture["headers"].items() if name != "Content-Type"}
    if "json" in fixture:
        return client.post(fixture["path"], json=fixture["json"] | extensions, headers=headers)
    data: dict[str, Any] = fixture["form"] | {name: str(value) for name, value in extensions.items()}
    for part in fixture["files"]:
        content = (files or {}).get(part["field"]) or base64.b64decode(part["b64"])
        upload = (io.BytesIO(content), part["filename"], part["content_type"])
        data.setdefault(part["field"], []).append(upload)
    return client.post(fixture["path"], data=data, headers=headers, content_type="multipart/form-data")


@pytest.mark.parametrize("name", sorted(READS))
def test_what_clients_send_is_answered_as_they_read_it(worker_client: FlaskClient, name: str) -> None:
    fixture = json.loads((REQUESTS / f"{name}.json").read_text())
    assert fixture["source"]
    # The recorded uploads are 1x1, which the contract refuses (see the test below): a 64x64 instead.
    # Two steps, as Open WebUI's IMAGES_OPENAI_API_PARAMS would add them: a 1024x1024 image of the tiny
    # model at its 30 takes 20 s here.
    upload = encoded(start_image(64, 64))
    answer = replay(worker_client, fixture, {"image": upload, "image[]": upload}, steps=2)
    assert answer.status_code == 200, answer.get_json()
    [image] = answer.get_json()["data"]
    assert set(image) == {READS[name]}
    if READS[name] == "url":
        got = worker_client.get(image["url"])
        assert got.status_code == 200
        data = got.data
    else:
        data = base64.b64decode(image["b64_json"])
    assert png(data).size == expected_size(worker_client, fixture)


def expected_size(client: FlaskClient, fixture: dict[str, Any]) -> tuple[int, int]:
    """The size asked for; else an edit's image's (64x64), or the model's default."""
    size = (fixture.get("json") or fixture["form"]).get("size")
    if size not in (None, "auto"):
        width, height = size.split("x")
        return int(width), int(height)
    if "form" in fixture:
        return 64, 64
    defaults = client.get("/v1/models").get_json()["models"][0]["defaults"]
    return defaults["width"], defaults["height"]


def test_an_upload_too_small_for_the_model_is_a_bad_request(worker_client: FlaskClient) -> None:
    fixture = json.loads((REQUESTS / "openwebui_images_edits.json").read_text())
    answer = replay(worker_client, fixture)  # as recorded: a 1x1 PNG
    assert answer.status_code == 400
    error = answer.get_json()["error"]
    assert (error["param"], error["code"]) == ("image", "invalid_image")
    assert error["type"] == "invalid_request_error"
