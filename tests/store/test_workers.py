"""GET /v1/workers against real workers, and the compose override that runs one worker per GPU."""

from __future__ import annotations

import signal
import socket
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from flask.testing import FlaskClient
from redis import Redis

from shared.contract import keys
from shared.contract.settings import Settings
from shared.store import waiting, workers
from shared.store.workers import WorkerIdentity
from tests.conftest import Process, app_client, post_job, start_worker, wait_for, wait_for_status

ROOT = Path(__file__).resolve().parents[2]
GPUS_FILE = ROOT / "docker-compose.gpus.yml"
LONG = {"width": 1024, "height": 1024, "steps": 60}  # the session worker's most steps: seconds on a CPU


def listed(client: FlaskClient, **headers: str) -> list[dict[str, Any]]:
    response = client.get("/v1/workers", headers=headers)
    assert response.status_code == 200, response.get_json()
    return response.get_json()["workers"]


def entry_of(client: FlaskClient, worker: Process) -> dict[str, Any] | None:
    """The entry of this worker process, if it is listed."""
    return next((entry for entry in listed(client) if entry["pid"] == worker.popen.pid), None)


def in_state(client: FlaskClient, worker: Process, state: str, job_id: str | None = None) -> dict | None:
    entry = entry_of(client, worker)
    if entry is None or entry["state"] != state:
        return None
    return entry if job_id is None or job_id in entry["current_jobs"] else None


# --- the session's real worker -----------------------------------------------------------------

def test_an_idle_worker_is_listed_with_its_device_host_and_pid(worker: Process, worker_client: FlaskClient,
                                                               worker_settings: Settings) -> None:
    entry = wait_for(lambda: in_state(worker_client, worker, "idle"), what="the worker to be listed idle")
    assert entry["device"] == "cpu" and entry["model"] == "default" and entry["checkpoint"] == "tiny"
    assert entry["host"] == socket.gethostname() and entry["pid"] == worker.popen.pid
    assert entry["queue"] == worker_settings.queue_name and entry["current_jobs"] == []
    beat_at = datetime.fromisoformat(entry["last_beat_at"]).timestamp()
    assert time.time() - worker_settings.heartbeat_ttl_s <= beat_at <= time.time() + 1
    with Redis.from_url(worker_settings.redis_url) as connection:  # the entry is the liveness key
        ttl_ms = connection.pttl(keys.alive_key(entry["name"]))
    assert 0 < ttl_ms <= worker_settings.heartbeat_ttl_s * 1000


def test_a_busy_worker_names_its_job_and_never_its_contents(worker: Process,
                                                            worker_client: FlaskClient) -> None:
    prompt = "a lighthouse nobody else should read about"
    job_id = post_job(worker_client, prompt=prompt, negative_prompt="fog", seed=7, **LONG).get_json()["id"]
    try:
        entry = wait_for(lambda: in_state(worker_client, worker, "busy", job_id),
                         what=f"the worker to be listed busy with {job_id}")
        assert entry["current_jobs"] == [job_id]
        text = worker_client.get("/v1/workers").get_data(as_text=True)
        assert "prompt" not in text and prompt not in text and "fog" not in text
    finally:
        if worker_client.delete(f"/v1/jobs/{job_id}").status_code in (200, 202):
            assert wait_for_status(worker_client, job_id, "canceled", "succeeded")["status"] == "canceled"
    wait_for(lambda: in_state(worker_client, worker, "idle"), what="the worker to be listed idle again")


@pytest.mark.slow
def test_a_killed_worker_is_dropped_once_its_heartbeat_expires(settings: Settings, client: FlaskClient,
                                                               tmp_path: Path) -> None:
    process = start_worker(settings, tmp_path / "worker.log", worker_name="doomed", worker_metrics_port=0)
    try:
        entry = wait_for(lambda: entry_of(client, process), what="the worker to be listed")
        assert entry["name"] == "doomed" and entry["state"] == "idle"
        process.popen.send_signal(signal.SIGKILL)  # no goodbye: only the expiry can tell
        process.popen.wait(10)
        killed_at = time.monotonic()
        wait_for(lambda: entry_of(client, process) is None, timeout=settings.heartbeat_ttl_s + 5,
                 what="the dead worker to leave the list")
        assert time.monotonic() - killed_at <= settings.heartbeat_ttl_s + 1
    finally:
        process.stop()


