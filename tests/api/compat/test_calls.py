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


def test_every_route_of_both_surfaces_is_documented_under_its_tag(settings: Settings) -> None:
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
    app.extensions["slotq.queue"].connection.close()
