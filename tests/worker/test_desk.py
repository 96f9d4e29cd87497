"""The job desk (worker/desk.py): claimed jobs restored under their fences, started, let go of, and
handed over only while the worker serves; in-process with the tiny model and a real Redis."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from flask.testing import FlaskClient
from redis import Redis

from shared.contract import keys
from shared.contract.settings import Settings
from shared.store.connection import job_queue
from shared.store.fencing import connect_worker
from tests.conftest import post_job
from worker.desk import Taken
from worker.main import SlotWorker
from worker.messages import Batch
from worker.pipeline import load_pipeline, set_current_pipeline


@pytest.fixture
def slot_worker(settings: Settings) -> Iterator[SlotWorker]:
    """A worker of the test queue in this process, its model loaded on the CPU, not serving."""
    set_current_pipeline(load_pipeline(settings.model_copy(update={"device": "cpu"})))
    worker = SlotWorker(job_queue(connect_worker(settings), settings), settings)
    try:
        yield worker
    finally:
        worker._claimer.shutdown()
        worker.connection.close()


def claimed(worker: SlotWorker, client: FlaskClient) -> Taken:
    """One job submitted, claimed by this worker and restored by its desk."""
    response = post_job(client, prompt="a desk", width=64, height=64, steps=2)
    assert response.status_code == 202, response.get_json()
    claim = worker.claims.claim(None)
    assert claim is not None and claim.job_id == response.get_json()["id"]
    return Taken([claim], worker.desk.fenced([claim]), claim.at, time.monotonic())


def test_the_desk_starts_a_claimed_job_under_its_claims_fence(
        slot_worker: SlotWorker, client: FlaskClient, redis: Redis) -> None:
    taken = claimed(slot_worker, client)
    [(job, fence)] = taken.startable
    assert redis.get(keys.fence_key(job.id)) == fence.token.encode()
    begun = slot_worker.desk.begin(taken, slot_worker.settings.line)
    [member] = begun.members
    assert member.job.id == job.id and member.fence == fence
    assert begun.running and begun.cost > 0 and begun.canceled == set()
    view = client.get(f"/v1/jobs/{job.id}").get_json()
    assert (view["status"], view["attempt"]) == ("running", 1)
    assert member.execution.id in slot_worker.executions
    slot_worker.desk.let_go(member)  # as at its hand-over: the finishing process cleans its run up
    assert member.execution.id not in slot_worker.executions


def test_a_job_taken_over_by_a_newer_attempt_is_dropped_unstarted(
        slot_worker: SlotWorker, client: FlaskClient, redis: Redis) -> None:
    taken = claimed(slot_worker, client)
    [(job, _)] = taken.startable
    redis.set(keys.fence_key(job.id), "a newer attempt's token")  # as after this worker was presumed dead
    begun = slot_worker.desk.begin(taken, slot_worker.settings.line)
    assert begun.members == [] and begun.running == ""
    view = client.get(f"/v1/jobs/{job.id}").get_json()
    assert (view["status"], view["attempt"]) == ("queued", 0)  # nothing written under the stale fence
    assert slot_worker.executions == {}


def test_a_claim_whose_record_expired_is_released_not_restored(
        slot_worker: SlotWorker, client: FlaskClient, redis: Redis) -> None:
    response = post_job(client, prompt="expires", width=64, height=64, steps=2)
    job_id = response.get_json()["id"]
    claim = slot_worker.claims.claim(None)
    assert claim is not None and claim.job_id == job_id
    assert slot_worker.desk.fenced([replace(claim, record={})]) == []  # the record expired meanwhile
    assert redis.llen(keys.claims_key(slot_worker.name)) == 0


def test_nothing_is_handed_over_before_the_worker_serves(slot_worker: SlotWorker) -> None:
    with pytest.raises(RuntimeError, match="not serving"):
        slot_worker.desk.hand_over([], Batch([], "", 0.0, 0.0, slot_worker.settings.line))