# --- records written directly, in-process ------------------------------------------------------

def identity(settings: Settings, name: str, **fields: Any) -> WorkerIdentity:
    return WorkerIdentity(**({"name": name, "queue": settings.queue_name, "host": "gpu-host-2", "pid": 4242,
                              "device": "cuda:1", "model": settings.model_name, "checkpoint": "tiny"}
                            | fields))


def test_only_fresh_records_of_this_queue_are_listed(client: FlaskClient, redis: Redis,
                                                     settings: Settings) -> None:
    workers.beat(redis, identity(settings, "gpu1"), ttl_s=60)
    workers.beat(redis, identity(settings, "gpu0", device="cuda:0"), ttl_s=60)
    workers.beat(redis, identity(settings, "elsewhere", queue="other-queue"), ttl_s=60)
    redis.sadd(keys.workers_key(settings.line), "elsewhere", "old-version")
    redis.set(keys.alive_key("old-version"), 1, px=60_000)  # what workers before this record wrote
    assert [(entry["name"], entry["device"]) for entry in listed(client)] == [("gpu0", "cuda:0"),
                                                                              ("gpu1", "cuda:1")]
    redis.pexpire(keys.alive_key("gpu0"), 1)
    wait_for(lambda: [entry["name"] for entry in listed(client)] == ["gpu1"], what="gpu0 to expire")


def test_state_and_jobs_come_from_the_claims_at_each_beat(client: FlaskClient, redis: Redis,
                                                          settings: Settings) -> None:
    gpu1 = identity(settings, "gpu1")
    workers.beat(redis, gpu1, ttl_s=60)
    redis.rpush(keys.claims_key("gpu1"), "job-a", "job-b")
    assert listed(client)[0]["state"] == "idle"  # until the next beat
    workers.beat(redis, gpu1, ttl_s=60)
    (entry,) = listed(client)
    assert entry["state"] == "busy" and entry["current_jobs"] == ["job-a", "job-b"]
    assert entry | {"last_beat_at": None} == gpu1.model_dump() | {
        "state": "busy", "current_jobs": ["job-a", "job-b"], "held": False, "held_until": None,
        "last_beat_at": None}
    redis.delete(keys.claims_key("gpu1"))
    workers.beat(redis, gpu1, ttl_s=60)
    assert listed(client)[0]["state"] == "idle" and listed(client)[0]["current_jobs"] == []


def test_workers_need_an_api_key_when_keys_are_on(settings: Settings) -> None:
    keyed = Settings(**(settings.model_dump() | {"api_keys": {"key-alice": "alice"}}))
    for client in app_client(keyed):
        refused = client.get("/v1/workers")
        assert refused.status_code == 401 and refused.get_json()["error"]["code"] == "unauthorized"
        assert listed(client, Authorization="Bearer key-alice") == []


def test_a_tenant_sees_the_ids_of_its_own_jobs_only(settings: Settings, redis: Redis) -> None:
    """A worker holding alice's and carol's jobs: each tenant's list names only its own job."""
    keyed = Settings(**(settings.model_dump() | {"api_keys": {"key-alice": "alice", "key-carol": "carol"}}))
    for client in app_client(keyed):
        owned = {key: client.post("/v1/jobs", json={"prompt": key}, headers={"Authorization": f"Bearer {key}"}
                                  ).get_json()["id"] for key in ("key-alice", "key-carol")}
        redis.rpush(keys.claims_key("gpu1"), *owned.values())
        workers.beat(redis, identity(settings, "gpu1"), ttl_s=60)
        for key, job_id in owned.items():
            (entry,) = listed(client, Authorization=f"Bearer {key}")
            assert entry["state"] == "busy" and entry["current_jobs"] == [job_id]
    for client in app_client(settings):  # with keys off, every caller is one tenant: it sees both
        assert listed(client)[0]["current_jobs"] == list(owned.values())


# --- docker-compose.gpus.yml: YAML only (no docker here) ---------------------------------------

class Override(list[Any]):
    """A sequence tagged ``!override``: Compose replaces the value instead of appending to it."""


class ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's ``!override`` tag (on sequences, the only use here)."""


