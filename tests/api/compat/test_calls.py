"""The synchronous call both surfaces make (api/compat/calls.py): a waiting slot taken before the
job is admitted, and a call that stops waiting names the job, which goes on."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
from flask.testing import FlaskClient
from redis import Redis

from shared.contract.settings import Settings
from tests.conftest import app_client, wait_for, waiting_ids

BODY = json.dumps({"prompt": "waits", "size": "64x64"})


@pytest.fixture
def one_slot(settings: Settings) -> Iterator[FlaskClient]:
    """An API process (no worker) whose calls wait 2 s, in one waiting slot (half of 2 threads)."""
    yield from app_client(settings.model_copy(update={"api_threads": 2, "sync_wait_s": 2.0}))


def generate(client: FlaskClient) -> tuple[int, dict]:
    answer = client.post("/v1/images/generations", data=BODY, content_type="application/json")
    return answer.status_code, answer.get_json()


def test_a_call_with_no_waiting_slot_free_is_refused_before_admission(one_slot: FlaskClient, redis: Redis,
                                                                      settings: Settings) -> None:
    first: list[tuple[int, dict]] = []
    holder = threading.Thread(target=lambda: first.append(generate(one_slot)))
    holder.start()
    wait_for(lambda: waiting_ids(redis, settings), what="the first call's job admitted")
    status, refused = generate(one_slot)
    assert status == 503 and refused["error"]["code"] == "too_many_waiting"
    [job_id] = waiting_ids(redis, settings)  # the refused call left no job behind
    holder.join(10)
    # The first call stopped waiting after SLOTQ_SYNC_WAIT_S; its job goes on, named in the error.
    [(status, stopped)] = first
    assert status == 504 and stopped["error"]["code"] == "sync_wait_exceeded"
    assert job_id in stopped["error"]["message"] and f"GET /v1/jobs/{job_id}" in stopped["error"]["message"]
    assert one_slot.get(f"/v1/jobs/{job_id}").get_json()["status"] == "queued"
    assert generate(one_slot)[0] == 504  # the slot is free again


@pytest.fixture
def two_slots_keyed(settings: Settings) -> Iterator[FlaskClient]:
    """An API process (no worker) with two tenants, whose calls wait 2 s, in two waiting slots (half
    of 4 threads): one each (SLOTQ_TENANT_WAIT_SHARE, one half)."""
    keys = {"sk-alice": "alice", "sk-bob": "bob"}
    update = {"api_threads": 4, "sync_wait_s": 2.0, "api_keys": keys}
    yield from app_client(settings.model_copy(update=update))


def generate_as(client: FlaskClient, key: str) -> tuple[int, dict]:
    answer = client.post("/v1/images/generations", data=BODY, content_type="application/json",
                         headers={"Authorization": f"Bearer {key}"})
    return answer.status_code, answer.get_json()


def test_a_tenant_over_its_share_of_the_waiting_slots_is_refused_and_the_others_wait(
        two_slots_keyed: FlaskClient, redis: Redis, settings: Settings) -> None:
    """Alice's second call is refused with 429 before admission, while bob's call is admitted and
    held in the slot she could not take."""
    client, answers = two_slots_keyed, []
    alice = threading.Thread(target=lambda: answers.append(generate_as(client, "sk-alice")))
    alice.start()
    wait_for(lambda: len(waiting_ids(redis, settings)) == 1, what="alice's first call admitted")
    status, refused = generate_as(client, "sk-alice")
    assert status == 429 and refused["error"]["code"] == "tenant_wait_share", refused
    assert len(waiting_ids(redis, settings)) == 1  # the refused call left no job behind
    status, answered = generate_as(client, "sk-bob")  # held until SLOTQ_SYNC_WAIT_S: no worker runs here
    assert status == 504 and answered["error"]["code"] == "sync_wait_exceeded", answered
    alice.join(10)
    assert [status for status, _ in answers] == [504]
    assert len(waiting_ids(redis, settings)) == 2


def test_every_route_of_both_surfaces_is_documented_under_its_tag(settings: Settings) -> None:
    from api import state
    from api.app import create_app
    from api.openapi import openapi_document

    app = create_app(settings)
    document = openapi_document(settings)
    routes = {(rule.rule, method.lower()) for rule in app.url_map.iter_rules()
              for method in rule.methods or () if method not in ("HEAD", "OPTIONS")
              and rule.rule.startswith(("/sdapi/v1/", "/v1/images/"))}
    tags = {"/sdapi": "AUTOMATIC1111", "/v1/im": "OpenAI Images"}
    documented = {(path, method) for path, item in document["paths"].items() for method in item
                  if path.startswith(("/sdapi/v1/", "/v1/images/"))}
    assert {("/v1/images/generations", "post"), ("/sdapi/v1/txt2img", "post")} <= routes
    assert routes - documented == set()
    for path, method in documented:
        assert (path, method) in routes, f"{method} {path} is documented but not served"
        assert document["paths"][path][method]["tags"] == [tags[path[:6]]]
    state.close(app)
