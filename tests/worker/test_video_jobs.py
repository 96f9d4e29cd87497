"""Video jobs end to end: a real worker per tiny video model (Wan, LTX-Video) makes clips through the
same line as images, served as MP4 (ranged reads) with a poster, equal to the pipeline's own frames."""

from __future__ import annotations

import inspect
import io
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, LTXImageToVideoPipeline
from flask.testing import FlaskClient
from PIL import Image
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from shared.contract import keys
from shared.contract.models import TINY_VIDEO_MODELS, family_spec
from shared.contract.settings import Settings
from tests.conftest import (
    Process,
    app_client,
    data_url,
    drained_and_resumed,
    own_database,
    post_job,
    running_worker,
    start_image,
    start_worker,
    wait_for,
    wait_for_status,
)
from worker.tiny.loras import ensure_tiny_loras
from worker.tiny.video import ensure_tiny_video_model
from worker.video import encode_mp4, read_mp4, to_uint8

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]
DATABASE = 18  # apart from the others' (0 per test, 1 the worker, 2-17 other modules)
SIDE, FPS = 64, 8


# The text-to-video models: every clip of the image-to-video one starts from an image
# (tests/worker/test_image_to_video.py).
TEXT_TO_VIDEO = [name for name, family in TINY_VIDEO_MODELS.items()
                 if not family_spec(family).starts_from_image]