def _override(loader: ComposeLoader, node: yaml.SequenceNode) -> Override:
    return Override(loader.construct_sequence(node, deep=True))


ComposeLoader.add_constructor("!override", _override)


def extended(base: Any, local: Any) -> Any:
    """``local`` merged onto ``base`` as Compose merges a service onto the one it extends."""
    if isinstance(local, Override):
        return list(local)
    if isinstance(base, dict) and isinstance(local, dict):
        return base | {key: extended(base[key], value) if key in base else value
                       for key, value in local.items()}
    if isinstance(base, list) and isinstance(local, list):
        return base + local
    return local


def compose(path: Path) -> dict[str, Any]:
    return yaml.load(path.read_text(), Loader=ComposeLoader)


def test_one_worker_per_gpu_carries_the_base_worker_whole() -> None:
    base = compose(ROOT / "docker-compose.yml")["services"]["worker"]
    services = compose(GPUS_FILE)["services"]
    assert services["worker"].get("profiles"), "the single worker must not start with the GPU workers"
    gpus = {name: service for name, service in services.items() if name.startswith("worker-gpu")}
    assert sorted(gpus) == ["worker-gpu0", "worker-gpu1"]
    device_ids, names = [], []
    for name, service in gpus.items():
        assert service["extends"] == {"file": "docker-compose.yml", "service": "worker"}, name
        assert not service.get("profiles"), name
        worker = extended(base, {key: value for key, value in service.items() if key != "extends"})
        (reservation,) = worker["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["driver"] == "nvidia" and "gpu" in reservation["capabilities"], name
        assert "count" not in reservation, f"{name}: count and device_ids together"
        device_ids.append(reservation["device_ids"])
        env = worker["environment"]
        names.append(env["SLOTQ_WORKER_NAME"])
        assert env["SLOTQ_DEVICE"] == "cuda", f"{name}: its one visible GPU is its cuda:0"
        # Every other setting of the base worker, unchanged.
        assert {k: v for k, v in env.items() if k != "SLOTQ_WORKER_NAME"} == base["environment"], name
        assert worker["deploy"]["resources"] | {"reservations": None} == \
            base["deploy"]["resources"] | {"reservations": None}, name
        assert {k: v for k, v in worker.items() if k not in ("deploy", "environment", "networks")} == \
            {k: v for k, v in base.items() if k not in ("deploy", "environment")}, name
        # Prometheus scrapes the DNS name `worker`.
        assert "worker" in worker["networks"]["default"]["aliases"], name
    assert len({tuple(ids) for ids in device_ids}) == len(gpus) and all(len(ids) == 1 for ids in device_ids)
    assert len(set(names)) == len(gpus)
    assert "docker compose -f docker-compose.yml -f docker-compose.gpus.yml up -d" in GPUS_FILE.read_text()


def test_a_held_worker_claims_and_joins_nothing_from_the_moment_its_hold_is_set(
        client: FlaskClient, redis: Redis, settings: Settings) -> None:
    """The hold is read by the claim scripts themselves: no claim in flight between the request and
    the worker's next heartbeat takes a job, and the other workers' claims are untouched."""
    ids = [post_job(client, seed=seed).get_json()["id"] for seed in range(4)]
    held, other = keys.claims_key("held-worker"), keys.claims_key("other-worker")
    first = waiting.claim(redis, settings.line, held)
    assert first is not None and first.job_id == ids[0]
    workers.beat(redis, identity(settings, "held-worker"), ttl_s=60)
    assert workers.hold(redis, "held-worker", hold_s=None)
    assert waiting.claim(redis, settings.line, held) is None
    assert waiting.claim_compatible(redis, settings.line, held, first, 3, 8) == []  # nothing joins
    taken = waiting.claim(redis, settings.line, other)
    assert taken is not None and taken.job_id == ids[1]
    assert workers.beat(redis, identity(settings, "held-worker"), ttl_s=60) == workers.Beat(False, True)
    assert workers.unhold(redis, "held-worker")
    joined = waiting.claim_compatible(redis, settings.line, held, first, 3, 8)
    assert [each.job_id for each in joined] == ids[2:]
    assert workers.beat(redis, identity(settings, "held-worker"), ttl_s=60) == workers.Beat(False, False)
