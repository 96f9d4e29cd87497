"""Redis failover under Sentinel: a 202 means the job reached the master and SLOTQ_MIN_REPLICAS_ACK
replicas, and every job answered so still ends after the master is killed mid-burst."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq.job import Job

from shared.contract.settings import Settings, load_settings
from slotq.localredis import free_port, is_reachable, redis_server_binary
from tests.conftest import app_client, http_post_job, post_job, start_worker, wait_for, waiting_ids

MASTER = "mymaster"
SMALL = {"prompt": "failover", "width": 64, "height": 64, "steps": 1}
STARTED = re.compile(r"job=([A-Za-z0-9_-]+)\]: started: attempt (\d+)")


@dataclass
class Node:
    """One redis-server (a master, a replica or a sentinel) that a test may kill and start again."""

    port: int
    data: Path
    args: list[str]
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> Node:
        self.data.mkdir(parents=True, exist_ok=True)
        command = [redis_server_binary(), *self.args, "--port", str(self.port), "--bind", "127.0.0.1",
                   "--dir", str(self.data), "--logfile", str(self.data / "redis.log"), "--daemonize", "no"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: self._answers(), timeout=10, what=f"redis-server on port {self.port}")
        return self

    def _answers(self) -> bool:
        if self.process is not None and self.process.poll() is not None:
            raise AssertionError(f"redis-server on port {self.port} exited; see {self.data / 'redis.log'}")
        return is_reachable(f"redis://127.0.0.1:{self.port}/0", timeout=0.2)

    def kill(self) -> None:
        """SIGKILL: no goodbye to replicas or sentinels, as when a host dies."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def client(self) -> Redis:
        return Redis(port=self.port, socket_timeout=2, decode_responses=True)


def data_node(root: Path, *args: str) -> Node:
    """A master (no args) or a replica (``--replicaof``), started; RDB and AOF off, as in tests."""
    port = free_port()
    # Diskless sync without the default 5 s delay: a replica (re)joins in milliseconds.
    return Node(port, root / f"redis-{port}", ["--save", "", "--appendonly", "no",
                                               "--repl-diskless-sync-delay", "0", *args]).start()


def sentinel_node(root: Path, master_port: int) -> Node:
    """A sentinel with a config file of its own (sentinels rewrite theirs)."""
    port = free_port()
    data = root / f"sentinel-{port}"
    data.mkdir(parents=True)
    config = data / "sentinel.conf"
    config.write_text(f"sentinel monitor {MASTER} 127.0.0.1 {master_port} 2\n"
                      f"sentinel down-after-milliseconds {MASTER} 1000\n"
                      f"sentinel failover-timeout {MASTER} 5000\n"
                      f"sentinel parallel-syncs {MASTER} 2\n")
    return Node(port, data, [str(config), "--sentinel"]).start()


def linked(replica: Node) -> bool:
    """Whether the replica's link to its master is up."""
    with replica.client() as client:
        return client.info("replication").get("master_link_status") == "up"


def acknowledging(master: Node, replica: Node) -> bool:
    """Whether the replica is linked and acknowledges the master's writes (its full sync is over)."""
    if not linked(replica):
        return False
    with master.client() as client:
        client.set("slotq-test:sync-probe", 1)
        return int(client.execute_command("WAIT", 1, 500)) >= 1


@dataclass
class Group:
    """A master, its replicas and three sentinels watching them."""

    master: Node
    replicas: list[Node]
    sentinels: list[Node]

    @property
    def addresses(self) -> str:
        return ",".join(f"127.0.0.1:{node.port}" for node in self.sentinels)

    def ready(self) -> bool:
        """Every sentinel sees the master, both replicas and the two other sentinels."""
        for sentinel in self.sentinels:
            with sentinel.client() as client:
                state = client.sentinel_master(MASTER)
            if state["num-slaves"] < len(self.replicas) or state["num-other-sentinels"] < 2:
                return False
        return all(map(linked, self.replicas))

    def master_port(self) -> int:
        with self.sentinels[0].client() as client:
            return int(client.sentinel_get_master_addr_by_name(MASTER)[1])


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    """Two replicas, not one: with SLOTQ_MIN_REPLICAS_ACK=1 the new master needs one of its own."""
    master = data_node(tmp_path)
    replicas = [data_node(tmp_path, "--replicaof", "127.0.0.1", str(master.port)) for _ in range(2)]
    sentinels = [sentinel_node(tmp_path, master.port) for _ in range(3)]
    started = Group(master, replicas, sentinels)
    try:
        wait_for(started.ready, timeout=30, what="the sentinels to see the master, replicas and each other")
        yield started
    finally:
        for node in [*sentinels, *replicas, master]:
            node.kill()


