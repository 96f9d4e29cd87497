"""A worker host cut off from the network mid-job (tests/netns.py): its job runs again elsewhere once
its heartbeat lapses, and when the link comes back its stale attempt writes nothing (worker/fencing.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from shared import keys
from shared.settings import Settings
from tests.conftest import Process, app_client, post_job, wait_for, wait_for_status
from tests.netns import Host, Lab, require_network, start_redis, start_worker, wait_workers

pytestmark = pytest.mark.slow
LONG = {"width": 512, "height": 512, "steps": 60}  # several seconds a run on a small CPU


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    require_network()
    with Lab(tmp_path / "lab") as built:
        yield built


def test_a_cut_off_worker_cannot_touch_the_attempt_that_replaced_it(lab: Lab, model_cache: Path) -> None:
    redis_host = lab.host("redis")
    server = start_redis(redis_host)
    settings = Settings(redis_url=server.url, queue_name="partition", cache_dir=model_cache, drain_s=0,
                        heartbeat_ttl_s=2, redis_timeout_s=2, worker_metrics_port=0)
    hosts = {name: lab.host(name) for name in ("gpu-a", "gpu-b")}
    workers = {name: start_worker(host, settings) for name, host in hosts.items()}
    wait_workers(list(workers.values()), server.url)
    redis = Redis.from_url(server.url, socket_timeout=5)
    api = app_client(settings)  # the test's own API, in the root namespace
    try:
        run_the_partition(next(api), redis, settings, hosts, workers)
    finally:
        api.close()
        redis.close()


def run_the_partition(client: FlaskClient, redis: Redis, settings: Settings, hosts: dict[str, Host],
                      workers: dict[str, Process]) -> None:
    job_id = post_job(client, **LONG).get_json()["id"]

    def holder(attempt: int) -> str | None:
        """The worker running this attempt, once it has taken two steps."""
        current = client.get(f"/v1/jobs/{job_id}").get_json()
        if current["attempt"] != attempt or (current["progress"] or {}).get("step", 0) < 2:
            return None
        return next((name for name in workers if redis.lpos(keys.claims_key(name), job_id) is not None), None)

    first = wait_for(lambda: holder(1), timeout=120, what="the first attempt to take two steps")
    hosts[first].cut()
    second = wait_for(lambda: holder(2), timeout=60, what="the job to run again on the other host")
    assert second != first
    zombie = workers[first]

    steps: list[int] = []

    def zombie_is_done() -> bool:
        """Its attempt ended one way or another: fenced off, unable to store, or (unfenced) recorded."""
        steps.append(client.get(f"/v1/jobs/{job_id}").get_json()["progress"]["step"])
        ends = ("dropped", "could not store", "succeeded in")
        lines = zombie.output().splitlines()
        return any(job_id in line and any(end in line for end in ends) for line in lines)

    hosts[first].restore()
    wait_for(zombie_is_done, timeout=120, what="the reconnected worker to end its attempt")
    done = wait_for_status(client, job_id, "succeeded", timeout=120)

    assert done["attempt"] == 2
    assert steps == sorted(steps), "the stale attempt moved the progress of the new one"
    job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    assert job.worker_name == second
    assert len(job.results()) == 1  # one end recorded, by the new attempt
    assert redis.hget(keys.ended_key(settings.queue_name), "succeeded") == b"1"
    # The reconnected worker is alive again.
    wait_for(lambda: redis.exists(keys.alive_key(first)), timeout=30, what="the reconnected worker to beat")
