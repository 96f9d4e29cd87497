"""Step-level scheduling through a real worker (SLOTQ_STEP_SCHEDULING): jobs join a running batch at
a step boundary, a higher class preempts it, and each job of a shared batch ends on its own."""

from __future__ import annotations

import io
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image
from redis import Redis

from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings
from tests.conftest import (
    Process,
    app_client,
    own_database,
    post_job,
    running_worker,
    start_worker,
    wait_for,
    wait_for_status,
)

SIZE = {"width": 256, "height": 256}


@pytest.fixture(scope="module")
def join_settings(redis_url: str, model_cache: Path) -> Settings:
    """A queue of its own (database 10), served by a worker that schedules at the step level and
    preempts at the next step boundary."""
    url = own_database(redis_url, 10)
    return Settings(redis_url=url, queue_name="join-tests", queue_capacity=50, cache_dir=model_cache,
                    max_batch=4, drain_s=0, step_scheduling=True, preempt_after_s=0, progress_interval_ms=0,
                    worker_metrics_port=0)


@pytest.fixture(scope="module")
def join_worker(join_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(join_settings, tmp_path_factory, "join")


@pytest.fixture
def client(join_worker: Process, join_settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(join_settings)


def view(client: FlaskClient, job_id: str) -> dict:
    return client.get(f"/v1/jobs/{job_id}").get_json()


def pixels(client: FlaskClient, job_id: str) -> np.ndarray:
    png = client.get(f"/v1/jobs/{job_id}/images/0").data
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def ended_at(job_view: dict) -> float:
    return datetime.fromisoformat(job_view["finished_at"]).timestamp()


def running_past(client: FlaskClient, job_id: str, step: int) -> dict:
    """Wait until the job runs and has reported this step."""
    def past() -> dict | None:
        seen = view(client, job_id)
        progress = seen["progress"] or {"step": 0}
        return seen if seen["status"] == "running" and progress["step"] >= step else None

    return wait_for(past, timeout=60, what=f"job {job_id} to run past step {step}")


def assert_same_image(client: FlaskClient, job_id: str, alone_client: FlaskClient, **request: object) -> None:
    """The job's image is the one the same request makes alone, on the session's worker (which runs
    whole-pipeline executions), up to float noise."""
    alone = post_job(alone_client, **request).get_json()["id"]
    wait_for_status(alone_client, alone, "succeeded")
    difference = np.abs(pixels(client, job_id) - pixels(alone_client, alone))
    print(f"max difference {difference.max()}, {100 * (difference > 0).mean():.3f}% of values")
    assert difference.max() <= 2 and (difference > 0).mean() < 0.01


def test_a_short_job_joins_a_long_one_ends_first_and_makes_its_own_image(
        client: FlaskClient, join_worker: Process, worker_client: FlaskClient) -> None:
    long = post_job(client, seed=1, steps=60, **SIZE).get_json()["id"]
    running_past(client, long, 2)
    short_request = {"prompt": "a blue whale", "seed": 7, "steps": 4, "guidance_scale": 5.0, **SIZE}
    short = post_job(client, **short_request).get_json()["id"]
    done = wait_for_status(client, short, "succeeded")
    assert view(client, long)["status"] == "running"  # still: the short job did not wait for it
    finished = wait_for_status(client, long, "succeeded")
    assert ended_at(done) < ended_at(finished)
    assert done["progress"] == {"step": 4, "total": 4} and finished["progress"] == {"step": 60, "total": 60}
    assert "joined the running batch" in join_worker.output()
    assert_same_image(client, short, worker_client, **short_request)


def test_each_job_in_the_loop_has_the_eta_of_its_own_steps(client: FlaskClient) -> None:
    long = post_job(client, seed=8, steps=80, **SIZE).get_json()["id"]
    running_past(client, long, 2)
    short = post_job(client, seed=9, steps=20, **SIZE).get_json()["id"]
    running_past(client, short, 2)
    views = [view(client, job_id) for job_id in (short, long)]
    assert all(each["status"] == "running" and each["eta_s"] for each in views), views
    # By the loop's step time: the short job's 18 or fewer steps left, the long one's 60 or more.
    assert 2 * views[0]["eta_s"]["finish"] < views[1]["eta_s"]["finish"], views
    wait_for_status(client, long, "succeeded")


def test_a_joined_job_has_its_previews_and_events(client: FlaskClient) -> None:
    long = post_job(client, seed=5, steps=60, **SIZE).get_json()["id"]
    running_past(client, long, 2)
    joined = post_job(client, seed=6, steps=40, previews=True, **SIZE).get_json()["id"]

    def previewed() -> bool:
        return client.get(f"/v1/jobs/{joined}/preview").status_code == 200

    wait_for(previewed, timeout=30, what="the joined job's preview")
    assert client.get(f"/v1/jobs/{joined}/preview").content_type == "image/jpeg"
    assert view(client, long)["status"] == "running"  # it was previewed inside the shared batch
    wait_for_status(client, joined, "succeeded")
    events = client.get(f"/v1/jobs/{joined}/events").get_data(as_text=True)
    for name in ("progress", "preview", "succeeded"):  # its log keeps the latest events
        assert f"event: {name}" in events, (name, events[-2000:])
    wait_for_status(client, long, "succeeded")


def test_canceling_one_job_of_a_shared_batch_ends_only_that_job(client: FlaskClient) -> None:
    long = post_job(client, seed=2, steps=60, **SIZE).get_json()["id"]
    running_past(client, long, 1)
    joined = [post_job(client, seed=10 + index, steps=50, **SIZE).get_json()["id"] for index in range(2)]
    for job_id in joined:
        running_past(client, job_id, 1)
    assert view(client, long)["status"] == "running"  # the three share the loop's batch
    assert client.delete(f"/v1/jobs/{joined[0]}").status_code == 202
    canceled = wait_for_status(client, joined[0], "canceled")
    survivors = [wait_for_status(client, job_id, "succeeded") for job_id in (long, joined[1])]
    assert canceled["images"] == [] and canceled["progress"]["step"] < 50
    assert [len(each["images"]) for each in survivors] == [1, 1]
    assert survivors[1]["progress"] == {"step": 50, "total": 50}


def test_a_high_job_preempts_a_low_batch_which_then_resumes_where_it_stopped(
        client: FlaskClient, join_worker: Process, worker_client: FlaskClient) -> None:
    low_request = {"prompt": "a green hill", "seed": 3, "steps": 60, "priority": "low", **SIZE}
    low = post_job(client, **low_request).get_json()["id"]
    running_past(client, low, 2)
    # Another size: it cannot join the low batch, and it waits no longer than the next step boundary.
    high = post_job(client, seed=4, steps=30, width=128, height=128, priority="high").get_json()["id"]
    paused = wait_for(lambda: view(client, low)["paused"], timeout=30, what="the low job to pause")
    high_done = wait_for_status(client, high, "succeeded")
    low_done = wait_for_status(client, low, "succeeded")
    assert paused and ended_at(high_done) < ended_at(low_done)
    assert low_done["paused"] is False and low_done["attempt"] == 1  # resumed, not started again
    assert "paused at a step boundary" in join_worker.output()
    assert_same_image(client, low, worker_client, **low_request)


def test_a_higher_job_s_start_estimate_does_not_wait_for_a_loop_that_pauses_for_it(
        client: FlaskClient, join_settings: Settings) -> None:
    from shared.contract import keys

    low = post_job(client, prompt="a long low job", seed=5, steps=100, priority="low", width=512,
                   height=512).get_json()["id"]
    running = running_past(client, low, 2)
    with Redis.from_url(join_settings.redis_url) as redis:
        # The loop has seconds left by its step time (or, before its first report, by the model, which
        # says 30 s).
        redis.hset(keys.model_key(join_settings.line), mapping={"a": 30.0, "b": 0.0})
        assert redis.hget(keys.pausing_key(join_settings.line), running["worker"]) == b"low 0.0"
        # Another low job waits for the loop: a 2 s start deadline is refused. A high one pauses it at
        # the next step boundary: admitted, starting at once by the estimate.
        late = post_job(client, seed=6, steps=4, priority="low", deadline_s=2, **SIZE)
        assert late.get_json()["error"]["code"] == "deadline_unmeetable"
        high = post_job(client, seed=7, steps=4, priority="high", deadline_s=2, width=128, height=128)
        assert high.status_code == 202 and high.get_json()["eta_s"]["start"] < 1
        assert wait_for_status(client, high.get_json()["id"], "succeeded")
        assert wait_for_status(client, low, "succeeded")
        assert redis.hget(keys.pausing_key(join_settings.line), running["worker"]) is None


def test_join_keys_separate_what_the_loop_cannot_share() -> None:
    base = JobRequest(prompt="a", width=256, height=256, steps=4, seed=1)
    # Steps, guidance, sampler, seed, prompts and image count may differ in one loop.
    assert base.join_key == JobRequest(prompt="b", width=256, height=256, steps=30, guidance_scale=2.0,
                                       scheduler="euler", seed=9, num_images=3, negative_prompt="x").join_key
    assert base.join_key != JobRequest(prompt="a", width=128, height=256).join_key
    # What changes the model call for a job's rows alone keeps start-only batching (no join key).
    for not_joinable in ({"speed": "fast"}, {"speed": "auto"}, {"loras": [{"name": "ink"}]},
                         {"prompt_syntax": "weighted"}, {"hires": {"scale": 2}}):
        assert JobRequest(prompt="a", **not_joinable).join_key == "", not_joinable


def test_a_crash_while_jobs_are_paused_runs_them_again_as_it_would_running_ones(
        settings: Settings, tmp_path: Path) -> None:
    crashing = settings.model_copy(update={"step_scheduling": True, "max_batch": 4, "preempt_after_s": 0,
                                           "heartbeat_ttl_s": 2, "progress_interval_ms": 0,
                                           "worker_metrics_port": 0, "queue_capacity": 10})
    clients = app_client(crashing)
    client = next(clients)
    started = [start_worker(crashing, tmp_path / "first.log")]
    try:
        low = post_job(client, seed=8, steps=60, priority="low", **SIZE).get_json()["id"]
        running_past(client, low, 2)
        high = post_job(client, seed=9, steps=100, priority="high", width=128, height=256).get_json()["id"]
        wait_for(lambda: view(client, low)["paused"], timeout=30, what="the low job to pause")
        # The pause comes just before the high job's own start: kill once that has started too.
        running_past(client, high, 1)
        started[0].popen.kill()  # SIGKILL: the paused job's state is lost with the process
        started.append(start_worker(crashing, tmp_path / "second.log"))
        ended = [wait_for_status(client, job_id, "succeeded", timeout=120) for job_id in (low, high)]
        assert [each["attempt"] for each in ended] == [2, 2]  # each ran again, from its start
        assert ended[0]["paused"] is False and ended[0]["progress"] == {"step": 60, "total": 60}
        with Redis.from_url(crashing.redis_url) as redis:
            assert all(redis.llen(key) == 0 for key in redis.keys("slotq:claims:*"))
    finally:
        for process in started:
            process.stop()
        clients.close()
