"""api/admin.py and the line operations under it: admin keys apart from tenants' keys, a paused line
that admits and starts nothing, a job moved to the front of its class; against a real Redis."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from pydantic import SecretStr
from redis import Redis
from rq.job import Job

from shared.contract import keys
from shared.contract.settings import Settings
from shared.store import waiting
from tests.conftest import Process, app_client, post_job, start_worker, wait_for, wait_for_status

KEYS = {"key-alice": "alice", "key-bob": "bob",
        "key-carol": {"tenant": "carol", "priorities": ["low", "normal"]}}
ADMIN, ALICE, BOB, CAROL = ({"Authorization": f"Bearer {key}"}
                             for key in ("admin-key", "key-alice", "key-bob", "key-carol"))
CLAIMS = "slotq:claims:admin-tests"


@pytest.fixture
def admin_settings(settings: Settings) -> Settings:
    return Settings(**(settings.model_dump() | {"api_keys": KEYS, "admin_keys": ["admin-key"],
                                                 "queue_capacity": 50}))


@pytest.fixture
def api(admin_settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(admin_settings)


def submit(client: FlaskClient, headers: dict[str, str], **body: Any) -> dict[str, Any]:
    response = client.post("/v1/jobs", data=json.dumps({"prompt": "a red fox", **body}),
                           content_type="application/json", headers=headers)
    assert response.status_code == 202, response.get_json()
    return dict(response.get_json())


def line(settings: Settings) -> str:
    return keys.line_name(settings.queue_name, settings.default_model)


def claimed_ids(redis: Redis, settings: Settings, count: int) -> list[str | None]:
    """What a worker's claims take from the default line, one claim at a time."""
    taken = [waiting.claim(redis, line(settings), CLAIMS) for _ in range(count)]
    return [each.job_id if each else None for each in taken]


@pytest.mark.parametrize(("headers", "status", "code"), [
    ({}, 401, "unauthorized"),
    ({"Authorization": "Bearer nobody's"}, 401, "unauthorized"),
    (ALICE, 403, "not_admin"),  # a tenant's key is no admin key
])
def test_the_admin_routes_take_only_an_admin_key(api: FlaskClient, headers: dict[str, str], status: int,
                                                 code: str) -> None:
    job_id = submit(api, ALICE)["id"]
    for response in (api.get("/v1/admin/lines", headers=headers), api.get("/v1/admin/jobs", headers=headers),
                     api.post("/v1/admin/lines/default/pause", headers=headers),
                     api.post(f"/v1/admin/jobs/{job_id}/front", headers=headers)):
        assert response.status_code == status and response.get_json()["error"]["code"] == code
    assert api.get("/v1/admin/lines", headers=ADMIN).get_json()["lines"][0]["paused"] is False
    # Nor is an admin key a tenant's: it reads no tenant's job.
    assert api.get(f"/v1/jobs/{job_id}", headers=ADMIN).status_code == 401


def test_without_admin_keys_the_routes_are_off(settings: Settings) -> None:
    for client in app_client(Settings(**(settings.model_dump() | {"api_keys": KEYS}))):
        response = client.get("/v1/admin/lines", headers=ALICE)
        assert response.status_code == 403 and response.get_json()["error"]["code"] == "admin_disabled"


def test_an_admin_key_cannot_be_a_tenants_too(settings: Settings) -> None:
    with pytest.raises(ValueError, match="must not also be a tenant's key"):
        Settings(**(settings.model_dump() | {"api_keys": KEYS, "admin_keys": ["key-alice"]}))


def test_a_paused_line_admits_starts_nothing_and_resumes_in_order(api: FlaskClient, redis: Redis,
                                                                  admin_settings: Settings) -> None:
    first = submit(api, ALICE)["id"]
    paused = api.post("/v1/admin/lines/default/pause", headers=ADMIN)
    assert paused.status_code == 200 and paused.get_json() == {
        "model": "default", "paused": True, "waiting": {"high": 0, "normal": 1, "low": 0}}
    admitted = submit(api, BOB, priority="high")
    assert admitted["line_paused"] is True and admitted["position"] == 0
    assert api.get(f"/v1/jobs/{first}", headers=ALICE).get_json()["line_paused"] is True
    assert api.get("/v1/queue", headers=ALICE).get_json()["models"]["default"]["paused"] is True
    assert claimed_ids(redis, admin_settings, 1) == [None]  # no worker takes from it
    # A loop of a job like these would take both as joiners; from a paused line it takes none.
    like = waiting.Claimed("running", redis.hgetall(Job.key_for(first)), 0.0, line=line(admin_settings))
    assert waiting.claim_compatible(redis, line(admin_settings), CLAIMS, like, 4, 8, by="join") == []
    assert waiting.waited_above(redis, line(admin_settings), "low") is None  # nothing to preempt for
    assert not redis.exists(f"{keys.line_key(line(admin_settings))}:doorbell")  # its workers wait quietly
    assert api.get("/v1/admin/lines", headers=ADMIN).get_json()["lines"] == [
        {"model": "default", "paused": True, "waiting": {"high": 1, "normal": 1, "low": 0}}]

    resumed = api.post("/v1/admin/lines/default/resume", headers=ADMIN).get_json()
    assert resumed["paused"] is False and redis.llen(f"{keys.line_key(line(admin_settings))}:doorbell") == 2
    assert api.get(f"/v1/jobs/{first}", headers=ALICE).get_json()["line_paused"] is False
    assert api.get("/v1/queue", headers=ALICE).get_json()["models"]["default"]["paused"] is False
    assert claimed_ids(redis, admin_settings, 3) == [admitted["id"], first, None]  # by class, then order


