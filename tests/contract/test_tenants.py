"""API keys, tenants and cost-based token buckets, against a real Redis and real API processes."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient

from shared.contract.settings import Settings, load_settings
from tests.conftest import Process, app_client, http_post_job

KEYS = {"key-alice": "alice", "key-bob": {"tenant": "bob", "rate": 1, "burst": 10}}


@pytest.fixture
def keyed(settings: Settings) -> Iterator[FlaskClient]:
    """The API with two keys: alice unlimited, bob at 1 unit/s with a burst of 10."""
    yield from app_client(Settings(**(settings.model_dump() | {"api_keys": KEYS, "queue_capacity": 50})))


def submit(client: FlaskClient, key: str | None, **body: Any) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post("/v1/jobs", data=json.dumps({"prompt": "a red fox", **body}),
                       content_type="application/json", headers=headers)


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", "Basic key-alice", "key-alice", "Bearer "])
def test_without_a_valid_key_every_v1_call_is_401(keyed: FlaskClient, authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    for response in (keyed.post("/v1/jobs", data='{"prompt": "a"}', content_type="application/json",
                                headers=headers),
                     keyed.get("/v1/jobs/abc", headers=headers), keyed.get("/v1/queue", headers=headers),
                     # Nor does an unknown route or method tell a caller without a key what exists.
                     keyed.get("/v1/no-such-route", headers=headers), keyed.put("/v1/jobs", headers=headers)):
        assert response.status_code == 401
        assert response.get_json()["error"]["code"] == "unauthorized"
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert keyed.get("/healthz").status_code == 200 and keyed.get("/readyz").status_code == 200


def test_a_tenant_sees_only_its_own_jobs(keyed: FlaskClient) -> None:
    job_id = submit(keyed, "key-alice").get_json()["id"]
    own = {"Authorization": "Bearer key-alice"}
    other = {"Authorization": "Bearer key-bob"}
    assert keyed.get(f"/v1/jobs/{job_id}", headers=own).status_code == 200
    for response in (keyed.get(f"/v1/jobs/{job_id}", headers=other),
                     keyed.get(f"/v1/jobs/{job_id}/images/0", headers=other),
                     keyed.delete(f"/v1/jobs/{job_id}", headers=other)):
        assert response.status_code == 404  # exactly like an unknown id
        assert response.get_json()["error"]["code"] == "not_found"
    assert keyed.get(f"/v1/jobs/{job_id}", headers=own).get_json()["status"] == "queued"


def test_token_bucket_charges_by_cost_and_says_when_to_retry(keyed: FlaskClient) -> None:
    four_units = {"width": 512, "height": 512, "steps": 4}  # 4 steps of one 512x512 image
    assert [submit(keyed, "key-bob", **four_units).status_code for _ in range(2)] == [202, 202]
    refused = submit(keyed, "key-bob", **four_units)
    assert refused.status_code == 429
    assert refused.get_json()["error"]["code"] == "rate_limited"
    # 2 units left, 4 needed, 1 unit a second: about 2 s (less if a second passed meanwhile).
    assert int(refused.headers["Retry-After"]) in (1, 2)
    small = submit(keyed, "key-bob", width=256, height=256, steps=4)  # 1 unit: fits in what is left
    assert small.status_code == 202
    assert submit(keyed, "key-alice", **four_units).status_code == 202  # alice has no limit


def test_a_job_costing_more_than_the_burst_is_invalid(keyed: FlaskClient) -> None:
    response = submit(keyed, "key-bob", width=1024, height=1024, steps=4)  # 16 units > burst 10
    assert response.status_code == 422
    assert "burst" in response.get_json()["error"]["details"][0]["msg"]


def test_bucket_is_exact_across_api_processes(settings: Settings, start_api: Callable[..., Process]) -> None:
    keys = json.dumps({"secret-key-7": {"tenant": "t", "rate": 0.001, "burst": 20}})
    apis = [start_api(settings, api_keys=keys, queue_capacity=1000) for _ in range(2)]

    def post(index: int) -> int:
        body = {"prompt": "x", "width": 512, "height": 512, "steps": 4}
        return http_post_job(apis[index % 2].url, body, "secret-key-7")[0]

    with ThreadPoolExecutor(16) as pool:
        statuses = Counter(pool.map(post, range(40)))
    assert statuses == {202: 5, 429: 35}  # 20 units of burst, 4 a job
    assert all("secret-key-7" not in api.output() for api in apis)  # keys are never logged


def test_keys_can_come_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    monkeypatch.setenv("SLOTQ_API_KEYS_FILE", str(path))
    monkeypatch.setenv("SLOTQ_TENANT_RATE", "2")
    monkeypatch.setenv("SLOTQ_TENANT_BURST", "8")
    loaded = load_settings()
    assert loaded.api_keys is not None and loaded.api_keys["key-alice"] == "alice"
    path.write_text('{"k": {"tenant": "x", "typo": 1}}')
    with pytest.raises(SystemExit, match="SLOTQ_API_KEYS_FILE"):
        load_settings()


def test_per_tenant_cap_refuses_only_that_tenant(settings: Settings) -> None:
    keys = {"key-alice": "alice", "key-carol": {"tenant": "carol", "max_queued": 2}}
    capped = Settings(**(settings.model_dump() | {"api_keys": keys, "queue_capacity": 50,
                                                  "tenant_max_queued": 3}))
    clients = app_client(capped)
    client = next(clients)
    try:
        carol = [submit(client, "key-carol") for _ in range(3)]
        assert [r.status_code for r in carol] == [202, 202, 429]
        assert carol[2].get_json()["error"]["code"] == "tenant_queue_full"
        assert int(carol[2].headers["Retry-After"]) >= 1
        alice = [submit(client, "key-alice").status_code for _ in range(4)]
        assert alice == [202, 202, 202, 429]  # the service-wide SLOTQ_TENANT_MAX_QUEUED
        first = carol[0].get_json()["id"]
        client.delete(f"/v1/jobs/{first}", headers={"Authorization": "Bearer key-carol"})
        assert submit(client, "key-carol").status_code == 202  # its place is free again
    finally:
        clients.close()


def test_tenant_cap_is_exact_across_api_processes(settings: Settings,
                                                  start_api: Callable[..., Process]) -> None:
    keys = json.dumps({"key-dave": {"tenant": "dave", "max_queued": 5}, "key-erin": "erin"})
    apis = [start_api(settings, api_keys=keys, queue_capacity=100) for _ in range(2)]

    def post(index: int, key: str) -> int:
        return http_post_job(apis[index % 2].url, {"prompt": "x"}, key)[0]

    with ThreadPoolExecutor(16) as pool:
        dave = Counter(pool.map(post, range(30), ["key-dave"] * 30))
        erin = Counter(pool.map(post, range(30), ["key-erin"] * 30))
    assert dave == {202: 5, 429: 25} and erin == {202: 30}
