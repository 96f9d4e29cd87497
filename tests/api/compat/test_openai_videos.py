"""The OpenAI Videos surface: the real ``openai`` package against a real API process and a real worker
on the tiny Wan model, each clip an ordinary slotq video job."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI
from openai.types import Video
from PIL import Image

from shared.contract.settings import Settings
from tests.conftest import Process, http_post_job, own_database, running_api, running_worker, start_image
from tests.test_metrics import scrape, value
from worker.video import read_mp4

pytestmark = [
    pytest.mark.timeout(300),  # the worker's torch and the tiny Wan model's warm-up
    # The openai package marks its Videos methods deprecated (OpenAI's Sora API closes in 2026);
    # slotq's surface stays, and so do the calls that reach it.
    pytest.mark.filterwarnings("ignore:The Sora API is scheduled:DeprecationWarning"),
]
DATABASE = 19  # apart from the other modules' (0 per test, 1 the session worker, 2-18)
KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
FPS, SIDE = 8, 64
TINY = {"steps": 2, "fps": FPS}  # slotq's extensions, through extra_body: 1 s is 9 frames at 8 fps
# With 15 s (121 frames), a clip that holds the worker for tens of seconds, or until it is canceled.
LONG = {"steps": 100, "fps": FPS}


@pytest.fixture(scope="module")
def video_settings(redis_url: str, model_cache: Path) -> Settings:
    """A queue of its own for the tiny Wan model (``default``), and two models no worker serves, whose
    jobs wait: ``pics`` makes images, ``clips`` is an LTX-Video (it starts a clip from an image). Every
    step is reported, so a cancel acts at the next."""
    return Settings(redis_url=own_database(redis_url, DATABASE), queue_name="openai-videos",
                    cache_dir=model_cache, model="tiny-wan", model_names=["default", "pics=sd", "clips=ltx"],
                    drain_s=0, torch_threads=1, progress_interval_ms=0)


@pytest.fixture(scope="module")
def worker(video_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(video_settings, tmp_path_factory, "openai-videos-worker")


@pytest.fixture(scope="module")
def api(worker: Process, video_settings: Settings,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """An API process with a key per tenant on the worker's queue."""
    yield from running_api(video_settings, tmp_path_factory, "openai-videos-api", api_keys=json.dumps(KEYS))


