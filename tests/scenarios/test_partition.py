"""A worker host cut off from the network mid-job (netns.py): its job runs again elsewhere once
its heartbeat lapses, and when the link comes back its stale attempt writes nothing (fencing.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from redis import Redis

from shared.contract import keys
from shared.contract.settings import Settings
from tests.conftest import Process, app_client, post_job, wait_for
from tests.scenarios.netns import Host, Lab, require_network, start_redis, start_worker, wait_workers
from tests.store.test_fencing import assert_only_the_new_attempt_counts, await_old_attempt, holder

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
    first = wait_for(lambda: holder(client, redis, job_id, workers, 1), timeout=120,
                     what="the first attempt to take two steps")
    hosts[first].cut()
    second = wait_for(lambda: holder(client, redis, job_id, workers, 2), timeout=60,
                      what="the job to run again on the other host")
    assert second != first

    hosts[first].restore()
    steps = await_old_attempt(client, job_id, workers[first])
    assert_only_the_new_attempt_counts(client, redis, settings, job_id, second, steps)
    # The reconnected worker is alive again.
    wait_for(lambda: redis.exists(keys.alive_key(first)), timeout=30, what="the reconnected worker to beat")
