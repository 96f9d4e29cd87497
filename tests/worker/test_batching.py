"""Dynamic batching: per-job seeds, progress, results and cancellation, and the memory bound."""

from __future__ import annotations

import io
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image

from shared.contract.images import ImageRef
from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings
from shared.store.waiting import Claimed
from tests.conftest import (
    Process,
    app_client,
    own_database,
    post_job,
    running_worker,
    wait_for,
    wait_for_status,
)
from worker import batching

SMALL = {"width": 256, "height": 256, "steps": 4}


@pytest.fixture(scope="module")
def batch_settings(redis_url: str, model_cache: Path) -> Settings:
    """A queue of its own (database 2), served by a worker that batches up to 4 jobs."""
    url = own_database(redis_url, 2)
    return Settings(redis_url=url, queue_name="batch-tests", queue_capacity=50, cache_dir=model_cache,
                    max_batch=4, batch_wait_ms=0, drain_s=0)


@pytest.fixture(scope="module")
def batch_worker(batch_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(batch_settings, tmp_path_factory, "batch")


@pytest.fixture
def batch_client(batch_worker: Process, batch_settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(batch_settings)


def pixels(client: FlaskClient, job_id: str) -> np.ndarray:
    png = client.get(f"/v1/jobs/{job_id}/images/0").data
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def started(view: dict) -> float:
    return datetime.fromisoformat(view["started_at"]).timestamp()


def queue_behind_a_long_job(client: FlaskClient) -> str:
    """Submit a job that keeps the worker busy while the next ones gather in the line."""
    blocker = post_job(client, width=512, height=512, steps=20, seed=1).get_json()["id"]
    wait_for(lambda: client.get(f"/v1/jobs/{blocker}").get_json()["status"] == "running",
             what="the long job to start")
    return blocker


def test_compatible_jobs_run_as_one_execution_with_their_own_seeds(
        batch_client: FlaskClient, worker_client: FlaskClient) -> None:
    queue_behind_a_long_job(batch_client)
    prompts = ["a red fox", "a blue whale", "a green hill", "a grey cat"]
    ids = [post_job(batch_client, prompt=p, seed=100 + i, **SMALL).get_json()["id"]
           for i, p in enumerate(prompts)]
    other = post_job(batch_client, seed=7, width=128, height=128, steps=4).get_json()["id"]
    views = [wait_for_status(batch_client, i, "succeeded") for i in ids]
    alone = wait_for_status(batch_client, other, "succeeded")
    # One execution: every member was started in one transaction, microseconds apart; the next
    # execution starts once this one's section (four images, four steps, the decode) is done.
    starts = [started(view) for view in views]
    assert max(starts) - min(starts) < 0.01, starts
    assert started(alone) - max(starts) > 0.01  # the 128x128 job was not in the batch
    assert all(view["progress"] == {"step": 4, "total": 4} for view in views)
    # Each job's image is the one the same request makes alone (the session worker never batches),
    # up to the tiny float differences of batched arithmetic.
    for job_id, prompt, index in zip(ids, prompts, range(4), strict=True):
        single = post_job(worker_client, prompt=prompt, seed=100 + index, **SMALL).get_json()["id"]
        wait_for_status(worker_client, single, "succeeded")
        difference = np.abs(pixels(batch_client, job_id) - pixels(worker_client, single))
        print(f"{prompt}: max difference {difference.max()}, {100 * (difference > 0).mean():.3f}% of values")
        assert difference.max() <= 2 and (difference > 0).mean() < 0.01


def test_a_canceled_member_does_not_spoil_the_others(batch_client: FlaskClient) -> None:
    queue_behind_a_long_job(batch_client)
    ids = [post_job(batch_client, seed=i, width=256, height=256, steps=40).get_json()["id"] for i in range(3)]
    wait_for(lambda: all(batch_client.get(f"/v1/jobs/{i}").get_json()["status"] == "running" for i in ids),
             what="the three jobs to run together")
    assert batch_client.delete(f"/v1/jobs/{ids[1]}").status_code == 202  # its worker stops it
    canceled = wait_for_status(batch_client, ids[1], "canceled")
    survivors = [wait_for_status(batch_client, i, "succeeded") for i in (ids[0], ids[2])]
    assert canceled["images"] == [] and canceled["progress"]["step"] < 40
    assert all(view["images"] and view["progress"]["step"] == 40 for view in survivors)


def test_a_batch_never_holds_more_pixels_than_the_largest_single_job(batch_settings: Settings) -> None:
    def first(**fields: int) -> Claimed:
        request = JobRequest(prompt="x", **fields)
        return Claimed("id", {b"batch": request.batch_key.encode(), b"priority": b"normal"}, 0.0)

    roomy = batch_settings.model_copy(update={"max_batch": 64, "max_side": 512})
    # The largest single job at max_side 512: four 512x512 images, 1 Mpx.
    assert batching.room(roomy, first(width=512, height=512, num_images=4)) == 0
    assert batching.room(roomy, first(width=512, height=512, num_images=1)) == 3
    assert batching.room(roomy, first(width=64, height=64, num_images=1)) == 63  # capped by max_batch
    assert batching.room(roomy.model_copy(update={"max_batch": 1}), first(width=64, height=64)) == 0
    assert batching.room(batch_settings, first(width=256, height=256, num_images=2)) == 3
    # A worker that knows its capacity batches no more than it can run in one execution.
    assert batching.room(roomy, first(width=512, height=512, num_images=1), capacity=2 * 512 * 512) == 1
    assert batching.room(roomy, first(width=512, height=512, num_images=1), capacity=512 * 512) == 0


def test_batch_keys_separate_what_cannot_share_an_execution() -> None:
    base = JobRequest(prompt="a", width=256, height=256, steps=4, seed=1)
    same = base.model_copy(update={"prompt": "b", "seed": 2, "priority": "low"})
    assert same.batch_key == base.batch_key
    negative = base.model_copy(update={"negative_prompt": "blur"})
    assert negative.model_copy(update={"negative_prompt": "fog"}).batch_key == negative.batch_key
    # SDXL zeroes a missing negative prompt's embedding but encodes a batch-mate's "": apart.
    assert negative.batch_key != base.batch_key
    for change in ({"width": 264}, {"steps": 5}, {"guidance_scale": 7.0}, {"num_images": 2},
                   {"scheduler": "euler_a"}):
        assert base.model_copy(update=change).batch_key != base.batch_key
    assert JobRequest.pixels_of_batch_key(base.batch_key) == 256 * 256
    # Image jobs: their own kind, and their strength (the steps that run) too; not their images.
    reference = {"media_type": "image/png", "width": 256, "height": 256, "bytes": 1, "sha256": "a" * 64}
    edit = base.model_copy(update={"image": ImageRef(**reference)})
    other_image = edit.model_copy(update={"image": ImageRef(**{**reference, "sha256": "b" * 64}), "seed": 9})
    assert len({base.batch_key, edit.batch_key, edit.model_copy(update={"mask": edit.image}).batch_key,
                edit.model_copy(update={"strength": 0.5}).batch_key}) == 4
    assert other_image.batch_key == edit.batch_key
    assert JobRequest.pixels_of_batch_key(edit.batch_key) == 256 * 256
    sampled = base.model_copy(update={"scheduler": "dpmpp_2m_karras", "num_images": 2})
    assert JobRequest.pixels_of_batch_key(sampled.batch_key) == 2 * 256 * 256