def test_a_job_moved_to_the_front_is_claimed_next_in_its_class(api: FlaskClient, redis: Redis,
                                                               admin_settings: Settings) -> None:
    alices = [submit(api, ALICE)["id"] for _ in range(3)]
    bobs = [submit(api, BOB)["id"] for _ in range(2)]
    high = submit(api, ALICE, priority="high")["id"]
    moved = api.post(f"/v1/admin/jobs/{bobs[-1]}/front", headers=ADMIN)
    # First of its class, after the class above: behind the high job only.
    assert moved.status_code == 200 and moved.get_json()["position"] == 1
    assert Job.fetch(bobs[-1], connection=redis).get_status() == "queued"
    # Bob's own list has it at its head, so that his turn in the fair share is this job.
    assert redis.lindex(f"rq:queue:{line(admin_settings)}:normal:bob", 0).decode() == bobs[-1]
    order = claimed_ids(redis, admin_settings, 7)
    assert order[:2] == [high, bobs[-1]] and order[-1] is None
    assert sorted(order[2:6]) == sorted([*alices, bobs[0]])  # the others as fair share takes them
    # A job that no longer waits cannot move; another tenant's job is no secret to an operator.
    refused = api.post(f"/v1/admin/jobs/{high}/front", headers=ADMIN)
    assert refused.status_code == 409 and refused.get_json()["error"]["code"] == "not_waiting"
    assert api.post("/v1/admin/jobs/no-such-job/front", headers=ADMIN).status_code == 404


def test_an_operator_sees_every_tenants_waiting_jobs_in_the_order_workers_take_them(
        api: FlaskClient, redis: Redis, admin_settings: Settings) -> None:
    alice = submit(api, ALICE)["id"]
    bob = submit(api, BOB)["id"]
    high = submit(api, BOB, priority="high")["id"]
    (line,) = api.get("/v1/admin/jobs", headers=ADMIN).get_json()["lines"]
    assert line["model"] == "default" and line["running"] == [] and line["waiting_count"] == 3
    listed = [(view["id"], view["tenant"], view["position"]) for view in line["waiting"]]
    # The high one first; alice's and bob's share a start tag (each its tenant's first), in either order.
    tenants = {high: "bob", alice: "alice", bob: "bob"}
    assert listed[0][0] == high and {each[0] for each in listed[1:]} == {alice, bob}
    assert [(tenants[job_id], place) for job_id, _, place in listed] == [each[1:] for each in listed]
    assert [place for _, _, place in listed] == [0, 1, 2]
    assert claimed_ids(redis, admin_settings, 3) == [each[0] for each in listed]  # as the listing said
    (first,) = api.get("/v1/admin/jobs?limit=1", headers=ADMIN).get_json()["lines"]
    assert first["waiting"] == [] and first["waiting_count"] == 0
    refused = api.get("/v1/admin/jobs?limit=0", headers=ADMIN)
    assert refused.status_code == 422 and refused.get_json()["error"]["code"] == "invalid_request"


def patch(client: FlaskClient, path: str, headers: dict[str, str], body: Any) -> Any:
    return client.patch(path, data=json.dumps(body), content_type="application/json", headers=headers)


def test_a_tenant_moves_its_own_waiting_job_to_a_class_its_key_may_use(api: FlaskClient, redis: Redis,
                                                                        admin_settings: Settings) -> None:
    first, second = submit(api, ALICE)["id"], submit(api, ALICE)["id"]
    carols = submit(api, CAROL)["id"]
    moved = patch(api, f"/v1/jobs/{second}", ALICE, {"priority": "high"})
    assert moved.status_code == 200, moved.get_json()
    view = moved.get_json()
    assert (view["position"], view["request"]["priority"]) == (0, "high")
    assert api.get("/v1/queue", headers=ALICE).get_json()["by_priority"] == {"high": 1, "normal": 2, "low": 0}
    # Refused, each changing nothing: a class the key may not use, another's job, a bad body.
    path = f"/v1/jobs/{first}"
    for response, status, code in (
            (patch(api, f"/v1/jobs/{carols}", CAROL, {"priority": "high"}), 403, "priority_not_allowed"),
            (patch(api, path, BOB, {"priority": "high"}), 404, "not_found"),
            (patch(api, path, ALICE, {"priority": "urgent"}), 422, "invalid_request"),
            (patch(api, path, ALICE, {"priority": "high", "model": "x"}), 422, "invalid_request"),
            (api.patch(path, data="priority=high", headers=ALICE), 415, "unsupported_media_type")):
        assert (response.status_code, response.get_json()["error"]["code"]) == (status, code)
    assert claimed_ids(redis, admin_settings, 3)[0] == second
    # A job that no longer waits keeps its class.
    taken = patch(api, f"/v1/jobs/{second}", ALICE, {"priority": "low"})
    assert taken.status_code == 409 and taken.get_json()["error"]["code"] == "not_waiting"
    assert api.get(f"/v1/jobs/{second}", headers=ALICE).get_json()["request"]["priority"] == "high"