@pytest.fixture(scope="module")
def alice(api: Process) -> Iterator[OpenAI]:
    with OpenAI(base_url=api.url + "/v1", api_key="sk-alice", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def bob(api: Process) -> Iterator[OpenAI]:
    with OpenAI(base_url=api.url + "/v1", api_key="sk-bob", max_retries=0) as sdk:
        yield sdk


@pytest.fixture(scope="module")
def clip(alice: OpenAI, api: Process) -> Video:
    """One short clip, made through ``create_and_poll``, with the admissions counted around it."""
    before = scrape(api.url + "/metrics")
    video = alice.videos.create_and_poll(prompt="a lighthouse at dusk", model="sora-2", seconds="1",
                                         size=f"{SIDE}x{SIDE}", extra_body=TINY)
    after = scrape(api.url + "/metrics")
    admitted = [value(samples, "slotq_admissions_total", outcome="admitted", surface="openai")
                for samples in (before, after)]
    assert admitted[1] - admitted[0] == 1
    return video


def fetch(url: str, key: str = "sk-alice", headers: dict[str, str] | None = None
          ) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def envelope(error: openai.APIStatusError) -> dict[str, Any]:
    """The error's body, which must be OpenAI's envelope and nothing else."""
    body = error.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def png_of(data: bytes) -> Image.Image:
    assert data.startswith(b"\x89PNG\r\n\x1a\n"), data[:8]
    return Image.open(io.BytesIO(data))


# --- create, poll, download ----------------------------------------------------------------------

def test_create_and_poll_makes_the_clip_asked_for(clip: Video, api: Process) -> None:
    assert (clip.object, clip.status, clip.progress, clip.error) == ("video", "completed", 100, None)
    assert (clip.model, clip.size, clip.seconds) == ("default", "64x64", "1")
    assert clip.prompt == "a lighthouse at dusk"
    assert clip.completed_at is not None and clip.created_at <= clip.completed_at
    assert clip.expires_at == clip.completed_at + 3600  # SLOTQ_RESULT_TTL_S: the clip's bytes then expire
    # An ordinary job: 1 s at 8 fps is 9 frames (Wan's 4k+1), the steps and size as asked.
    status, _, body = fetch(f"{api.url}/v1/jobs/{clip.id}")
    job = json.loads(body)
    assert status == 200 and job["status"] == "succeeded", job
    assert {name: job["request"][name] for name in ("frames", "fps", "width", "height", "steps")} == {
        "frames": 9, "fps": FPS, "width": SIDE, "height": SIDE, "steps": 2}
    assert job["video"] == f"/v1/jobs/{clip.id}/video.mp4"


def test_the_content_is_the_jobs_mp4(alice: OpenAI, clip: Video, api: Process) -> None:
    data = alice.videos.download_content(clip.id).content
    frames, fps = read_mp4(data)
    assert frames.shape == (9, SIDE, SIDE, 3) and fps == FPS
    assert fetch(f"{api.url}/v1/jobs/{clip.id}/video.mp4")[2] == data  # the native route's bytes
    # Ranged reads, as the native route answers them (a player seeks with them).
    status, headers, part = fetch(f"{api.url}/v1/videos/{clip.id}/content", headers={"Range": "bytes=0-99"})
    assert (status, part) == (206, data[:100])
    assert headers["Content-Range"] == f"bytes 0-99/{len(data)}" and headers["Content-Type"] == "video/mp4"


def test_the_thumbnail_is_the_poster_png(alice: OpenAI, clip: Video, api: Process) -> None:
    poster = alice.videos.download_content(clip.id, variant="thumbnail").content
    assert png_of(poster).size == (SIDE, SIDE)
    assert fetch(f"{api.url}/v1/jobs/{clip.id}/images/0")[2] == poster
    with pytest.raises(openai.BadRequestError) as raised:
        alice.videos.download_content(clip.id, variant="spritesheet")
    assert envelope(raised.value)["param"] == "variant"


def test_json_clients_are_answered_as_multipart_ones(api: Process) -> None:
    body = json.dumps({"prompt": "json", "seconds": "1", "size": "64x64", **TINY}).encode()
    request = urllib.request.Request(api.url + "/v1/videos", data=body, method="POST", headers={
        "Authorization": "Bearer sk-alice", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        video = json.loads(response.read())
    # Video's fields, each of them (the package parses leniently: its size and seconds are Sora's literals).
    assert set(video) == set(Video.model_fields) and (video["status"], video["size"]) == ("queued", "64x64")


def test_an_input_reference_is_the_jobs_start_image(alice: OpenAI, api: Process) -> None:
    """An upload of any size becomes the start image at the size asked for, on a model that takes one."""
    video = alice.videos.create(prompt="from a photo", model="clips", size="64x64", input_reference=(
        "start.png", png_bytes(start_image(96, 80)), "image/png"), extra_body=TINY)
    assert (video.status, video.model, video.size) == ("queued", "clips", "64x64")  # no worker serves it
    status, _, body = fetch(f"{api.url}/v1/jobs/{video.id}/inputs/image")
    assert status == 200 and png_of(body).size == (64, 64)
    assert alice.videos.delete(video.id).deleted


# --- retrieve, list, delete -----------------------------------------------------------------------

def test_retrieve_lists_and_tenants(alice: OpenAI, bob: OpenAI, clip: Video, api: Process) -> None:
    assert alice.videos.retrieve(clip.id) == clip
    with pytest.raises(openai.NotFoundError):  # another tenant's video is none of bob's
        bob.videos.retrieve(clip.id)
    assert clip.id not in {video.id for video in bob.videos.list()}
    # An image job of alice's (on `pics`, which no worker serves: it waits) is no video.
    status, image_job, _ = http_post_job(api.url, {"prompt": "a picture", "model": "pics", "width": 64,
                                                   "height": 64}, key="sk-alice")
    assert status == 202, image_job
    with pytest.raises(openai.NotFoundError):
        alice.videos.retrieve(image_job["id"])
    second = alice.videos.create(prompt="a second clip", seconds="1", size="64x64", extra_body=TINY)
    newest = [video.id for video in alice.videos.list()]
    assert image_job["id"] not in newest and newest.index(second.id) < newest.index(clip.id)
    # OpenAI's cursor pages: one at a time, the package following `last_id` until `has_more` is false.
    first = alice.videos.list(limit=1)
    assert len(first.data) == 1 and first.has_more and first.last_id == first.data[0].id == newest[0]
    assert [video.id for video in alice.videos.list(limit=1)] == newest  # every page, in turn
    assert [video.id for video in alice.videos.list(order="asc")] == newest[::-1]
    after = alice.videos.list(after=newest[0], limit=100)
    assert [video.id for video in after.data] == newest[1:] and not after.has_more
    alice.videos.delete(second.id)  # done or not, nothing is left running


def test_delete_cancels_a_clip_that_has_not_ended(alice: OpenAI, clip: Video) -> None:
    held = alice.videos.create(prompt="holds the worker", seconds="15", size="64x64", extra_body=LONG)
    waiting = alice.videos.create(prompt="waits", seconds="1", size="64x64", extra_body=TINY)
    with pytest.raises(openai.NotFoundError) as raised:  # OpenAI's answer until the video is completed
        alice.videos.download_content(waiting.id)
    assert envelope(raised.value)["code"] == "not_found"
    for video in (waiting, held):
        deleted = alice.videos.delete(video.id)
        assert (deleted.id, deleted.object, deleted.deleted) == (video.id, "video.deleted", True)
        ended = alice.videos.poll(video.id, poll_interval_ms=100)
        assert ended.status == "failed" and ended.error is not None and ended.error.code == "canceled", ended
    # A finished clip is kept until its results expire: slotq deletes none, and says so.
    assert alice.videos.delete(clip.id).deleted is False
    assert alice.videos.retrieve(clip.id).status == "completed"


# --- refusals -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("asked", "param"), [
    ({"size": "60x64"}, "size"),  # Wan's sides are multiples of 16
    ({"size": "1280x720x2"}, "size"),
    ({"seconds": "a while"}, "seconds"),
    ({"seconds": "600"}, "seconds"),  # over SLOTQ_MAX_FRAMES
    ({"extra_body": {"steps": 0}}, "steps"),
    ({"extra_body": {"scheduler": "euler"}}, "scheduler"),  # not one of this surface's extensions
    ({"model": "pics"}, "model"),  # an image model
    # The native contract refuses a start image on Wan (its image-to-video is another checkpoint).
    ({"input_reference": ("start.png", png_bytes(start_image(96, 80)), "image/png")}, "input_reference"),
])
def test_a_bad_request_is_a_bad_request_error(alice: OpenAI, api: Process, asked: dict[str, Any],
                                              param: str) -> None:
    before = scrape(api.url + "/metrics")
    with pytest.raises(openai.BadRequestError) as raised:
        alice.videos.create(**{"prompt": "a cat", **asked})
    error = envelope(raised.value)
    assert (raised.value.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error")
    assert error["message"] and error["code"] == "invalid_request"
    after = scrape(api.url + "/metrics")
    refused = [value(samples, "slotq_admissions_total", outcome="invalid", surface="openai")
               for samples in (before, after)]
    assert refused[1] - refused[0] == 1


def test_an_unknown_model_is_not_found(alice: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        alice.videos.create(prompt="a cat", model="veo-3")
    assert (envelope(raised.value)["param"], raised.value.code) == ("model", "unknown_model")


def test_a_wrong_key_is_an_authentication_error(api: Process) -> None:
    with OpenAI(base_url=api.url + "/v1", api_key="sk-wrong", max_retries=0) as stranger, \
            pytest.raises(openai.AuthenticationError) as raised:
        stranger.videos.create(prompt="a cat")
    assert envelope(raised.value)["type"] == "authentication_error"
