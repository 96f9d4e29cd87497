"""slotq across hosts: Redis, the API and the workers each on a host of their own (a network namespace,
tests/scenarios/netns.py), reaching each other only over the network, as in a real deployment."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq import Worker
from rq.job import Job
from rq.serializers import JSONSerializer

from shared.contract import keys
from shared.contract.settings import Settings
from slotq.localredis import is_reachable
from tests.conftest import Process, http_post_job, wait_for, waiting_ids
from tests.scenarios.netns import (
    REDIS_PORT,
    SENTINEL_PORT,
    WORKER_METRICS_PORT,
    Host,
    Lab,
    require_network,
    start_api,
    start_redis,
    start_worker,
    wait_api,
    wait_workers,
)
from tests.scenarios.test_failover import MASTER, SMALL, Burst, get_view, wait_all_ended
from tests.test_metrics import scrape, total, value


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[Lab]:
    """A bridge for the test's hosts; everything on it is taken down afterwards."""
    require_network()
    with Lab(tmp_path / "lab") as built:
        yield built


def lab_settings(redis_url: str, model_cache: Path, **values: Any) -> Settings:
    """Settings for processes on the lab's hosts: no drain pause, a short heartbeat."""
    return Settings(redis_url=redis_url, cache_dir=model_cache, drain_s=0, heartbeat_ttl_s=2, **values)


def ended_counts(connection: Redis, settings: Settings) -> dict[str, int]:
    """How many jobs of the queue reached each final status (slotq_jobs_ended_total)."""
    counts = connection.hgetall(keys.ended_key(settings.queue_name))
    return {status.decode(): int(count) for status, count in counts.items()}


