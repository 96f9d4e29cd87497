"""shared/store/waiting.py: the waiting line is RQ's own lists, as RQ's tools read them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest
from flask.testing import FlaskClient
from redis import Redis
from rq import Queue
from rq.job import Job

from shared.contract import keys
from shared.contract.settings import Settings
from shared.store import waiting
from tests.conftest import app_client, rq_queues, waiting_ids

KEYS = {"key-alice": "alice", "key-bob": "bob"}


@pytest.fixture
def keyed(settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(Settings(**(settings.model_dump() | {"api_keys": KEYS, "queue_capacity": 50})))


def submit(client: FlaskClient, key: str | None, priority: str) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = client.post("/v1/jobs", data=json.dumps({"prompt": "a red fox", "priority": priority}),
                           content_type="application/json", headers=headers)
    assert response.status_code == 202, response.get_json()
    return str(response.get_json()["id"])


def rq_info(redis_url: str) -> str:
    """What `rq info` prints of this Redis's queues."""
    result = subprocess.run([sys.executable, "-m", "rq.cli", "info", "--url", redis_url, "--only-queues"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_rq_info_and_rq_queue_see_exactly_the_waiting_jobs_of_two_classes_and_tenants(
        keyed: FlaskClient, settings: Settings, redis: Redis) -> None:
    submitted = {submit(keyed, key, priority): (key, priority)
                 for key in KEYS for priority in ("high", "normal", "normal")}
    assert len(submitted) == 6
    queues = {queue.name: queue for queue in rq_queues(redis, settings)}
    name = settings.queue_name
    assert set(queues) == {f"{name}:high:alice", f"{name}:normal:alice", f"{name}:high:bob",
                           f"{name}:normal:bob"}
    assert queues[f"{name}:normal:bob"].count == 2 and queues[f"{name}:high:alice"].count == 1
    listed = [job_id for queue in queues.values() for job_id in queue.get_job_ids()]
    assert sorted(listed) == sorted(submitted)
    for job_id in listed:
        assert Job.fetch(job_id, connection=redis).get_status() == "queued"
    assert re.search(r"\b6 jobs total", rq_info(settings.redis_url)), rq_info(settings.redis_url)


def test_a_job_leaves_its_rq_list_when_canceled_or_claimed(client: FlaskClient, settings: Settings,
                                                          redis: Redis) -> None:
    first, second = (submit(client, None, "normal") for _ in range(2))
    normal = Queue(f"{settings.queue_name}:normal", connection=redis)
    assert normal.get_job_ids() == [first, second]
    assert client.delete(f"/v1/jobs/{first}").status_code == 200
    assert normal.get_job_ids() == [second] and waiting_ids(redis, settings) == [second]
    assert re.search(r"\b1 jobs total", rq_info(settings.redis_url))
    claims = keys.claims_key("test-worker")
    claimed = waiting.claim(redis, settings.queue_name, claims)
    assert claimed is not None and claimed.job_id == second
    assert normal.count == 0 and redis.lrange(claims, 0, -1) == [second.encode()]
    assert re.search(r"\b0 jobs total", rq_info(settings.redis_url))