@dataclass
class Burst:
    """What the clients of a burst saw: each acknowledged id with the times of its first try and its
    acknowledgement, and a count of every answer."""

    acked: dict[str, tuple[float, float]] = field(default_factory=dict)
    answers: Counter[str] = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def count(self, what: str) -> None:
        with self.lock:
            self.answers[what] += 1

    def submit(self, url: str) -> None:
        """Like a real client: a new Idempotency-Key per job, the same one for each retry of it."""
        while not self.stop.is_set():
            key, first_try = str(uuid.uuid4()), time.monotonic()
            while True:
                try:
                    status, body, _ = http_post_job(url, SMALL, headers={"Idempotency-Key": key})
                except (OSError, http.client.HTTPException):
                    status, body = 0, {"error": {"code": "no_answer"}}
                if status in (200, 202):
                    self.count(str(status))
                    with self.lock:
                        self.acked.setdefault(body["id"], (first_try, time.monotonic()))
                    break
                self.count(body["error"]["code"])
                if status not in (0, 503):
                    with self.lock:
                        self.unexpected.append(f"{status}: {body}")
                    return
                # Retry-After says 1-2 s; a shorter pause keeps the measured failover time sharp.
                if self.stop.wait(0.1):
                    break  # never acknowledged: the client knows it has no job to count on


# A whole-pipeline execution, and the step-level loop whose joiners are claimed while a step runs.
EXECUTIONS: dict[str, dict[str, Any]] = {"whole": {"step_scheduling": False},
                                         "loop": {"step_scheduling": True, "max_batch": 8}}


def get_view(url: str, job_id: str) -> dict[str, Any] | None:
    """The job as the API has it now; None when it answers 404."""
    try:
        with urllib.request.urlopen(f"{url}/v1/jobs/{job_id}", timeout=10) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        exc.close()  # its socket now, not whenever the garbage collector finds it
        if exc.code == 404:
            return None
        raise


def wait_all_ended(url: str, job_ids: list[str], timeout: float) -> tuple[Counter[str], list[str]]:
    """Follow jobs until each has ended; how many ended in each status, and the ids the API lost."""
    pending, ended, lost = list(job_ids), Counter[str](), []

    def all_ended() -> bool:
        while pending:  # in order of admission, roughly the order the worker takes them
            view = get_view(url, pending[0])
            if view is None:
                lost.append(pending.pop(0))
            elif view["status"] in ("succeeded", "failed", "canceled", "expired"):
                ended[view["status"]] += 1
                pending.pop(0)
            else:
                return False
        return True

    try:
        wait_for(all_ended, timeout, what=f"the {len(job_ids)} acknowledged jobs to end")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; stuck: {get_view(url, pending[0])}") from None
    return ended, lost


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("execution", EXECUTIONS)
def test_failover_loses_no_acknowledged_job(group: Group, start_api: Any, model_cache: Path,
                                            tmp_path: Path, execution: str) -> None:
    settings = Settings(redis_url=f"redis://127.0.0.1:{group.master.port}/0", redis_master=MASTER,
                        redis_sentinels=group.addresses.split(","), min_replicas_ack=1,
                        replicas_ack_timeout_ms=500, queue_name="failover", queue_capacity=1000,
                        **EXECUTIONS[execution],
                        cache_dir=model_cache, drain_s=0, heartbeat_ttl_s=2, worker_metrics_port=0,
                        api_workers=1, api_threads=8)
    # slotq_env writes a list as Python's repr; the comma-separated form is what an operator writes.
    env = {"redis_sentinels": group.addresses}
    worker = start_worker(settings, tmp_path / "worker.log", **env)
    burst = Burst()
    try:
        api = start_api(settings, **env)
        threads = [threading.Thread(target=burst.submit, args=(api.url,), daemon=True) for _ in range(3)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(burst.acked) >= 20, timeout=30, what="20 acknowledged jobs before the kill")
        killed_at = time.monotonic()
        group.master.kill()

        def after_kill() -> list[float]:
            """When the jobs first sent after the kill were acknowledged."""
            with burst.lock:
                return [acked for first_try, acked in burst.acked.values() if first_try > killed_at]

        wait_for(lambda: len(after_kill()) >= 10, timeout=40, what="10 acknowledged jobs after the kill")
        burst.stop.set()
        for thread in threads:
            thread.join(30)
        assert burst.unexpected == []
        failover_s = min(after_kill()) - killed_at
        # A sentinel that did not lead the failover learns of it from the others' hello messages,
        # every 2 s: the client may have found the new master through another one before then.
        wait_for(lambda: group.master_port() != group.master.port, timeout=10,
                 what="the first sentinel to name the new master")

        try:
            ended, lost = wait_all_ended(api.url, list(burst.acked), timeout=90)
        except AssertionError as exc:  # what the worker did meanwhile, and where it is now, say why
            worker.popen.send_signal(signal.SIGUSR1)
            time.sleep(1)
            raise AssertionError(f"{exc}\nthe worker's log, its end:\n{worker.output()[-8000:]}") from None
        starts = Counter(job_id for job_id, _ in STARTED.findall(worker.output()))
        twice = sorted(job_id for job_id, runs in starts.items() if runs > 1 and job_id in burst.acked)
        print(f"\nfailover: {failover_s:.2f} s from SIGKILL to the first 202 of a job first sent after it; "
              f"{len(burst.acked)} jobs acknowledged, {len(lost)} lost, ended {dict(ended)}; "
              f"answers {dict(burst.answers)}; run twice: {len(twice)} {twice}")
        assert lost == []
        assert ended == Counter(succeeded=len(burst.acked))
    finally:
        burst.stop.set()
        exit_code = worker.stop()
    assert exit_code == 0, worker.output()[-3000:]
    assert "Redis unreachable" in worker.output()  # it saw the master go, and carried on by itself


