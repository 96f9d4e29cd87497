"""Claiming ahead (SLOTQ_CLAIM_AHEAD): the next execution's jobs are claimed while the current one
decodes, in-process with the tiny model and a real Redis."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from flask.testing import FlaskClient
from redis import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from rq.job import Job
from rq.serializers import JSONSerializer

from shared.contract import keys
from shared.contract.settings import Settings
from shared.store.connection import job_queue
from shared.store.fencing import connect_worker
from tests.conftest import ONE_AT_A_TIME, post_job, waiting_ids
from worker import lifecycle, tasks
from worker.main import Mode, SlotWorker, claims_ahead
from worker.pipeline import current_pipeline, load_pipeline, set_current_pipeline


@contextmanager
def worker_claiming(settings: Settings, claim_ahead: bool | str) -> Iterator[SlotWorker]:
    """A worker of the test queue in this process, its model loaded on the CPU, not serving."""
    on = settings.model_copy(update={"claim_ahead": claim_ahead, **ONE_AT_A_TIME})
    set_current_pipeline(load_pipeline(on.model_copy(update={"device": "cpu"})))
    worker = SlotWorker(job_queue(connect_worker(on), on), on)
    try:
        yield worker
    finally:
        worker._claimer.shutdown()
        worker.connection.close()


@pytest.fixture(params=[True, "auto"], ids=["thread", "sent"])
def slot_worker(settings: Settings, request: pytest.FixtureRequest) -> Iterator[SlotWorker]:
    """A worker claiming ahead in each of the two ways (``auto`` sends the claim on the CPU; true
    claims on the claiming thread)."""
    with worker_claiming(settings, request.param) as worker:
        yield worker


@pytest.fixture
def sending_worker(settings: Settings) -> Iterator[SlotWorker]:
    """A worker as the default makes it on the CPU: it sends the claim at the last step."""
    assert Settings.model_fields["claim_ahead"].default == "auto"
    with worker_claiming(settings, "auto") as worker:
        yield worker


def submitted(client: FlaskClient, count: int, steps: int = 2) -> list[str]:
    ids = []
    for index in range(count):
        response = post_job(client, prompt=f"job {index}", width=64, height=64, steps=steps)
        assert response.status_code == 202, response.get_json()
        ids.append(response.get_json()["id"])
    return ids


def claimed_by(redis: Redis, settings: Settings, left: list[str], within_s: float = 5.0) -> None:
    """Wait until the claim made ahead has left these jobs waiting (a claim in flight ends soon)."""
    deadline = time.monotonic() + within_s
    while waiting_ids(redis, settings) != left and time.monotonic() < deadline:
        time.sleep(0.01)
    assert waiting_ids(redis, settings) == left


def test_the_claim_is_made_at_the_last_step_before_the_decoding(
        slot_worker: SlotWorker, client: FlaskClient, redis: Redis) -> None:
    [job_id] = submitted(client, 1, steps=3)
    job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    pipeline, seen = current_pipeline(), []
    # The pipeline counts its calls; the hook notes how many denoising steps each had reported.
    steps: list[int] = []
    original = pipeline.generate_batch

    def counting(requests, on_step=None, inputs=(), *rest):  # type: ignore[no-untyped-def]
        def step(index: int, total: int, latents: object = None) -> None:
            steps.append(index)
            assert on_step is not None
            on_step(index, total, latents)
        return original(requests, step, inputs, *rest)

    pipeline.generate_batch = counting  # type: ignore[method-assign]
    try:
        (outcome,) = tasks.render([job], announced=True, last_step=lambda: seen.append(list(steps)))
    finally:
        del pipeline.generate_batch
    assert not isinstance(outcome, Exception)
    assert seen == [[1, 2, 3]]  # once, after the last step (3 of 3), before the images came back


def test_a_claim_ahead_takes_the_next_jobs_with_their_fences(
        slot_worker: SlotWorker, client: FlaskClient, redis: Redis, settings: Settings) -> None:
    first, second = submitted(client, 2)
    slot_worker._claim_ahead()
    taken = slot_worker._taken_ahead()
    assert taken is not None and [job.id for job, _ in taken.startable] == [first]
    assert [claimed.job_id for claimed in taken.claims] == [first]
    assert redis.lrange(keys.claims_key(slot_worker.name), 0, -1) == [first.encode()]
    assert redis.get(keys.fence_key(first)) == taken.startable[0][1].token.encode()
    assert waiting_ids(redis, settings) == [second]
    assert slot_worker._taken_ahead() is None  # taken once


def test_without_claim_ahead_nothing_is_claimed_early(
        client: FlaskClient, redis: Redis, settings: Settings) -> None:
    with worker_claiming(settings, False) as worker:
        [job_id] = submitted(client, 1)
        worker._claim_ahead()
        assert worker._taken_ahead() is None
        assert waiting_ids(redis, settings) == [job_id]


@pytest.mark.parametrize(("setting", "device", "way"), [
    ("auto", "cuda", "thread"), ("auto", "cuda:1", "thread"), ("auto", "cpu", "sent"),
    ("auto", "mps", "sent"), (True, "cpu", "thread"), (False, "cuda", "off"), (False, "cpu", "off")])
def test_auto_claims_ahead_on_the_claiming_thread_on_a_gpu_only(setting: bool | str, device: str,
                                                                 way: str) -> None:
    assert claims_ahead(Settings(claim_ahead=setting), torch.device(device)) == way
    assert claims_ahead(Settings(claim_ahead=setting), device) == way  # as bench.gpu's null pipeline


def test_a_job_claimed_ahead_goes_back_to_the_head_of_the_line_when_the_worker_stops(
        slot_worker: SlotWorker, client: FlaskClient, redis: Redis, settings: Settings) -> None:
    first, second, third = submitted(client, 3)
    slot_worker._claim_ahead()
    claimed_by(redis, settings, [second, third])  # the claim is made
    slot_worker._put_back_ahead()  # as the worker stops
    assert waiting_ids(redis, settings) == [first, second, third]  # at the head, where it was
    assert redis.llen(keys.claims_key(slot_worker.name)) == 0
    assert redis.get(keys.fence_key(first)) is None  # that attempt is over before it began
    view = client.get(f"/v1/jobs/{first}").get_json()
    assert view["status"] == "queued" and view["attempt"] == 0  # not counted: it never started


def test_no_claim_is_made_ahead_once_the_worker_is_stopping(
        slot_worker: SlotWorker, client: FlaskClient, redis: Redis, settings: Settings) -> None:
    [job_id] = submitted(client, 1)
    lifecycle.stopping.set()
    try:
        slot_worker._claim_ahead()
        assert slot_worker._taken_ahead() is None
    finally:
        lifecycle.stopping.clear()
    assert waiting_ids(redis, settings) == [job_id]


def test_a_start_is_timed_from_the_claim_with_batchings_wait_in_it(
        client: FlaskClient, settings: Settings) -> None:
    """The start's Redis clock is the claim's plus the time since: the gather's wait counts."""
    gathering = settings.model_copy(update={"max_batch": 4, "batch_wait_ms": 300})
    set_current_pipeline(load_pipeline(gathering.model_copy(update={"device": "cpu"})))
    worker = SlotWorker(job_queue(connect_worker(gathering), gathering), gathering)
    try:
        submitted(client, 1)  # alone: the gather waits its whole 300 ms for a companion
        taken = worker._take(None)
        assert taken is not None and len(taken.claims) == 1
        assert taken.starts_at() - taken.at >= 0.3
    finally:
        worker._claimer.shutdown()
        worker.connection.close()