def test_an_operator_changes_any_tenants_job_within_that_tenants_classes(api: FlaskClient) -> None:
    carols = submit(api, CAROL, priority="low")["id"]
    refused = patch(api, f"/v1/admin/jobs/{carols}", ADMIN, {"priority": "high"})
    assert refused.status_code == 403 and refused.get_json()["error"]["code"] == "priority_not_allowed"
    moved = patch(api, f"/v1/admin/jobs/{carols}", ADMIN, {"priority": "normal"})
    assert moved.status_code == 200 and moved.get_json()["request"]["priority"] == "normal"
    assert api.get(f"/v1/jobs/{carols}", headers=CAROL).get_json()["request"]["priority"] == "normal"
    assert patch(api, f"/v1/admin/jobs/{carols}", ALICE, {"priority": "low"}).status_code == 403


def test_an_unknown_model_has_no_line_to_pause(api: FlaskClient) -> None:
    response = api.post("/v1/admin/lines/nope/pause", headers=ADMIN)
    assert response.status_code == 422 and response.get_json()["error"]["code"] == "unknown_model"


def test_each_action_is_counted(api: FlaskClient) -> None:
    api.post("/v1/admin/lines/default/pause", headers=ADMIN)
    api.post("/v1/admin/lines/default/resume", headers=ADMIN)
    metrics = api.get("/metrics").get_data(as_text=True)
    assert 'slotq_admin_actions_total{action="pause",model="default"} 1.0' in metrics
    assert 'slotq_admin_actions_total{action="resume",model="default"} 1.0' in metrics


def test_a_worker_starts_nothing_from_a_paused_line_and_all_of_it_in_order_on_resume(
        worker: Process, worker_settings: Settings) -> None:
    operated = worker_settings.model_copy(update={"admin_keys": [SecretStr("admin-key")]})
    model = worker_settings.default_model
    for client in app_client(operated):
        try:
            assert client.post(f"/v1/admin/lines/{model}/pause", headers=ADMIN).status_code == 200
            # Of three sizes: none batches or joins another, so each start is a claim of its own.
            ids = [post_job(client, width=side, height=side, steps=2).get_json()["id"]
                   for side in (64, 72, 80)]
            time.sleep(1.5)  # an idle worker claims within milliseconds of an admission
            assert [client.get(f"/v1/jobs/{job_id}").get_json()["status"] for job_id in ids] == ["queued"] * 3
        finally:
            client.post(f"/v1/admin/lines/{model}/resume", headers=ADMIN)
        views = [wait_for_status(client, job_id, "succeeded") for job_id in ids]
        assert [view["id"] for view in sorted(views, key=lambda view: view["started_at"])] == ids


def test_a_drained_worker_finishes_its_job_exits_0_and_leaves_the_line_whole(admin_settings: Settings,
                                                                             tmp_path: Path) -> None:
    def view(job_id: str) -> dict[str, Any]:
        return dict(client.get(f"/v1/jobs/{job_id}", headers=ALICE).get_json())

    worker = start_worker(admin_settings, tmp_path / "worker.log", worker_name="drained")
    try:
        for client in app_client(admin_settings):
            running = submit(client, ALICE, width=512, height=512, steps=12)["id"]
            # Of another size: neither batches with the running job nor joins it.
            waiting_ids = [submit(client, ALICE, width=64, height=64, steps=1)["id"] for _ in range(2)]
            wait_for(lambda job=running: view(job)["status"] == "running", what="the first job to run")
            (listed,) = client.get("/v1/admin/jobs", headers=ADMIN).get_json()["lines"]
            assert [(each["id"], each["tenant"]) for each in listed["running"]] == [(running, "alice")]
            assert [each["id"] for each in listed["waiting"]] == waiting_ids
            drained = client.post("/v1/admin/workers/drained/drain", headers=ADMIN)
            assert drained.get_json() == {"worker": "drained", "draining": True, "exit": True}
            assert worker.popen.wait(60) == 0
            assert view(running)["status"] == "succeeded"
            views = [view(job_id) for job_id in waiting_ids]
            assert [(each["status"], each["position"]) for each in views] == [("queued", 0), ("queued", 1)]
            assert "drain requested by an operator" in worker.output()
            gone = client.post("/v1/admin/workers/drained/drain", headers=ADMIN)
            assert gone.status_code == 404 and gone.get_json()["error"]["code"] == "not_found"
    finally:
        worker.stop()