def test_hosts_reach_each_other_until_one_is_cut_and_leave_nothing_behind(tmp_path: Path) -> None:
    require_network()
    with Lab(tmp_path / "lab") as lab:
        first, second = lab.host("first"), lab.host("second")
        master = start_redis(first, "--repl-diskless-sync-delay", "0")
        replica = start_redis(second, "--replicaof", first.ip, str(REDIS_PORT))
        with client(master) as connection:
            connection.set("probe", "across")
        def replicated() -> bool:
            with client(replica) as connection:
                return bool(connection.get("probe") == "across")

        wait_for(replicated, timeout=10, what="replication from one host to another")
        hostname = second.popen(["hostname"])
        assert hostname.popen.wait(10) == 0 and hostname.output().strip() == "second"
        second.cut()
        assert not is_reachable(replica.url, timeout=0.5)
        assert replica.popen.poll() is None  # a partition, not a crash
        second.restore()
        wait_for(lambda: is_reachable(replica.url, timeout=0.5), timeout=10, what="the host after restore")
    assert not any(line.startswith(lab.prefix) for line in subprocess_lines("ip", "netns", "list"))
    assert not any(lab.tag in line for line in subprocess_lines("ip", "-o", "link", "show"))
    assert master.popen.returncode is not None and replica.popen.returncode is not None


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_cap_holds_across_api_hosts_and_both_worker_hosts_run_each_job_once(
        lab: Lab, model_cache: Path) -> None:
    capacity, requests = 12, 40
    redis = start_redis(lab.host("redis"))
    settings = lab_settings(redis.url, model_cache, queue_name="multihost", queue_capacity=capacity,
                            api_workers=2, api_threads=4, worker_metrics_port=WORKER_METRICS_PORT)
    apis = [start_api(lab.host(f"api-{n}"), settings) for n in (1, 2)]
    for api in apis:
        wait_api(api)

    # A burst split across both API hosts before any worker runs: nothing leaves the line meanwhile.
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda n: http_post_job(apis[n % 2].url, {**SMALL, "steps": 2}),
                                range(requests)))
    assert Counter(status for status, _, _ in answers) == {202: capacity, 429: requests - capacity}
    assert {body["error"]["code"] for status, body, _ in answers if status == 429} == {"queue_full"}
    accepted = {body["id"] for status, body, _ in answers if status == 202}
    connection = Redis.from_url(redis.url, socket_timeout=5)
    try:
        assert set(waiting_ids(connection, settings)) == accepted
        # Each API host counts its own admissions; together they are the cap.
        admitted = [value(scrape(api.url + "/metrics"), "slotq_admissions_total", outcome="admitted",
                          surface="native") for api in apis]
        assert sum(admitted) == capacity

        hosts = [lab.host(f"worker-{n}") for n in (1, 2)]
        workers = [start_worker(host, settings) for host in hosts]
        wait_workers(workers, redis.url)
        # Jobs still waiting once both are registered: enough that each surely takes one.
        waiting_then = len(waiting_ids(connection, settings))
        wait_for(lambda: sum(ended_counts(connection, settings).values()) >= capacity, timeout=60,
                 what=f"the {capacity} accepted jobs to end")

        views = [get_view(apis[0].url, job_id) for job_id in accepted]
        assert [(view or {}).get("status") for view in views] == ["succeeded"] * capacity
        assert [(view or {}).get("attempt") for view in views] == [1] * capacity
        ran_on = Counter(Job.fetch(job_id, connection, serializer=JSONSerializer).worker_name
                         for job_id in accepted)
        print(f"\nmultihost: admitted per API host {admitted}; jobs per worker {dict(ran_on)}; "
              f"{waiting_then} still waiting when both workers were up")
        assert set(ran_on) <= {host.name for host in hosts}
        if waiting_then >= 4:
            assert set(ran_on) == {host.name for host in hosts}

        listed = http_get_json(apis[1].url + "/v1/workers")["workers"]
        assert sorted((worker["name"], worker["host"]) for worker in listed) == [
            (host.name, host.name) for host in hosts]
        assert len({worker["pid"] for worker in listed}) == 2
        # RQ's own record: the address each worker's Redis connection comes from, one per host.
        addresses = {w.name: w.ip_address.rsplit(":", 1)[0] for w in Worker.all(connection=connection)}
        assert addresses == {host.name: host.ip for host in hosts}
        for worker, host in zip(workers, hosts, strict=True):  # same port on each host: ports are per host
            assert total(scrape(worker.url), "slotq_worker_info", worker=host.name) == 1
        assert ended_counts(connection, settings) == {"succeeded": capacity}  # still: none ran twice
    finally:
        connection.close()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_two_api_hosts_serve_images_a_worker_host_wrote_to_a_shared_file_store(
        lab: Lab, model_cache: Path, tmp_path: Path) -> None:
    # Hosts of the lab are network namespaces over one filesystem: a folder they all mount, as an
    # NFS share or a ReadWriteMany volume would be.
    shared = tmp_path / "shared-results"
    redis = start_redis(lab.host("redis"))
    settings = lab_settings(redis.url, model_cache, queue_name="filestore", api_workers=2, api_threads=4,
                            result_store=f"file://{shared}")
    apis = [start_api(lab.host(f"api-{n}"), settings) for n in (1, 2)]
    worker = start_worker(lab.host("worker"), settings)
    for api in apis:
        wait_api(api)
    wait_workers([worker], redis.url)
    ids = [http_post_job(apis[n % 2].url, {**SMALL, "seed": n})[1]["id"] for n in range(6)]
    def all_succeeded() -> bool:
        return all((get_view(apis[0].url, job_id) or {}).get("status") == "succeeded" for job_id in ids)

    wait_for(all_succeeded, timeout=90, what="the six jobs to succeed")
    connection = Redis.from_url(redis.url, socket_timeout=5)
    try:
        for job_id in ids:
            attempt = Job.fetch(job_id, connection, serializer=JSONSerializer).meta["images_at"]
            written = (shared / "images" / job_id / attempt / "0.png").read_bytes()
            for api in apis:  # either API host serves what the worker host wrote, byte for byte
                with urllib.request.urlopen(f"{api.url}/v1/jobs/{job_id}/images/0", timeout=10) as answer:
                    assert answer.read() == written
        assert not [key for key in connection.scan_iter() if b":images:" in key]  # none in Redis
    finally:
        connection.close()


def start_sentinel(host: Host, master: Host) -> Process:
    """A sentinel on ``host`` watching the master on ``master``; settings as in test_failover."""
    config = host.dir / "sentinel.conf"  # a file of its own: a sentinel rewrites its config
    config.write_text(f"sentinel monitor {MASTER} {master.ip} {REDIS_PORT} 2\n"
                      f"sentinel down-after-milliseconds {MASTER} 1000\n"
                      f"sentinel failover-timeout {MASTER} 5000\n"
                      f"sentinel parallel-syncs {MASTER} 2\n")
    return start_redis(host, str(config), "--sentinel", port=SENTINEL_PORT)


def client(process: Process) -> Redis:
    return Redis.from_url(process.url, socket_timeout=2, decode_responses=True)


def address(process: Process) -> str:
    """host:port of a redis-server or sentinel."""
    return process.url.removeprefix("redis://").removesuffix("/0")


