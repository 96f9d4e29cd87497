"""Idempotent submit and deadlines, in-process against a real Redis (no worker)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flask.testing import FlaskClient
from redis import Redis
from redis.connection import Connection
from redis.exceptions import TimeoutError as RedisTimeoutError
from rq import Queue

from shared.contract import keys
from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings
from shared.store import admission, autopipeline, waiting
from shared.store.connection import connect, job_queue
from tests.conftest import (
    LosesOneReply,
    Process,
    http_post_job,
    post_job,
    wait_for,
    wait_for_status,
    waiting_ids,
)
from tests.store.test_autopipeline import gathered, in_threads, redis_paused


def post_keyed(client: FlaskClient, key: str, **body: Any) -> Any:
    return client.post("/v1/jobs", data=json.dumps({"prompt": "a red fox", **body}),
                       content_type="application/json", headers={"Idempotency-Key": key})


def test_same_key_and_body_returns_the_original_job(client: FlaskClient, redis: Redis,
                                                    settings: Settings) -> None:
    first = post_keyed(client, "order-17", steps=4)
    again = post_keyed(client, "order-17", steps=4)
    assert first.status_code == 202 and again.status_code == 200
    assert again.get_json()["id"] == first.get_json()["id"]
    assert again.get_json()["request"]["seed"] == first.get_json()["request"]["seed"]
    assert len(waiting_ids(redis, settings)) == 1
    assert len(redis.keys("rq:job:*")) == 1


def test_same_key_with_another_body_is_a_conflict(client: FlaskClient, redis: Redis) -> None:
    assert post_keyed(client, "k", steps=4).status_code == 202
    response = post_keyed(client, "k", steps=5)
    assert response.status_code == 409
    assert response.get_json()["error"]["code"] == "idempotency_conflict"
    assert len(redis.keys("rq:job:*")) == 1


def test_idempotent_replay_is_answered_even_when_the_queue_is_full(client: FlaskClient,
                                                                   settings: Settings) -> None:
    original = post_keyed(client, "early").get_json()["id"]
    for _ in range(settings.queue_capacity - 1):
        post_job(client)
    assert post_job(client).status_code == 429
    replay = post_keyed(client, "early")
    assert replay.status_code == 200 and replay.get_json()["id"] == original


def test_bad_idempotency_key_is_refused(client: FlaskClient) -> None:
    for key in ["x" * 256, "bad\x01key"]:
        response = post_keyed(client, key)
        assert response.status_code == 422
        assert response.get_json()["error"]["details"][0]["loc"] == ["header", "Idempotency-Key"]


def test_concurrent_retries_with_one_key_create_one_job(settings: Settings, redis: Redis,
                                                        start_api: Callable[..., Process]) -> None:
    api = start_api(settings)

    def post(_: int) -> tuple[int, str]:
        status, answer, _ = http_post_job(api.url, {"prompt": "once"},
                                          headers={"Idempotency-Key": "retry-storm"})
        return status, answer["id"]

    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(post, range(48)))
    assert Counter(status for status, _ in answers) == {202: 1, 200: 47}
    assert len({job_id for _, job_id in answers}) == 1
    assert len(waiting_ids(redis, settings)) == 1


def test_job_past_its_deadline_expires_and_frees_its_place(client: FlaskClient, settings: Settings,
                                                           redis: Redis) -> None:
    expiring = post_job(client, deadline_s=0.3).get_json()
    assert expiring["deadline_at"] is not None
    for _ in range(settings.queue_capacity - 1):
        assert post_job(client).status_code == 202
    assert post_job(client).status_code == 429
    # Once the deadline passes the place is free for the very next admission.
    wait_for(lambda: post_job(client).status_code == 202, what="the expired job's place")
    view = client.get(f"/v1/jobs/{expiring['id']}").get_json()
    assert view["status"] == "expired"
    assert view["started_at"] is None and view["position"] is None and view["finished_at"]
    assert expiring["id"] not in waiting_ids(redis, settings)
    assert client.delete(f"/v1/jobs/{expiring['id']}").status_code == 409


def test_expired_job_shows_expired_without_other_traffic(client: FlaskClient) -> None:
    job_id = post_job(client, deadline_s=0.2).get_json()["id"]
    view = wait_for_status(client, job_id, "expired", timeout=10)
    assert view["error"] is None
    assert client.get("/v1/queue").get_json()["waiting"] == 0


def lossy_queue(settings: Settings, connection_class: type[LosesOneReply] = LosesOneReply) -> Queue:
    """The API's queue (its client as ``connect`` makes it: one retry on a timeout), on connections
    that lose a reply when told to (``LosesOneReply.lose_at``)."""
    client = connect(settings)
    client.connection_pool.connection_class = connection_class
    return job_queue(client, settings)


def test_an_admission_whose_reply_is_lost_goes_in_line_once(settings: Settings, redis: Redis) -> None:
    # redis-py sends a command again when a timeout lost its reply: the script ran the first time.
    queue = lossy_queue(settings)
    first = admission.enqueue_job(queue, settings, JobRequest(prompt="loads the script"))
    LosesOneReply.lose_at = 1
    again = admission.enqueue_job(queue, settings, JobRequest(prompt="its reply is lost"))
    assert LosesOneReply.lose_at == 0  # the reply was lost, and the call sent again
    assert not again.replayed and again.position == 1 and again.record is not None
    assert waiting_ids(redis, settings) == [first.job_id, again.job_id]  # each once, in RQ's lists too
    assert sum(waiting.waiting_counts(queue, settings, settings.line).values()) == 2
    assert len(redis.xrange(keys.log_key(again.job_id))) == 1  # one "queued" event
    queue.connection.close()


def test_an_admission_resent_after_its_job_left_the_line_answers_where_it_stands(
        settings: Settings, redis: Redis) -> None:
    # Taken by a worker between the first run and the second: the job is not put in line again.
    job_id = ""

    class TakenMeanwhile(LosesOneReply):
        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            if LosesOneReply.lose_at == 1:  # the admission's reply: take the job before it is resent
                nonlocal job_id
                response = Connection.read_response(self, *args, **kwargs)
                job_id = waiting_ids(redis, settings)[-1]
                for _ in range(2):  # the first job, then this one
                    waiting.claim(redis, settings.line, "slotq:claims:test-worker")
                LosesOneReply.lose_at = 0
                raise RedisTimeoutError(f"the test lost the reply {response!r}")
            return super().read_response(*args, **kwargs)

    queue = lossy_queue(settings, TakenMeanwhile)
    admission.enqueue_job(queue, settings, JobRequest(prompt="loads the script"))
    LosesOneReply.lose_at = 1
    again = admission.enqueue_job(queue, settings, JobRequest(prompt="taken meanwhile"))
    assert again.job_id == job_id and not again.replayed and again.position is None
    assert again.prior is not None and again.prior.id == job_id
    assert job_id not in waiting_ids(redis, settings)
    queue.connection.close()


def test_admissions_sent_together_whose_replies_are_lost_go_in_line_once(settings: Settings,
                                                                          redis: Redis) -> None:
    # Admissions made at once share a round trip (shared/store/autopipeline.py); redis-py sends the
    # whole pipeline again when a timeout lost one of its replies.
    queue = lossy_queue(settings)
    pipeline = autopipeline.of(queue.connection)

    def submit(prompt: str) -> admission.Admission:
        return admission.enqueue_job(queue, settings, JobRequest(prompt=prompt))

    first = admission.enqueue_job(queue, settings, JobRequest(prompt="loads the script")).job_id
    trips = pipeline.round_trips
    with redis_paused(redis):
        threads, alone = in_threads([lambda: submit("alone")])
        wait_for(lambda: pipeline.round_trips == trips + 1, what="the first submit's round trip")
        more, together = in_threads([lambda: submit("together")] * 3)
        wait_for(gathered(pipeline, 3), what="three submits gathered")
        LosesOneReply.lose_at = 2  # the first submit's reply arrives; the next, the pipeline's first, is lost
    for thread in threads + more:
        thread.join(30)
    assert LosesOneReply.lose_at == 0 and pipeline.round_trips == trips + 2
    admitted = [alone[0], *together.values()]
    assert all(not isinstance(answer, Exception) and not answer.replayed for answer in admitted), admitted
    assert sorted(answer.position for answer in admitted) == [1, 2, 3, 4]
    assert waiting_ids(redis, settings) == [first, *(answer.job_id for answer in sorted(
        admitted, key=lambda answer: answer.position))]  # each once, in RQ's lists too
    queue.connection.close()
