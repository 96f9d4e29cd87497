"""The job-time model the worker fits, and the Retry-After and ETAs drawn from it."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import partial
from itertools import pairwise
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from redis import Redis

from shared.contract.settings import Settings
from tests.conftest import ONE_AT_A_TIME, Process, post_job, start_worker, wait_for, wait_for_status

pytestmark = pytest.mark.slow
SMALL = {"width": 256, "height": 256, "steps": 4}  # 1 cost unit
LARGE = {"width": 512, "height": 512, "steps": 16}  # 16 cost units
LONGER = {"width": 512, "height": 512, "steps": 48}  # 48 units: seconds to run even on a quiet machine
# Neighbouring ETAs in a line of such jobs must lie further apart than the Retry-After check's window
# (about a second), so that counting one job fewer or one more cannot pass it.
APART_S = 3.0


@pytest.fixture
def trained(settings: Settings, client: FlaskClient, tmp_path: Path) -> Iterator[Process]:
    """A worker whose model has seen a few jobs of both sizes, one job an execution (the estimates of
    batches: test_the_jobs_ahead_pay_an_executions_cost_once_per_batch)."""
    worker = start_worker(settings, tmp_path / "worker.log", **ONE_AT_A_TIME)
    try:
        for body in [SMALL, LARGE, SMALL, LARGE, SMALL, LARGE]:
            job_id = post_job(client, **body).get_json()["id"]
            wait_for_status(client, job_id, "succeeded")
        yield worker
    finally:
        worker.stop()


def lasting(redis: Redis, settings: Settings, seconds: float) -> dict[str, int]:
    """The smallest job (512 px and up, by steps) that the fitted model says takes ``seconds``: the
    same spacing of ETAs however fast the machine runs."""
    from shared.contract import keys

    model = redis.hgetall(keys.model_key(settings.line))
    a, b = float(model[b"a"]), float(model[b"b"])
    for side in (512, 768, 1024):
        steps = math.ceil((seconds - a) / (b * side * side / 512**2))
        if steps <= settings.max_steps:
            return {"width": side, "height": side, "steps": max(steps, 1)}
    raise AssertionError(f"no job lasts {seconds} s by the model a={a}, b={b}: the machine is too fast")


def seconds_from(moment: str, origin: float) -> float:
    return datetime.fromisoformat(moment).timestamp() - origin


def within(estimate: float, actual: float, share: float = 0.25) -> bool:
    return abs(estimate - actual) <= share * actual


@pytest.mark.alone  # the step time against the wall clock: no other test may slow the machine
@pytest.mark.parametrize("execution", ["whole", "loop"])
def test_a_running_job_s_eta_falls_with_its_steps(client: FlaskClient, settings: Settings,
                                                  tmp_path: Path, execution: str) -> None:
    """A 40-step job, read at two steps: the later ETA is smaller, and each is within half of the time
    that was then left (before any job of the model ended, so from the job's own step time alone),
    in a whole-pipeline execution and in the step-level loop."""
    loop = {"step_scheduling": True, "max_batch": 4} if execution == "loop" else {}
    worker = start_worker(settings, tmp_path / "worker.log", **loop)
    try:
        job_id = post_job(client, width=512, height=512, steps=40, seed=3).get_json()["id"]
        readings = []  # (the ETA's finish, when it was read)
        for reached in (8, 24):
            view = wait_for(partial(at_step, client, job_id, reached), timeout=120, what=f"step {reached}")
            assert view["eta_s"] is not None, view
            readings.append((view["eta_s"]["finish"], time.time()))
        ended = wait_for_status(client, job_id, "succeeded", timeout=120)
        finished = datetime.fromisoformat(ended["finished_at"]).timestamp()
    finally:
        worker.stop()
    (first, first_at), (second, second_at) = readings
    assert second < first
    for estimate, read_at in readings:
        assert within(estimate, finished - read_at, share=0.5), (readings, finished)


def at_step(client: FlaskClient, job_id: str, step: int) -> dict | None:
    """The job's view once it runs at ``step`` or later (None before; fails if it ended first)."""
    view = client.get(f"/v1/jobs/{job_id}").get_json()
    assert view["status"] in ("queued", "running"), view
    progress = view.get("progress") or {}
    return view if view["status"] == "running" and progress.get("step", 0) >= step else None


@pytest.mark.alone  # the model against the wall clock: no other test may slow the machine
def test_eta_of_queued_jobs_of_two_sizes(client: FlaskClient, trained: Process) -> None:
    ids = [post_job(client, **body).get_json()["id"] for body in [LARGE, SMALL, LARGE, SMALL, LARGE, SMALL]]
    wait_for(lambda: client.get(f"/v1/jobs/{ids[0]}").get_json()["status"] == "running",
             what="the first job to run")
    asked = time.time()
    etas = {i: client.get(f"/v1/jobs/{i}").get_json()["eta_s"] for i in ids[-3:]}
    done = {i: wait_for_status(client, i, "succeeded", timeout=120) for i in ids[-3:]}
    # The machine's speed drifts by a third within minutes, between the model's fit and these jobs:
    # the third-last job (a large one, in the same minute) measures the drift, and the last two (one
    # of each size, further down the line) must then land within a quarter of their ETAs.
    drift = seconds_from(done[ids[-3]]["finished_at"], asked) / etas[ids[-3]]["finish"]
    assert 0.5 < drift < 2, f"the model is off by {drift:.2f} times, beyond a machine's drift"
    for job_id in ids[-2:]:
        start = seconds_from(done[job_id]["started_at"], asked)
        finish = seconds_from(done[job_id]["finished_at"], asked)
        print(f"eta {etas[job_id]} x drift {drift:.2f} vs actual start {start:.2f}s finish {finish:.2f}s")
        assert within(drift * etas[job_id]["start"], start) and within(drift * etas[job_id]["finish"], finish)


@pytest.mark.alone  # the model against the wall clock: no other test may slow the machine
def test_retry_after_on_a_full_queue_comes_from_the_model(client: FlaskClient, settings: Settings,
                                                          trained: Process) -> None:
    first = post_job(client, **LONGER).get_json()["id"]
    wait_for(lambda: client.get(f"/v1/jobs/{first}").get_json()["status"] == "running",
             what="a large job to run")
    running = client.get(f"/v1/jobs/{first}").get_json()
    for _ in range(settings.queue_capacity):
        post_job(client, **SMALL)
    refused = post_job(client, **SMALL)
    assert refused.status_code == 429
    retry_after = int(refused.headers["Retry-After"])
    # A place frees when the running job ends: its remaining time by the model, in whole seconds.
    remaining = running["eta_s"]["finish"]
    print(f"Retry-After {retry_after}s with a large job {remaining:.2f}s from its end")
    assert remaining > 1 and abs(retry_after - remaining) <= 1.5


@pytest.mark.alone  # the model against the wall clock: no other test may slow the machine
def test_retry_after_for_a_low_job_counts_the_jobs_that_must_leave_first(
        client: FlaskClient, settings: Settings, redis: Redis, trained: Process) -> None:
    job = lasting(redis, settings, APART_S + 0.5)
    first = post_job(client, **job).get_json()["id"]
    wait_for(lambda: client.get(f"/v1/jobs/{first}").get_json()["status"] == "running",
             what="a large job to run")
    waiting = []
    for _ in range(settings.queue_capacity):
        admitted = post_job(client, **job)
        assert admitted.status_code == 202
        waiting.append(admitted.get_json()["id"])
    sent = time.monotonic()
    refused = post_job(client, priority="low", **SMALL)
    assert refused.status_code == 429 and refused.get_json()["error"]["code"] == "queue_full"
    retry_after = int(refused.headers["Retry-After"])
    # Low jobs are admitted while fewer than 3 wait (half of 5, rounded up): 3 of the 5 waiting
    # must leave, so there is room when the third starts, after the running job and two more.
    limit = settings.waiting_limit("low")
    starts = [client.get(f"/v1/jobs/{job_id}").get_json()["eta_s"]["start"] for job_id in waiting]
    read = time.monotonic() - sent
    room = starts[len(waiting) - limit]
    print(f"{job}: Retry-After {retry_after}s; the waiting jobs start in {[round(s, 2) for s in starts]}s")
    # The count is what is checked, against the same model's ETA: admission rounds its ETA up to
    # whole seconds, and the ETAs read after it are at most ``read`` seconds nearer. One job fewer or
    # one more would be an ETA further off than that window.
    assert min(later - earlier for earlier, later in pairwise(starts)) > APART_S
    assert room > 2 and room - 0.01 <= retry_after <= room + 1 + read
    wait_for(lambda: client.get("/v1/queue").get_json()["waiting"] < limit, timeout=120,
             what="room for a low job")
    actual = time.monotonic() - sent
    print(f"room for a low job after {actual:.2f}s")
    # And in wall-clock time, room comes when the model said. The model was fitted seconds before,
    # and a shared machine's speed can drift by a third between the fit and the wait, so a half
    # either way: still far from one job's time or six's.
    assert 0.5 * actual <= retry_after <= 1.5 * actual + 1
    assert post_job(client, priority="low", **SMALL).status_code == 202


def test_an_eta_down_a_long_line_counts_what_the_jobs_ahead_cost(settings: Settings, redis: Redis) -> None:
    # Each class's waiting cost is kept as a sum beside the line: an ETA reads one hash, whatever
    # the line's length, and counts what the jobs ahead cost, exactly where they are all of one
    # tenant (each new job the last of its class).
    from shared.contract import keys
    from tests.conftest import app_client

    a, b = 0.5, 2.0  # seconds: a + b * cost
    redis.hset(keys.model_key(settings.line), mapping={"a": a, "b": b})
    cost = {side: side * side * 4 / 512**2 for side in (64, 128)}  # cost units of a 4-step job
    small, large = a + b * cost[64], a + b * cost[128]
    with contextmanager(app_client)(settings.model_copy(update={"queue_capacity": 1000})) as api:
        etas = [post_job(api, width=side, height=side, steps=4).get_json()["eta_s"]["start"]
                for side in [64] * 25 + [128] * 12]
        high = post_job(api, width=64, height=64, steps=4, priority="high").get_json()
        low = post_job(api, width=64, height=64, steps=4, priority="low").get_json()
        queued = [api.get(f"/v1/jobs/{job['id']}").get_json() for job in (high, low)]
        # Out of the line again (canceled): the sums follow.
        assert api.delete(f"/v1/jobs/{high['id']}").status_code == 200
        after = post_job(api, width=64, height=64, steps=4, priority="low").get_json()
    assert etas[:25] == pytest.approx([index * small for index in range(25)])
    assert etas[25:] == pytest.approx([25 * small + index * large for index in range(12)])  # the exact sums
    assert high["eta_s"]["start"] == pytest.approx(0)  # first in line
    # The low job waits behind the high one and every normal one; GET says what admission said.
    assert low["eta_s"]["start"] == pytest.approx(small + 25 * small + 12 * large)
    assert [view["eta_s"]["start"] for view in queued] == pytest.approx([0, low["eta_s"]["start"]])
    assert after["eta_s"]["start"] == pytest.approx(25 * small + 12 * large + small)
    sums = redis.hgetall(f"{keys.line_key(settings.line)}:costs")
    assert {name.decode(): float(value) for name, value in sums.items()} == pytest.approx(
        {"high": 0, "normal": 25 * cost[64] + 12 * cost[128], "low": 2 * cost[64]})


def test_a_job_that_cannot_start_by_its_deadline_is_refused_at_once_and_leaves_nothing(
        settings: Settings, redis: Redis) -> None:
    from shared.contract import keys
    from tests.conftest import app_client

    redis.hset(keys.model_key(settings.line), mapping={"a": 1.0, "b": 0.0})  # every job: a second
    with contextmanager(app_client)(settings.model_copy(update={"queue_capacity": 1000})) as api:
        for _ in range(3):
            assert post_job(api, **SMALL).status_code == 202
        before = {key: redis.dump(key) for key in redis.scan_iter()}
        # Three seconds of jobs ahead: a 2.5 s start deadline cannot be met, and the refusal says
        # when it could be (the line half a second shorter, in whole seconds).
        refused = post_job(api, deadline_s=2.5, **SMALL)
        assert refused.status_code == 429
        assert refused.get_json()["error"]["code"] == "deadline_unmeetable"
        assert refused.headers["Retry-After"] == "1"
        assert {key: redis.dump(key) for key in redis.scan_iter()} == before
        # A deadline the line can keep is admitted, and so is a high job with nothing of its class ahead.
        assert post_job(api, deadline_s=3.5, **SMALL).status_code == 202
        assert post_job(api, deadline_s=0.5, priority="high", **SMALL).status_code == 202
        # Behind that high job and the four normal ones, a low job needs five seconds.
        assert post_job(api, deadline_s=4.9, priority="low", **SMALL).get_json()["error"]["code"] == \
            "deadline_unmeetable"
        assert post_job(api, deadline_s=5.1, priority="low", **SMALL).status_code == 202


def test_the_jobs_ahead_pay_an_executions_cost_once_per_batch(settings: Settings, redis: Redis) -> None:
    # Executions of four jobs each took a second, whatever their cost: the fit says a = 1 s an
    # execution, b = 0, and four jobs an execution. Four jobs ahead are one execution, not four.
    from shared.contract import keys
    from shared.store import estimates
    from tests.conftest import app_client

    for cost in (0.1, 0.2, 0.3, 0.4) * 3:
        estimates.job_done(redis, settings.line, "worker", "", 4 * cost, 1.0, jobs=4)
    fitted = redis.hgetall(keys.model_key(settings.line))
    model = {name.decode(): float(value) for name, value in fitted.items()}
    assert (model["a"], model["b"], model["k"]) == pytest.approx((1.0, 0.0, 4.0), abs=1e-6)
    with contextmanager(app_client)(settings) as api:
        etas = [post_job(api, width=64, height=64, steps=4).get_json()["eta_s"]["start"] for _ in range(5)]
    assert etas == pytest.approx([index / 4 for index in range(5)])