@pytest.fixture(scope="module", params=TEXT_TO_VIDEO)
def video_model(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def video_settings(video_model: str, redis_url: str, model_cache: Path) -> Settings:
    """A queue of its own for one tiny video model and its LoRAs, every step reported (a cancel is seen
    at the next)."""
    return Settings(redis_url=own_database(redis_url, DATABASE), queue_name=f"video-{video_model}",
                    cache_dir=model_cache, model=video_model, drain_s=0, torch_threads=1,
                    progress_interval_ms=0, lora_dir=ensure_tiny_loras(model_cache, video_model))


@pytest.fixture(scope="module")
def video_worker(video_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(video_settings, tmp_path_factory, video_settings.model)


@pytest.fixture
def client(video_worker: Process, video_settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(video_settings)


@pytest.fixture(scope="module")
def pipe(video_model: str, model_cache: Path) -> Any:
    """The same tiny pipeline, loaded in the test's process as the worker loads it."""
    loaded = DiffusionPipeline.from_pretrained(ensure_tiny_video_model(model_cache, video_model),
                                               dtype=torch.float32)
    loaded.set_progress_bar_config(disable=True)
    return loaded


def frames_of(model: str) -> int:
    """The shortest clip but one of the model's: two steps of its frame multiple, plus one."""
    return 2 * family_spec(TINY_VIDEO_MODELS[model]).frame_multiple + 1


def long_clip(model: str, steps: int, width: int = 256, height: int = 256, **fields: Any) -> dict[str, Any]:
    """A clip whose steps take long enough on a CPU to be caught mid-way: tiny LTX-Video's take
    milliseconds at 256 px (a token packs 32x32 pixels and 8 frames), so its clip has twice the sides."""
    scale, frames = (2, 57) if TINY_VIDEO_MODELS[model] == "ltx" else (1, 4 * frames_of(model) - 3)
    return clip_body(model, steps=steps, width=width * scale, height=height * scale, frames=frames, **fields)


def run(client: FlaskClient, **body: Any) -> dict:
    response = post_job(client, **body)
    assert response.status_code == 202, response.get_json()
    return wait_for_status(client, response.get_json()["id"], "succeeded", "failed", "canceled")


def own_frames(pipe: Any, body: dict[str, Any], image: Image.Image | None = None) -> np.ndarray:
    """The pipeline's own clip for a job's body, as uint8 pixels: what an uninterrupted call makes."""
    arguments = {"prompt": body["prompt"], "negative_prompt": body["negative_prompt"],
                 "num_frames": body["frames"], "width": body["width"], "height": body["height"],
                 "num_inference_steps": body["steps"], "guidance_scale": body["guidance_scale"],
                 "generator": torch.Generator("cpu").manual_seed(body["seed"]), "output_type": "np"}
    if "frame_rate" in inspect.signature(type(pipe).__call__).parameters:  # LTX-Video conditions on it
        arguments["frame_rate"] = body["fps"]
    if image is not None:
        pipe, arguments["image"] = LTXImageToVideoPipeline.from_pipe(pipe), image
    with torch.inference_mode():
        return to_uint8(pipe(**arguments).frames[0])


def clip_body(model: str, **fields: Any) -> dict[str, Any]:
    return {"prompt": "a red fox running", "negative_prompt": "", "width": SIDE, "height": SIDE,
            "frames": frames_of(model), "fps": FPS, "steps": 3, "guidance_scale": 4.0, "seed": 11} | fields


def test_the_models_list_says_video_with_its_frame_multiple_and_defaults(client: FlaskClient,
                                                                        video_model: str) -> None:
    spec = family_spec(TINY_VIDEO_MODELS[video_model])
    (model,) = client.get("/v1/models").get_json()["models"]
    assert (model["media"], model["frame_multiple"]) == ("video", spec.frame_multiple)
    defaults = model["defaults"]
    assert (defaults["frames"], defaults["fps"]) == (spec.defaults.frames, spec.defaults.fps)


def test_a_clips_record_gets_its_familys_longer_timeout(client: FlaskClient, video_model: str,
                                                           video_settings: Settings) -> None:
    job_id = post_job(client, **clip_body(video_model)).get_json()["id"]
    with Redis.from_url(video_settings.redis_url) as redis:
        assert Job.fetch(job_id, connection=redis, serializer=JSONSerializer).timeout == 3600
    assert wait_for_status(client, job_id, "succeeded")["status"] == "succeeded"


@pytest.mark.parametrize("negative", ["", "blurry, still"])
def test_a_clip_is_the_pipelines_own_frames_as_an_mp4_with_its_first_frame_as_poster(
        client: FlaskClient, video_model: str, pipe: Any, negative: str) -> None:
    body = clip_body(video_model, negative_prompt=negative)
    view = run(client, **body)
    assert view["status"] == "succeeded", view
    assert view["progress"] == {"step": 3, "total": 3} and view["request"]["frames"] == body["frames"]
    served = client.get(view["video"])
    assert served.status_code == 200 and served.mimetype == "video/mp4"
    assert served.headers["Accept-Ranges"] == "bytes"
    frames, fps = read_mp4(served.data)
    assert frames.shape == (body["frames"], SIDE, SIDE, 3) and fps == FPS
    expected = own_frames(pipe, body)
    # The same frames through the same encoder make the same bytes (x264 is deterministic): the
    # pipeline's frames, not merely frames of the right shape.
    assert served.data == encode_mp4(expected, FPS)
    poster = Image.open(io.BytesIO(client.get(view["images"][0]).data))
    assert np.array_equal(np.asarray(poster), expected[0])


def test_a_clip_with_a_lora_is_the_pipelines_own_with_that_adapter_loaded_by_diffusers(
        client: FlaskClient, video_model: str, pipe: Any, video_settings: Settings) -> None:
    (model,) = client.get("/v1/models").get_json()["models"]
    assert model["loras"] == ["ink", "moss", "neon"]
    body = clip_body(video_model, seed=4)
    bare = client.get(run(client, **body)["video"]).data
    view = run(client, **body, loras=[{"name": "neon", "scale": 0.8}])
    assert view["status"] == "succeeded", view
    served = client.get(view["video"]).data
    pipe.load_lora_weights(video_settings.lora_dir, weight_name="neon.safetensors", adapter_name="neon")
    try:
        pipe.set_adapters(["neon"], adapter_weights=[0.8])
        assert served == encode_mp4(own_frames(pipe, body), FPS)
    finally:
        pipe.delete_adapters("neon")
    assert served != bare


def test_an_empty_and_a_given_negative_prompt_make_different_clips(client: FlaskClient,
                                                                   video_model: str) -> None:
    clips = [client.get(run(client, **clip_body(video_model, negative_prompt=negative))["video"]).data
             for negative in ("", "blurry, still")]
    assert clips[0] != clips[1]


def test_a_ranged_read_answers_206_with_the_bytes_asked_and_a_range_past_the_end_416(
        client: FlaskClient, video_model: str) -> None:
    view = run(client, **clip_body(video_model, seed=3))
    whole = client.get(view["video"]).data
    part = client.get(view["video"], headers={"Range": "bytes=0-99"})
    assert part.status_code == 206 and part.data == whole[:100]
    assert part.headers["Content-Range"] == f"bytes 0-99/{len(whole)}"
    tail = client.get(view["video"], headers={"Range": f"bytes={len(whole) - 10}-"})
    assert tail.status_code == 206 and tail.data == whole[-10:]
    past = client.get(view["video"], headers={"Range": f"bytes={len(whole)}-"})
    assert past.status_code == 416 and past.get_json()["error"]["code"] == "range_not_satisfiable"


def test_a_canceled_clip_stops_within_a_step_and_an_unfinished_ones_video_is_409(
        client: FlaskClient, video_model: str) -> None:
    body = long_clip(video_model, steps=100)
    job_id = post_job(client, **body).get_json()["id"]
    unfinished = client.get(f"/v1/jobs/{job_id}/video.mp4")
    assert unfinished.status_code == 409 and unfinished.get_json()["error"]["code"] == "not_ready"
    running = wait_for(lambda: (view := client.get(f"/v1/jobs/{job_id}").get_json())["progress"]
                       and view["progress"]["step"] >= 2 and view, timeout=120, what="the clip to run")
    asked = client.delete(f"/v1/jobs/{job_id}")
    assert asked.status_code in (200, 202), asked.get_json()
    seen = asked.get_json()["progress"]["step"]
    view = wait_for_status(client, job_id, "canceled")
    # Every step is reported, and each report reads the cancel: the worker stops at the report after
    # the DELETE (the view it answered may be one report behind the step the worker is on).
    assert running["progress"]["step"] <= view["progress"]["step"] <= seen + 2 < 100, view
    assert view["video"] is None
    missing = client.get("/v1/jobs/no-such-job/video.mp4")
    assert missing.status_code == 404 and missing.get_json()["error"]["code"] == "not_found"


def test_a_running_clip_with_previews_shows_its_middle_frame_as_a_jpeg_of_its_aspect(
        client: FlaskClient, video_model: str) -> None:
    body = long_clip(video_model, steps=100, width=256, height=128, previews=True)
    job_id = post_job(client, **body).get_json()["id"]
    preview = wait_for(lambda: (answer := client.get(f"/v1/jobs/{job_id}/preview")).status_code == 200
                       and answer, timeout=120, what="the clip's first preview")
    assert preview.mimetype == "image/jpeg"
    assert int(preview.headers["Preview-Step"]) >= 1
    picture = np.asarray(Image.open(io.BytesIO(preview.data)).convert("RGB")).astype(float)
    rows, columns, colours = picture.shape  # a preview is at most 256 px a side, of the clip's aspect
    assert (colours, columns, columns / rows) == (3, 256, 2) and picture.std() > 1  # not one flat colour
    client.delete(f"/v1/jobs/{job_id}")
    assert wait_for_status(client, job_id, "canceled")["preview"] is None


def test_an_image_to_video_clip_starts_from_its_image(client: FlaskClient, video_model: str,
                                                      pipe: Any) -> None:
    image = start_image(SIDE, SIDE, seed=5)
    body = clip_body(video_model, seed=21)
    response = post_job(client, **body, image=data_url(image))
    if family_spec(TINY_VIDEO_MODELS[video_model]).image_to_video_class is None:  # Wan's is a model apart
        # (tests/worker/test_image_to_video.py)
        assert response.status_code == 422, response.get_json()
        assert response.get_json()["error"]["details"][0]["loc"] == ["image"]
        return
    view = wait_for_status(client, response.get_json()["id"], "succeeded", "failed")
    assert view["status"] == "succeeded", view
    served = read_mp4(client.get(view["video"]).data)[0].astype(float)
    # Within the encoder's loss of the pipeline's own clip from that image, and far from the clip the
    # same seed makes without it. Not byte for byte, as the text-to-video clips are: encoding the
    # image runs the VAE's 3D convolutions, whose CPU kernels were seen to round differently in
    # another process once in a few runs.
    own = read_mp4(encode_mp4(own_frames(pipe, body, image), FPS))[0].astype(float)
    without = read_mp4(encode_mp4(own_frames(pipe, body), FPS))[0].astype(float)
    assert np.abs(served - own).mean() < 1.0  # in levels of 255 (seen: 0)
    assert np.abs(served - without).mean() > 5.0  # (seen: about 20)


@pytest.mark.parametrize(("fields", "loc"), [
    ({"frames": 10}, "frames"), ({"num_images": 2}, "num_images"),
    ({"speed": "fast"}, "speed"),
    ({"hires": {"scale": 2.0}}, "hires"), ({"fps": 0}, "fps")])
def test_what_a_video_model_cannot_do_is_refused_and_admits_nothing(
        client: FlaskClient, video_model: str, fields: dict[str, Any], loc: str | None) -> None:
    before = client.get("/v1/queue").get_json()
    response = post_job(client, **clip_body(video_model, **fields))
    assert response.status_code == 422, response.get_json()
    error = response.get_json()["error"]
    assert error["code"] == "invalid_request"
    if loc is not None:
        assert loc in [part for detail in error["details"] for part in detail["loc"]], error
    assert client.get("/v1/queue").get_json() == before


def test_a_killed_workers_clip_resumes_at_its_step_checkpoint_and_makes_the_uninterrupted_clip(
        video_settings: Settings, video_model: str, pipe: Any, tmp_path: Path) -> None:
    """SIGKILL after a step checkpoint of a 40-step clip: the next attempt starts at the checkpoint's
    step, says so, reports progress from there and makes the bytes the uninterrupted clip makes."""
    settings = video_settings.model_copy(update={"queue_name": f"video-resume-{video_model}",
                                                 "checkpoint_every_s": 0.3})
    body = long_clip(video_model, steps=40, seed=77)
    first = start_worker(settings, tmp_path / "first.log")
    second = None
    try:
        with Redis.from_url(settings.redis_url) as redis, contextmanager(app_client)(settings) as client:
            job_id = post_job(client, **body).get_json()["id"]
            checkpoint = keys.checkpoint_key(job_id)
            saved = wait_for(lambda: int(redis.hget(checkpoint, "step") or 0) or None, timeout=120,
                             what="a step checkpoint")
            first.popen.kill()
            assert 1 <= saved < 40
            second = start_worker(settings, tmp_path / "second.log")
            done = wait_for_status(client, job_id, "succeeded", "failed", timeout=180)
            assert done["status"] == "succeeded" and done["attempt"] == 2, done
            assert saved <= done["resumed_from_step"] < 40, done
            log = [(entry[b"event"], entry.get(b"data")) for _, entry in redis.xrange(keys.log_key(job_id))]
            again = [index for index, (event, _) in enumerate(log) if event == b"started"][1]
            steps = [json.loads(data)["step"] for event, data in log[again:] if event == b"progress"]
            assert steps[0] == 0 and min(steps[1:]) > done["resumed_from_step"], steps  # 0: the start's own
            assert not redis.exists(checkpoint)  # gone with the job's end
            assert client.get(done["video"]).data == encode_mp4(own_frames(pipe, body), FPS)
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0, second.output()


def test_a_high_image_job_preempts_a_running_clip_which_then_resumes_to_its_uninterrupted_bytes(
        redis_url: str, model_cache: Path, tmp_path: Path) -> None:
    """One worker serving an image model and a video model: a high 64x64 image job posted while a
    normal 40-step clip runs ends first; the clip, handed back at a step with its state saved, then
    resumes there and makes the clip an uninterrupted run makes."""
    import shutil

    from worker.tiny.model import ensure_tiny_model

    folder = tmp_path / "models"
    shutil.copytree(ensure_tiny_model(model_cache, "tiny"), folder / "img")
    shutil.copytree(ensure_tiny_video_model(model_cache, "tiny-wan"), folder / "clip")
    settings = Settings(redis_url=own_database(redis_url, 21), queue_name="video-preempt",
                        cache_dir=model_cache, models_dir=folder, model_names=["img"], worker_models=["*"],
                        model_cache=2, device="cpu", dtype="float32", torch_threads=1, drain_s=0,
                        progress_interval_ms=0)
    body = clip_body("tiny-wan", steps=40, width=256, height=256, frames=33, seed=91) | {"model": "clip"}
    worker = start_worker(settings, tmp_path / "worker.log")
    try:
        with contextmanager(app_client)(settings) as client:
            clip_id = post_job(client, **body).get_json()["id"]
            wait_for(lambda: (view := client.get(f"/v1/jobs/{clip_id}").get_json())["progress"]
                     and view["progress"]["step"] >= 2, timeout=120, what="the clip to run")
            image = post_job(client, model="img", width=64, height=64, steps=2, seed=5, priority="high")
            assert image.status_code == 202, image.get_json()
            image_view = wait_for_status(client, image.get_json()["id"], "succeeded", timeout=120)
            clip = wait_for_status(client, clip_id, "succeeded", "failed", timeout=180)
            assert clip["status"] == "succeeded", clip
            assert image_view["finished_at"] < clip["finished_at"]
            assert 2 <= clip["resumed_from_step"] < 40, clip  # handed back at a step, resumed there
            pipe = DiffusionPipeline.from_pretrained(folder / "clip", dtype=torch.float32)
            pipe.set_progress_bar_config(disable=True)
            assert client.get(clip["video"]).data == encode_mp4(own_frames(pipe, body), FPS)
    finally:
        assert worker.stop() == 0, worker.output()


def test_a_drained_clip_keeps_the_step_it_was_interrupted_at_and_resumes_there(
        video_settings: Settings, video_model: str, pipe: Any, tmp_path: Path) -> None:
    """SIGTERM with SLOTQ_STOP_TIMEOUT_S: the clip is interrupted at a step, saves it first (its
    periodic checkpoints are far off), goes back to its line and resumes there on the next worker."""
    settings = video_settings.model_copy(update={"queue_name": f"video-drain-{video_model}",
                                                 "stop_timeout_s": 0.1})
    body = long_clip(video_model, steps=100, seed=55)  # its periodic checkpoints are 60 s apart
    with drained_and_resumed(settings, body, tmp_path) as (client, done):
        assert client.get(done["video"]).data == encode_mp4(own_frames(pipe, body), FPS)
