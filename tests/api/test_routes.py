"""api/routes.py and api/jobs.py: the HTTP contract, in-process, on a real Redis (no worker)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from flask.testing import FlaskClient
from redis import Redis

from shared.contract.settings import Settings
from tests.conftest import post_job, waiting_ids


def error_of(response: Any) -> dict[str, Any]:
    """The error envelope, checked for shape."""
    body = response.get_json()
    assert set(body) == {"error"}, body
    assert isinstance(body["error"]["code"], str) and body["error"]["message"]
    return body["error"]


def test_submit_answers_202_with_the_queued_view(client: FlaskClient, settings: Settings) -> None:
    response = post_job(client, width=256, height=128, steps=4, seed=7)
    assert response.status_code == 202
    view = response.get_json()
    assert response.headers["Location"] == f"/v1/jobs/{view['id']}"
    assert view["status"] == "queued" and view["position"] == 0
    assert view["model"] == "default" and view["worker"] is None  # the first model; no worker yet
    assert view["request"] == {"prompt": "a red fox", "model": "default", "negative_prompt": None,
                               "width": 256, "height": 128, "steps": 4, "guidance_scale": 7.5, "seed": 7,
                               "num_images": 1, "frames": None, "fps": None, "scheduler": None,
                               "image": None, "mask": None,
                               "strength": 0.8, "loras": [], "controlnets": [], "ip_adapter": None,
                               "hires": None, "previews": False, "prompt_syntax": "plain", "speed": "normal",
                               "deadline_s": None, "priority": "normal", "webhook": None,
                               "webhook_events": ["completed"]}
    assert view["progress"] is None and view["error"] is None and view["images"] == []
    assert view["video"] is None
    assert view["created_at"].endswith("Z") or view["created_at"].endswith("+00:00")


def test_missing_seed_is_drawn_and_recorded(client: FlaskClient) -> None:
    view = post_job(client).get_json()
    seed = view["request"]["seed"]
    assert isinstance(seed, int) and 0 <= seed < 2**32
    assert client.get(f"/v1/jobs/{view['id']}").get_json()["request"]["seed"] == seed


def test_positions_count_the_jobs_ahead(client: FlaskClient) -> None:
    ids = [post_job(client).get_json()["id"] for _ in range(3)]
    assert [client.get(f"/v1/jobs/{i}").get_json()["position"] for i in ids] == [0, 1, 2]


def test_full_queue_refuses_with_429_and_retry_after(client: FlaskClient, settings: Settings,
                                                    redis: Redis) -> None:
    for _ in range(settings.queue_capacity):
        assert post_job(client).status_code == 202
    response = post_job(client)
    assert response.status_code == 429
    assert error_of(response)["code"] == "queue_full"
    assert int(response.headers["Retry-After"]) >= 1
    assert len(waiting_ids(redis, settings)) == settings.queue_capacity


def test_refused_job_leaves_nothing_behind(client: FlaskClient, settings: Settings, redis: Redis) -> None:
    for _ in range(settings.queue_capacity + 3):
        post_job(client)
    assert len(redis.keys("rq:job:*")) == settings.queue_capacity


@pytest.mark.parametrize(
    ("body", "loc"),
    [
        ({"prompt": ""}, ["prompt"]),
        ({"prompt": "x" * 2001}, ["prompt"]),
        ({"prompt": "a", "width": 100}, ["width"]),
        ({"prompt": "a", "height": 1032}, ["height"]),
        ({"prompt": "a", "width": 56}, ["width"]),
        ({"prompt": "a", "steps": 0}, ["steps"]),
        ({"prompt": "a", "steps": 101}, ["steps"]),
        ({"prompt": "a", "steps": "4"}, ["steps"]),
        ({"prompt": "a", "steps": True}, ["steps"]),
        ({"prompt": "a", "width": "496"}, ["width"]),
        ({"prompt": "a", "width": True}, ["width"]),
        ({"prompt": "a", "width": 496.5}, ["width"]),
        ({"prompt": "a", "seed": 7.5}, ["seed"]),
        ({"prompt": "a", "num_images": 1e300}, ["num_images"]),
        ({"prompt": "a", "guidance_scale": 30.5}, ["guidance_scale"]),
        ({"prompt": "a", "seed": -1}, ["seed"]),
        ({"prompt": "a", "seed": 2**32}, ["seed"]),
        ({"prompt": "a", "num_images": 5}, ["num_images"]),
        ({"prompt": "a", "sampler": "euler"}, ["sampler"]),
        ({"prompt": "a", "scheduler": "lms"}, ["scheduler"]),
        ({"prompt": "a", "scheduler": "EULER"}, ["scheduler"]),
        ({"prompt": "a", "scheduler": 1}, ["scheduler"]),
        ({"width": 512}, ["prompt"]),
        ([1, 2], []),
    ],
)
def test_invalid_requests_get_422_with_details(client: FlaskClient, redis: Redis, body: Any,
                                               loc: list[str]) -> None:
    response = client.post("/v1/jobs", data=json.dumps(body), content_type="application/json")
    assert response.status_code == 422
    error = error_of(response)
    assert error["code"] == "invalid_request"
    assert [d["loc"] for d in error["details"]] == [loc]
    assert all(d["msg"] for d in error["details"])
    assert redis.keys("rq:job:*") == []


def test_nan_guidance_is_refused(client: FlaskClient) -> None:
    """NaN is no JSON number: the body is refused as not JSON, saying why (api/bodies.py)."""
    response = client.post("/v1/jobs", data='{"prompt": "a", "guidance_scale": NaN}',
                           content_type="application/json")
    assert response.status_code == 400
    assert error_of(response)["code"] == "invalid_json" and "NaN" in error_of(response)["message"]


@pytest.mark.parametrize("body", ["{not json", "", '{"prompt": "a"', "[" * 100_00])
def test_body_that_is_not_json_gets_400(client: FlaskClient, body: str) -> None:
    response = client.post("/v1/jobs", data=body, content_type="application/json")
    assert response.status_code == 400
    assert error_of(response)["code"] == "invalid_json"


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_body_that_is_not_declared_json_gets_415(client: FlaskClient, content_type: str | None) -> None:
    response = client.post("/v1/jobs", data='{"prompt": "a"}', content_type=content_type)
    assert response.status_code == 415
    assert error_of(response)["code"] == "unsupported_media_type"


def test_oversized_body_gets_413(client: FlaskClient, settings: Settings, redis: Redis) -> None:
    body = json.dumps({"prompt": "a", "negative_prompt": "x" * settings.max_body_bytes})
    response = client.post("/v1/jobs", data=body, content_type="application/json")
    assert response.status_code == 413
    assert error_of(response)["code"] == "payload_too_large"
    assert redis.keys("rq:job:*") == []


def test_largest_valid_request_fits_the_body_limit(client: FlaskClient) -> None:
    # 2000 astral characters each way, JSON-escaped as surrogate pairs: the worst legal body.
    wide = "\U0001f98a" * 2000
    body = json.dumps({"prompt": wide, "negative_prompt": wide, "width": 1024, "height": 1024,
                       "steps": 100, "guidance_scale": 30.0, "seed": 2**32 - 1, "num_images": 4})
    response = client.post("/v1/jobs", data=body, content_type="application/json")
    assert response.status_code == 202, response.get_json()


@pytest.mark.parametrize("path", ["/v1/jobs/nope", "/v1/jobs/0" * 40, "/v1/jobs/x/images/0",
                                  "/v1/jobs/a%20b", "/v2/anything"])
def test_unknown_ids_and_routes_get_404(client: FlaskClient, path: str) -> None:
    response = client.get(path)
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


def test_unknown_image_index_gets_404(client: FlaskClient) -> None:
    job_id = post_job(client).get_json()["id"]
    response = client.get(f"/v1/jobs/{job_id}/images/abc")
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


def test_wrong_method_gets_405(client: FlaskClient) -> None:
    response = client.put("/v1/jobs")
    assert response.status_code == 405
    assert error_of(response)["code"] == "method_not_allowed"


@pytest.mark.parametrize(("method", "path", "allowed"), [
    ("PUT", "/v1/jobs", {"GET", "HEAD", "POST", "OPTIONS"}),
    ("PUT", "/v1/jobs/{id}", {"GET", "HEAD", "PATCH", "DELETE", "OPTIONS"}),
    ("POST", "/v1/jobs/{id}/images/0", {"GET", "HEAD", "OPTIONS"}),
    ("DELETE", "/v1/queue", {"GET", "HEAD", "OPTIONS"}),
])
def test_wrong_method_gets_405_with_allow(client: FlaskClient, method: str, path: str,
                                          allowed: set[str]) -> None:
    path = path.format(id=post_job(client).get_json()["id"])
    response = client.open(path, method=method)
    assert response.status_code == 405
    assert error_of(response)["code"] == "method_not_allowed"
    assert {name.strip() for name in response.headers["Allow"].split(",")} == allowed


@pytest.mark.parametrize("field", ["width", "height", "steps", "seed", "num_images"])
def test_integral_numbers_are_integers(client: FlaskClient, field: str) -> None:
    # JSON Schema's "integer", which the document uses, admits 496.0; so does the service.
    value = {"width": 496, "height": 160, "steps": 4, "seed": 7, "num_images": 2}[field]
    body = json.dumps({"prompt": "a", field: float(value)})
    assert f'"{field}": {value}.0' in body
    response = client.post("/v1/jobs", data=body, content_type="application/json")
    assert response.status_code == 202, response.get_json()
    echoed = response.get_json()["request"][field]
    assert echoed == value and isinstance(echoed, int)


def test_an_integral_number_and_its_integer_are_one_request(client: FlaskClient) -> None:
    headers = {"Idempotency-Key": "integral"}
    first = client.post("/v1/jobs", data='{"prompt": "a", "width": 496}', content_type="application/json",
                        headers=headers)
    again = client.post("/v1/jobs", data='{"prompt": "a", "width": 4.96e2}', content_type="application/json",
                        headers=headers)
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.get_json()["id"] == first.get_json()["id"]


def test_image_of_a_queued_job_is_not_ready(client: FlaskClient) -> None:
    job_id = post_job(client).get_json()["id"]
    response = client.get(f"/v1/jobs/{job_id}/images/0")
    assert response.status_code == 409
    assert error_of(response)["code"] == "not_ready"


def test_cancel_of_a_queued_job_removes_it(client: FlaskClient, settings: Settings, redis: Redis) -> None:
    first, second = (post_job(client).get_json()["id"] for _ in range(2))
    response = client.delete(f"/v1/jobs/{first}")
    assert response.status_code == 200
    view = response.get_json()
    assert view["status"] == "canceled" and view["position"] is None and view["finished_at"]
    assert waiting_ids(redis, settings) == [second]
    assert client.get(f"/v1/jobs/{second}").get_json()["position"] == 0
    again = client.delete(f"/v1/jobs/{first}")
    assert again.status_code == 409
    assert error_of(again)["code"] == "already_finished"


def test_cancel_keeps_the_record(client: FlaskClient) -> None:
    # DELETE is the documented cancel: the job stays readable, canceled, until its record expires.
    job_id = post_job(client).get_json()["id"]
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
    response = client.get(f"/v1/jobs/{job_id}")
    assert response.status_code == 200
    assert response.get_json()["status"] == "canceled"


def test_canceled_job_frees_its_place(client: FlaskClient, settings: Settings) -> None:
    ids = [post_job(client).get_json()["id"] for _ in range(settings.queue_capacity)]
    assert post_job(client).status_code == 429
    client.delete(f"/v1/jobs/{ids[2]}")
    assert post_job(client).status_code == 202


def test_cancel_of_unknown_job_gets_404(client: FlaskClient) -> None:
    response = client.delete("/v1/jobs/does-not-exist")
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


def test_health_and_readiness(client: FlaskClient) -> None:
    assert client.get("/healthz").get_json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200


def test_queue_state_reports_waiting_and_capacity(client: FlaskClient, settings: Settings) -> None:
    post_job(client)
    line = {"waiting": 1, "capacity": 5, "by_priority": {"high": 0, "normal": 1, "low": 0},
            "limits": {"high": 6, "normal": 5, "low": 3}}
    assert client.get("/v1/queue").get_json() == {**line, "models": {"default": {**line, "paused": False}}}


def test_a_job_past_the_default_limits_shows_with_the_limits_it_was_admitted_under(
        settings: Settings) -> None:
    # A job's view reads its stored request back: never against the defaults (100 steps, 1024 px).
    from contextlib import contextmanager

    from tests.conftest import app_client

    roomy = settings.model_copy(update={"max_steps": 1000, "max_side": 2048})
    with contextmanager(app_client)(roomy) as api:
        admitted = api.post("/v1/jobs", json={"prompt": "long", "width": 2048, "height": 64, "steps": 150})
        assert admitted.status_code == 202, admitted.get_json()
        view = api.get(f"/v1/jobs/{admitted.get_json()['id']}")
        assert view.status_code == 200 and view.get_json()["request"]["steps"] == 150