def test_without_a_replica_a_submit_answers_503_not_replicated(redis_url: str, model_cache: Path) -> None:
    # The session's redis-server has no replica: WAIT 1 gives up after the timeout.
    settings = Settings(redis_url=redis_url, min_replicas_ack=1, replicas_ack_timeout_ms=300,
                        queue_name="not-replicated", cache_dir=model_cache)
    with Redis.from_url(redis_url) as redis:
        redis.flushdb()
        clients = app_client(settings)
        client = next(clients)
        try:
            key = {"Idempotency-Key": "retry-me"}
            for _ in range(2):  # a replay waits for the replicas too: no 200 before they have it
                started = time.monotonic()
                response = client.post("/v1/jobs", json={"prompt": "a red fox"}, headers=key)
                assert 0.3 <= time.monotonic() - started < 2
                assert response.status_code == 503
                assert response.get_json()["error"]["code"] == "not_replicated"
                assert int(response.headers["Retry-After"]) >= 1
            [job_id] = waiting_ids(redis, settings)  # on the master, once, and it may run
        finally:
            clients.close()
        # Without the requirement, the same key replays that one job rather than making another.
        clients = app_client(settings.model_copy(update={"min_replicas_ack": 0}))
        client = next(clients)
        try:
            response = client.post("/v1/jobs", json={"prompt": "a red fox"}, headers=key)
            assert (response.status_code, response.get_json()["id"]) == (200, job_id)
        finally:
            clients.close()


def test_202_means_the_replica_has_the_job(tmp_path: Path, model_cache: Path) -> None:
    master = data_node(tmp_path)
    replica = data_node(tmp_path, "--replicaof", "127.0.0.1", str(master.port))
    # A generous ack timeout: a loaded CI machine must not turn a replicated job into a 503.
    settings = Settings(redis_url=f"redis://127.0.0.1:{master.port}/0", min_replicas_ack=1,
                        redis_timeout_s=3.0, replicas_ack_timeout_ms=1500, queue_name="replicated",
                        cache_dir=model_cache)
    clients = app_client(settings)
    client = next(clients)
    try:
        wait_for(lambda: acknowledging(master, replica), timeout=10, what="the replica's link")
        with replica.client() as on_replica:
            for _ in range(5):
                response = post_job(client)
                assert response.status_code == 202
                # No waiting: the 202 came after the replica acknowledged the job.
                assert on_replica.exists(Job.key_for(response.get_json()["id"]))
        replica.kill()
        response = client.post("/v1/jobs", json={"prompt": "a red fox"}, headers={"Idempotency-Key": "k"})
        assert (response.status_code, response.get_json()["error"]["code"]) == (503, "not_replicated")
        replica.start()
        wait_for(lambda: acknowledging(master, replica), timeout=10,
                 what="the replica's link after its restart")
        response = client.post("/v1/jobs", json={"prompt": "a red fox"}, headers={"Idempotency-Key": "k"})
        assert response.status_code == 200  # the job of the 503, replayed, and now on the replica
        with replica.client() as on_replica:
            assert on_replica.exists(Job.key_for(response.get_json()["id"]))
    finally:
        clients.close()
        replica.kill()
        master.kill()


@pytest.mark.parametrize("value", ['["10.0.0.1:26379", "sentinel-2:26379"]',
                                   "10.0.0.1:26379, sentinel-2:26379"])
def test_sentinels_read_as_json_or_comma_separated(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTQ_REDIS_SENTINELS", value)
    assert load_settings().sentinel_addresses == [("10.0.0.1", 26379), ("sentinel-2", 26379)]


@pytest.mark.parametrize("value", ["sentinel", "sentinel:0", "sentinel:70000", "[not json", "a:1,b"])
def test_a_bad_sentinel_address_stops_start_up(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTQ_REDIS_SENTINELS", value)
    with pytest.raises(SystemExit, match="SLOTQ_REDIS_SENTINELS"):
        load_settings()
