"""Every model family end to end: a real worker per family (tiny SD, SDXL and Flux pipelines) runs
text-to-image, image-to-image and inpainting jobs, batches, cancels, reports progress and repeats
itself; the API learns the family from the worker's heartbeat (GET /v1/models)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image, ImageOps

from shared.contract.models import TINY_MODELS, UNET_SCHEDULERS
from shared.contract.settings import Settings
from tests.conftest import (
    Process,
    app_client,
    box_mask,
    data_url,
    own_database,
    post_job,
    running_worker,
    start_image,
    wait_for,
    wait_for_status,
)

pytestmark = pytest.mark.timeout(300)  # a worker per family: torch, the model and its warm-up
DATABASE = 5  # the others: 0 per test, 1 the worker, 2 batching and fuzz, 3 schemathesis


@pytest.fixture(scope="module")
def family_settings(model: str, redis_url: str, model_cache: Path) -> Settings:
    """A queue of its own (database 5, flushed per family) for one tiny model (each in turn) and its
    tiny adapters, batching up to 4."""
    from worker.tiny.loras import ensure_tiny_loras

    url = own_database(redis_url, DATABASE)
    return Settings(redis_url=url, queue_name=f"family-{model}", queue_capacity=50,
                    cache_dir=model_cache, model=model, max_batch=4, batch_wait_ms=0, drain_s=0,
                    max_side=512, lora_dir=ensure_tiny_loras(model_cache, model))


@pytest.fixture(scope="module")
def family_worker(family_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(family_settings, tmp_path_factory, family_settings.model)


@pytest.fixture
def client(family_worker: Process, family_settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(family_settings)


def run(client: FlaskClient, **body: object) -> dict:
    response = post_job(client, **body)
    assert response.status_code == 202, response.get_json()
    return wait_for_status(client, response.get_json()["id"], "succeeded", "failed", "canceled")


def picture(client: FlaskClient, view: dict) -> Image.Image:
    assert view["status"] == "succeeded", view
    return Image.open(io.BytesIO(client.get(view["images"][0]).data))


def pixels(client: FlaskClient, view: dict) -> bytes:
    """The image's pixels (not the PNG's bytes, whose text chunk names the request)."""
    return picture(client, view).tobytes()


def started(view: dict) -> float:
    return datetime.fromisoformat(view["started_at"]).timestamp()


def test_the_api_learns_the_family_from_the_worker(client: FlaskClient, family_settings: Settings) -> None:
    family = TINY_MODELS[family_settings.model]
    # The first heartbeat follows RQ's registration, which start_worker waited for, by moments.
    (model,) = wait_for(lambda: [m for m in client.get("/v1/models").get_json()["models"] if m["workers"]],
                        what="the worker's first heartbeat")
    assert (model["name"], model["checkpoint"], model["family"], model["workers"]) == (
        family_settings.model_name, family_settings.model, family, 1)
    assert model["side_multiple"] == (16 if family == "flux" else 8)
    assert model["schedulers"] == (["flow_euler"] if family == "flux" else list(UNET_SCHEDULERS))
    # What a request leaves out comes from the family: Flux's low guidance, SDXL's 1024 side.
    response = post_job(client, prompt="defaults only")
    view = response.get_json()
    assert response.status_code == 202, view
    request = view["request"]
    assert {key: request[key] for key in model["defaults"]} == model["defaults"]
    assert client.delete(f"/v1/jobs/{view['id']}").status_code in (200, 202)
    # Sides the model cannot keep are refused at the door: Flux packs its latents 2x2, so 16.
    sides = post_job(client, width=72, height=64, steps=1)
    image = post_job(client, image=data_url(start_image(72, 64)), steps=1, strength=1.0)
    if family == "flux":
        assert sides.status_code == 422 and sides.get_json()["error"]["details"][0]["loc"] == ["width"]
        assert image.status_code == 422 and "multiples of 16" in image.get_json()["error"]["message"]
    else:
        assert (sides.status_code, image.status_code) == (202, 202)
        assert wait_for_status(client, image.get_json()["id"], "succeeded")["request"]["width"] == 72
    # A sampler of another family is refused at the door, with nothing admitted.
    foreign = "euler" if family == "flux" else "flow_euler"
    refused = post_job(client, scheduler=foreign, width=64, height=64, steps=1)
    assert refused.status_code == 422 and refused.get_json()["error"]["details"][0]["loc"] == ["scheduler"]


def test_an_adapter_of_the_family_changes_the_image_and_at_scale_0_is_the_bare_model(
        client: FlaskClient) -> None:
    body = {"width": 64, "height": 64, "steps": 2, "seed": 8}
    bare = pixels(client, run(client, **body))
    inked = run(client, **body, loras=[{"name": "ink"}])
    assert inked["request"]["loras"] == [{"name": "ink", "scale": 1.0}]
    changed = np.frombuffer(pixels(client, inked), np.uint8).astype(int)
    assert np.abs(changed - np.frombuffer(bare, np.uint8)).mean() > 5  # of 255: clearly another image
    assert pixels(client, run(client, **body, loras=[{"name": "ink", "scale": 0.0}])) == bare


def test_text_to_image_with_progress_and_the_same_seed_twice(client: FlaskClient) -> None:
    body = {"width": 128, "height": 64, "steps": 3, "seed": 21}
    first, second = run(client, **body), run(client, **body)
    assert first["progress"] == {"step": 3, "total": 3}
    assert picture(client, first).size == (128, 64)
    assert pixels(client, first) == pixels(client, second)
    assert pixels(client, first) != pixels(client, run(client, **{**body, "seed": 22}))


def test_a_fast_job_runs_in_the_fast_tier_near_the_normal_image(client: FlaskClient) -> None:
    body = {"prompt": "a lighthouse", "width": 128, "height": 128, "steps": 12, "seed": 4}
    normal, fast = run(client, **body), run(client, **body, speed="fast")
    other = run(client, **(body | {"seed": 5}))
    assert (normal["tier"], fast["tier"], fast["request"]["speed"]) == ("normal", "fast", "fast")
    as_array = [np.asarray(picture(client, view), dtype=np.float64) for view in (normal, fast, other)]
    cost, scale = np.abs(as_array[1] - as_array[0]).mean(), np.abs(as_array[2] - as_array[0]).mean()
    # Step caching changes the image a little: far less than another seed does.
    assert 0 < cost < scale / 5, (cost, scale)
    assert pixels(client, run(client, **body)) == pixels(client, normal)  # the normal tier is as it was


def test_image_to_image_keeps_the_size_counts_the_steps_run_and_repeats(client: FlaskClient) -> None:
    body = {"image": data_url(start_image(256, 256)), "strength": 0.6, "steps": 5, "seed": 3}
    view = run(client, **body)
    assert picture(client, view).size == (256, 256)
    assert view["progress"] == {"step": 3, "total": 3}  # int(5 x 0.6): the last 60 % of the schedule
    assert view["request"]["image"]["width"] == 256 and view["request"]["strength"] == 0.6
    assert pixels(client, view) == pixels(client, run(client, **body))
    # The start image matters: the same seed without it (or with another) makes another picture.
    text = run(client, width=256, height=256, steps=5, seed=3)
    other = run(client, **{**body, "image": data_url(start_image(256, 256, seed=9))})
    assert len({pixels(client, view), pixels(client, text), pixels(client, other)}) == 3


def test_inpainting_keeps_the_size_and_repeats(client: FlaskClient) -> None:
    body = {"image": data_url(start_image(256, 256)), "mask": data_url(box_mask(256, 256)),
            "strength": 1.0, "steps": 3, "seed": 4}
    view = run(client, **body)
    assert picture(client, view).size == (256, 256)
    assert view["progress"] == {"step": 3, "total": 3}
    assert view["request"]["mask"]["width"] == 256
    assert pixels(client, view) == pixels(client, run(client, **body))
    image_only = run(client, **{key: value for key, value in body.items() if key != "mask"})
    assert pixels(client, view) != pixels(client, image_only)


def test_inpainting_keeps_each_inputs_own_pixels_outside_its_mask_in_a_batch(client: FlaskClient) -> None:
    blocker = post_job(client, width=512, height=512, steps=30, seed=1).get_json()["id"]
    wait_for(lambda: client.get(f"/v1/jobs/{blocker}").get_json()["status"] == "running",
             what="the long job to start")
    # Two jobs of one batch key, each with its own start image and mask (the second keeps the middle).
    starts = [start_image(128, 128, seed=seed) for seed in (1, 2)]
    masks = [box_mask(128, 128), ImageOps.invert(box_mask(128, 128))]
    ids = [post_job(client, image=data_url(start), mask=data_url(mask), strength=1.0, steps=3, seed=5,
                    num_images=2).get_json()["id"] for start, mask in zip(starts, masks, strict=True)]
    views = [wait_for_status(client, job_id, "succeeded") for job_id in ids]
    assert abs(started(views[0]) - started(views[1])) < 0.01  # one execution
    for view, start, mask in zip(views, starts, masks, strict=True):
        assert len(view["images"]) == 2
        kept, original = np.asarray(mask) == 0, np.asarray(start, dtype=np.int16)
        for url in view["images"]:
            made = np.asarray(Image.open(io.BytesIO(client.get(url).data)), dtype=np.int16)
            assert np.abs(made - original).mean(axis=2)[~kept].mean() > 10  # the masked area repainted
            assert np.array_equal(made[kept], original[kept])  # the rest is the input's, exactly


def test_image_jobs_batch_with_their_own_kind_only(client: FlaskClient) -> None:
    blocker = post_job(client, width=512, height=512, steps=30, seed=1).get_json()["id"]
    wait_for(lambda: client.get(f"/v1/jobs/{blocker}").get_json()["status"] == "running",
             what="the long job to start")
    image = data_url(start_image(256, 256))
    ids = [post_job(client, image=image, strength=0.5, steps=8, seed=seed).get_json()["id"]
           for seed in (1, 2)]
    text = post_job(client, width=256, height=256, steps=4, seed=5).get_json()["id"]
    views = [wait_for_status(client, job_id, "succeeded") for job_id in ids]
    alone = wait_for_status(client, text, "succeeded")
    starts = [started(view) for view in views]
    # The members of one execution are started in one transaction, microseconds apart; the next
    # execution starts once this one's section (two images, four steps, the decode) is done.
    assert max(starts) - min(starts) < 0.01, starts  # one execution
    assert started(alone) - max(starts) > 0.01  # the text job of the same size was not in it
    assert all(view["progress"] == {"step": 4, "total": 4} for view in views)
    # Each member made its own picture from its seed.
    first, second = (np.asarray(picture(client, view), dtype=np.int16) for view in views)
    assert np.abs(first - second).max() > 10


def test_a_running_image_job_is_canceled_and_the_worker_goes_on(client: FlaskClient) -> None:
    job_id = post_job(client, image=data_url(start_image(512, 512)), strength=1.0, steps=100,
                      seed=8).get_json()["id"]
    wait_for(lambda: (client.get(f"/v1/jobs/{job_id}").get_json()["progress"] or {}).get("step"),
             what="the job to take its first step")
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 202
    view = wait_for_status(client, job_id, "canceled", "succeeded", "failed")
    assert view["status"] == "canceled" and view["progress"]["step"] < 100 and view["images"] == []
    assert run(client, width=64, height=64, steps=1)["status"] == "succeeded"