@dataclass
class Group:
    """A master, its replicas and a sentinel beside each of them, each redis node on a host of its own."""

    master: Process
    replicas: list[Process]
    sentinels: list[Process]

    @property
    def addresses(self) -> str:
        """SLOTQ_REDIS_SENTINELS, as an operator writes it."""
        return ",".join(address(sentinel) for sentinel in self.sentinels)

    def ready(self) -> bool:
        """Every sentinel sees the master, both replicas and the two other sentinels; replicas are linked."""
        for sentinel in self.sentinels:
            with client(sentinel) as connection:
                state = connection.sentinel_master(MASTER)
            if state["num-slaves"] < len(self.replicas) or state["num-other-sentinels"] < 2:
                return False
        for replica in self.replicas:
            with client(replica) as connection:
                if connection.info("replication").get("master_link_status") != "up":
                    return False
        return True

    def master_address(self) -> str:
        """host:port of the master, as a sentinel on a replica's host names it."""
        with client(self.sentinels[-1]) as connection:
            host, port = connection.sentinel_get_master_addr_by_name(MASTER)
        return f"{host}:{port}"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_sentinel_failover_across_hosts_loses_no_acknowledged_job(lab: Lab, model_cache: Path) -> None:
    nodes = [lab.host(f"redis-{n}") for n in (1, 2, 3)]
    # Diskless sync without the default 5 s delay: a replica (re)joins in milliseconds.
    sync = ("--repl-diskless-sync-delay", "0")
    master = start_redis(nodes[0], *sync)
    replicas = [start_redis(host, *sync, "--replicaof", nodes[0].ip, str(REDIS_PORT)) for host in nodes[1:]]
    group = Group(master, replicas, [start_sentinel(host, nodes[0]) for host in nodes])
    settings = lab_settings(master.url, model_cache, redis_master=MASTER,
                            redis_sentinels=group.addresses.split(","), min_replicas_ack=1,
                            replicas_ack_timeout_ms=500, queue_name="failover", queue_capacity=1000,
                            worker_metrics_port=0, api_workers=1, api_threads=8)
    # slotq_env writes a list as Python's repr; the comma-separated form is what an operator writes.
    env = {"redis_sentinels": group.addresses}
    worker = start_worker(lab.host("worker"), settings, **env)
    apis = [start_api(lab.host(f"api-{n}"), settings, **env) for n in (1, 2)]
    wait_for(group.ready, timeout=30, what="the sentinels to see the master, replicas and each other")
    for api in apis:
        wait_api(api)
    wait_workers([worker], master.url)

    burst = Burst()
    threads = [threading.Thread(target=burst.submit, args=(apis[n % 2].url,), daemon=True) for n in range(4)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: len(burst.acked) >= 15, timeout=30, what="15 acknowledged jobs before the kill")
        killed_at = time.monotonic()
        master.popen.send_signal(signal.SIGKILL)  # no goodbye to replicas or sentinels, as when a host dies

        def after_kill() -> list[float]:
            """When the jobs first sent after the kill were acknowledged."""
            with burst.lock:
                return [acked for first_try, acked in burst.acked.values() if first_try > killed_at]

        wait_for(lambda: len(after_kill()) >= 8, timeout=40, what="8 acknowledged jobs after the kill")
    finally:
        burst.stop.set()
        for thread in threads:
            thread.join(30)
    assert burst.unexpected == []
    failover_s = min(after_kill()) - killed_at
    # A sentinel that did not lead the failover learns of it up to 2 s later (the others' hello
    # messages), and the client may have found the new master through another one before then.
    def promoted_replica() -> str | None:
        named = group.master_address()
        return named if named in [address(replica) for replica in replicas] else None

    promoted = wait_for(promoted_replica, timeout=10, what="the sentinel to name a replica the new master")

    ended, lost = wait_all_ended(apis[0].url, list(burst.acked), timeout=90)
    print(f"\nmultihost failover: {failover_s:.2f} s from SIGKILL of the master on {nodes[0].ip} to the "
          f"first 202 of a job first sent after it; new master {promoted}; {len(burst.acked)} jobs "
          f"acknowledged, {len(lost)} lost, ended {dict(ended)}; answers {dict(burst.answers)}")
    assert lost == []
    assert ended == Counter(succeeded=len(burst.acked))
    assert worker.popen.poll() is None  # it followed the new master by itself, without a restart


def subprocess_lines(*command: str) -> list[str]:
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=30).stdout.splitlines()


def http_get_json(url: str) -> Any:
    """GET a JSON document from a real API process."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())
