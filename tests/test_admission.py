"""Idempotent submit and deadlines, in-process against a real Redis (no worker)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flask.testing import FlaskClient
from redis import Redis

from shared.contract.settings import Settings
from tests.conftest import Process, http_post_job, post_job, wait_for, wait_for_status, waiting_ids


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