def test_a_failed_claim_ahead_does_not_stop_the_worker_from_stopping(
        slot_worker: SlotWorker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def failing(claimed: object, at: float) -> None:
        raise RuntimeError("the restore failed")

    monkeypatch.setattr(slot_worker, "_taken", failing)
    slot_worker._claim_ahead()
    slot_worker._put_back_ahead()  # as the worker stops: logged, not raised
    assert "could not claim ahead (the restore failed)" in caplog.text


def test_auto_on_the_cpu_sends_the_claim_at_the_last_step_and_reads_it_after(
        sending_worker: SlotWorker, client: FlaskClient, redis: Redis, settings: Settings) -> None:
    """Redis runs the claim while the main thread goes on (the decode), and no claiming thread
    starts; what it took is read, and restored, when the worker asks for it."""
    first, second = submitted(client, 2)
    sending_worker._claim_ahead()
    claimed_by(redis, settings, [second])  # claimed before its answer was read
    assert redis.lrange(keys.claims_key(sending_worker.name), 0, -1) == [first.encode()]
    assert not [thread for thread in threading.enumerate() if thread.name.startswith("claim-ahead")]
    taken = sending_worker._taken_ahead()
    assert taken is not None and [job.id for job, _ in taken.startable] == [first]
    assert redis.get(keys.fence_key(first)) == taken.startable[0][1].token.encode()
    assert sending_worker._taken_ahead() is None  # taken once


def test_a_sent_claim_that_redis_had_no_script_for_runs_again(
        sending_worker: SlotWorker, client: FlaskClient, redis: Redis, settings: Settings) -> None:
    """After a restart or a SCRIPT FLUSH, Redis answers NOSCRIPT and claims nothing: the claim is
    made again, loading the script, and nothing is claimed twice."""
    first, second = submitted(client, 2)
    redis.script_flush()
    sending_worker._claim_ahead()
    taken = sending_worker._taken_ahead()
    assert taken is not None and [job.id for job, _ in taken.startable] == [first]
    assert redis.lrange(keys.claims_key(sending_worker.name), 0, -1) == [first.encode()]
    assert waiting_ids(redis, settings) == [second]


def test_a_claim_that_cannot_be_sent_is_made_after_the_decode(
        sending_worker: SlotWorker, client: FlaskClient, redis: Redis, settings: Settings,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A Redis error while sending at the last step must not fail the job that is decoding."""
    [job_id] = submitted(client, 1)

    def unreachable(holding: object) -> None:
        raise RedisConnectionError("Redis went away")

    monkeypatch.setattr(sending_worker.claims, "send_claim", unreachable)
    sending_worker._claim_ahead()  # raises nothing
    assert "could not send the next claim (Redis went away)" in caplog.text
    assert sending_worker._taken_ahead() is None
    assert waiting_ids(redis, settings) == [job_id]
    monkeypatch.undo()
    taken = sending_worker._take(None)  # as the loop does next
    assert taken is not None and [job.id for job, _ in taken.startable] == [job_id]


def test_a_job_claimed_ahead_runs_after_redis_failed_before_its_start(
        slot_worker: SlotWorker, client: FlaskClient, redis: Redis, settings: Settings,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A failover between the claim made ahead and the execution's start (the worker's recovery
    meets the dead master first): the job is put back and runs, not held unrun for good."""
    [job_id] = submitted(client, 1)
    slot_worker._claim_ahead()  # as at the last step of an execution
    claimed_by(redis, settings, [])
    recover, failures = slot_worker.claims.recover, [RedisConnectionError("the master went away")]

    def failing_once() -> int | None:
        if failures:
            raise failures.pop()
        return recover()

    monkeypatch.setattr(slot_worker.claims, "recover", failing_once)
    assert slot_worker.serve(burst=True) == 0
    view = client.get(f"/v1/jobs/{job_id}").get_json()
    assert (view["status"], view["attempt"]) == ("succeeded", 1) and not failures
    assert redis.llen(keys.claims_key(slot_worker.name)) == 0


def test_no_claim_is_made_ahead_while_a_higher_class_preempts_a_loop(
        slot_worker: SlotWorker, client: FlaskClient, redis: Redis, settings: Settings) -> None:
    """What runs after a preempting execution is the paused loop's jobs, not the line's next ones."""
    [job_id] = submitted(client, 1)
    slot_worker.mode = Mode.PREEMPTING
    try:
        slot_worker._claim_ahead()
        assert slot_worker._taken_ahead() is None
    finally:
        slot_worker.mode = Mode.TAKING
    assert waiting_ids(redis, settings) == [job_id]
    slot_worker._claim_ahead()  # the same worker, back to taking from the line: it claims ahead
    taken = slot_worker._taken_ahead()
    assert taken is not None and [claimed.job_id for claimed in taken.claims] == [job_id]
