"""Issue 46 on the CPU: the tier a job runs in (speed, SLOTQ_DEGRADE_AT) and admission by what the live
workers can run (capacity_pixels), with a real worker process on the tiny model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from redis import Redis

from shared.contract.settings import Settings
from tests.conftest import (
    ONE_AT_A_TIME,
    app_client,
    own_database,
    post_job,
    start_worker,
    wait_for,
    wait_for_status,
)

DATABASE = 14  # apart from the others' (0 per test, 1 the worker, 2-3, 5-9, 11-13 other modules)
SMALL = {"width": 64, "height": 64, "steps": 2}


@pytest.fixture
def speed_settings(redis_url: str, model_cache: Path) -> Settings:
    url = own_database(redis_url, DATABASE)
    return Settings(redis_url=url, queue_name="speed-tests", cache_dir=model_cache, drain_s=0, device="cpu",
                    dtype="float32", torch_threads=1, heartbeat_ttl_s=2)


@pytest.fixture
def client(speed_settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(speed_settings)


def test_a_speed_other_than_normal_fast_or_auto_is_refused(client: FlaskClient,
                                                           speed_settings: Settings) -> None:
    refused = post_job(client, speed="warp", **SMALL)
    assert refused.status_code == 422 and refused.get_json()["error"]["code"] == "invalid_request"
    with Redis.from_url(speed_settings.redis_url) as redis:
        assert redis.dbsize() == 0  # nothing stored
    assert post_job(client, speed="fast", **SMALL).status_code == 202


def test_degrading_runs_only_auto_jobs_fast_while_the_line_is_deeper(
        client: FlaskClient, speed_settings: Settings, tmp_path: Path) -> None:
    speeds = ["normal", "auto", "auto", "auto", "auto", "auto", "normal", "fast"]
    ids = [post_job(client, speed=speed, seed=index, **SMALL).get_json()["id"]
           for index, speed in enumerate(speeds)]
    # One job an execution: each job's tier is chosen as it starts (a batch's, once for all of it).
    worker = start_worker(speed_settings.model_copy(update={"degrade_at": 3, **ONE_AT_A_TIME}),
                          tmp_path / "worker.log")
    try:
        views = [wait_for_status(client, job_id, "succeeded") for job_id in ids]
    finally:
        assert worker.stop() == 0, worker.output()
    tiers = [view["tier"] for view in views]
    # Waiting behind each as it started: 7, 6, 5, 4, 3, 2, 1, 0. Auto runs fast while more than 3 wait.
    assert tiers == ["normal", "fast", "fast", "fast", "normal", "normal", "normal", "fast"], tiers
    assert [view["request"]["speed"] for view in views] == speeds  # as asked, beside the tier that ran


def test_a_job_larger_than_every_live_worker_can_run_is_refused_with_nothing_stored(
        client: FlaskClient, speed_settings: Settings, tmp_path: Path) -> None:
    redis = Redis.from_url(speed_settings.redis_url)
    first = post_job(client, width=128, height=128, steps=1)
    assert first.status_code == 202  # no live worker: admitted
    worker = start_worker(speed_settings.model_copy(update={"capacity_pixels": 64 * 64 * 2}),
                          tmp_path / "worker.log")
    try:
        wait_for(lambda: client.get("/v1/models").get_json()["models"][0]["capacity_pixels"] == 8192,
                 what="the worker's capacity in GET /v1/models")
        # The job admitted before writes as it ends (its record, the job-time model): wait for it.
        wait_for_status(client, first.get_json()["id"], "succeeded", "failed")
        keys = set(redis.keys())
        refused = post_job(client, width=128, height=128, steps=1)
        error = refused.get_json()["error"]
        assert (refused.status_code, error["code"]) == (422, "too_large_for_workers"), error
        assert "at most 8192 pixels a job: 88x88 for 1 image(s)" in error["message"], error
        assert set(redis.keys()) - keys == set()  # nothing stored
        fits = post_job(client, num_images=2, **SMALL)  # 64 x 64 x 2 = 8192: just fits
        assert fits.status_code == 202, fits.get_json()
        assert wait_for_status(client, fits.get_json()["id"], "succeeded")["status"] == "succeeded"
        workers = client.get("/v1/workers").get_json()["workers"]
        assert [(each["capacity_pixels"], each["compile"]) for each in workers] == [(8192, "off")]
    finally:
        redis.close()
        assert worker.stop() == 0, worker.output()
