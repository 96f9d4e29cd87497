"""Fault injection against real processes: killed and stopped workers, Redis restarts, device faults."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from redis import Redis

from shared.contract import keys
from shared.contract.settings import Settings
from tests.conftest import (
    ONE_AT_A_TIME,
    Process,
    RedisServer,
    app_client,
    post_job,
    start_worker,
    wait_for,
    wait_for_status,
    waiting_ids,
)

# Several real workers a test, each loading torch and the model: slow on a busy 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
LONG = {"width": 1024, "height": 1024, "steps": 100}  # about half a second a step on a small CPU


def view(client: FlaskClient, job_id: str) -> dict:
    return client.get(f"/v1/jobs/{job_id}").get_json()


def wait_for_step(client: FlaskClient, job_id: str, attempt: int = 1) -> dict:
    """Wait until the job runs its given attempt and has taken a step."""
    def stepping() -> dict | None:
        current = view(client, job_id)
        progress = current["progress"] or {}
        running = current["status"] == "running" and current["attempt"] == attempt
        return current if running and progress.get("step", 0) >= 1 else None

    return wait_for(stepping, timeout=120, what=f"job {job_id} to run attempt {attempt}")


@pytest.fixture
def workers(settings: Settings, tmp_path: Path) -> Iterator[Callable[..., Process]]:
    """Start real workers on the test queue: ``workers(**env)``; all are stopped at teardown."""
    started: list[Process] = []

    def start(**extra: object) -> Process:
        process = start_worker(settings, tmp_path / f"worker-{len(started)}.log", **extra)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def test_killed_worker_job_runs_again_then_ends_worker_lost(client: FlaskClient, redis: Redis,
                                                             workers: Callable[..., Process]) -> None:
    first = workers()
    job_id = post_job(client, **LONG).get_json()["id"]
    before = wait_for_step(client, job_id)
    first.popen.kill()

    second = workers(worker_name="gpu0")
    up = time.monotonic()
    again = wait_for_step(client, job_id, attempt=2)
    detected = time.monotonic() - up
    print(f"abandoned job running again {detected:.2f}s after the next worker was up")
    assert detected < 15
    assert again["started_at"] > before["started_at"]
    second.popen.kill()

    third = workers(worker_name="gpu0")  # a restart that reuses the dead worker's name
    lost = wait_for_status(client, job_id, "failed", timeout=60)
    assert lost["error"]["code"] == "worker_lost" and lost["attempt"] == 2
    small = post_job(client, width=64, height=64, steps=1).get_json()["id"]
    assert wait_for_status(client, small, "succeeded")["attempt"] == 1
    assert third.popen.poll() is None
    assert all(redis.llen(key) == 0 for key in redis.keys("slotq:claims:*"))


def test_sigterm_finishes_the_running_job_and_exits_0(client: FlaskClient,
                                                      workers: Callable[..., Process]) -> None:
    worker = workers()
    running = post_job(client, width=512, height=512, steps=12).get_json()["id"]
    waiting = post_job(client, width=64, height=64, steps=1).get_json()["id"]
    wait_for_step(client, running)
    worker.popen.send_signal(signal.SIGTERM)
    assert worker.popen.wait(120) == 0
    assert view(client, running)["status"] == "succeeded"
    assert view(client, waiting)["status"] == "queued" and view(client, waiting)["position"] == 0


def test_second_sigterm_puts_the_job_back_at_the_head(client: FlaskClient, redis: Redis,
                                                      workers: Callable[..., Process]) -> None:
    worker = workers()
    running = post_job(client, **LONG).get_json()["id"]
    behind = post_job(client, width=64, height=64, steps=1).get_json()["id"]
    seen = wait_for_step(client, running)["progress"]["step"]
    worker.popen.send_signal(signal.SIGTERM)
    # Two signals sent at once may arrive as one: send the second once the first is handled.
    wait_for(lambda: "stop requested" in worker.output(), what="the first SIGTERM to be handled")
    worker.popen.send_signal(signal.SIGTERM)
    assert worker.popen.wait(60) == 0
    back = view(client, running)
    assert back["status"] == "queued" and back["position"] == 0 and back["error"] is None
    assert view(client, behind)["position"] == 1
    # The interrupted job's state was saved as it was handed back: its next attempt resumes there.
    saved = redis.hgetall(keys.checkpoint_key(running))
    assert int(saved[b"step"]) >= seen >= 1 and saved[b"attempt"] == b"1"


def test_a_killed_workers_job_resumes_at_its_step_checkpoint_and_makes_the_uninterrupted_image(
        client: FlaskClient, redis: Redis, workers: Callable[..., Process]) -> None:
    """SIGKILL after a step checkpoint of a 40-step job: the next attempt starts at the checkpoint's
    step, says so, reports progress from there and makes the bytes the uninterrupted job makes."""
    job = {"width": 512, "height": 512, "steps": 40, "seed": 4242, "scheduler": "dpmpp_2m"}
    first = workers(checkpoint_every_s=0.5)
    job_id = post_job(client, **job).get_json()["id"]
    checkpoint = keys.checkpoint_key(job_id)
    saved = wait_for(lambda: int(redis.hget(checkpoint, "step") or 0) or None, timeout=120,
                     what="a step checkpoint")
    first.popen.kill()
    assert 1 <= saved < 40

    second = workers(checkpoint_every_s=0.5)
    done = wait_for_status(client, job_id, "succeeded", timeout=120)
    assert done["attempt"] == 2 and saved <= done["resumed_from_step"] < 40
    log = [(fields[b"event"], fields.get(b"data")) for _, fields in redis.xrange(keys.log_key(job_id))]
    second_start = [index for index, (event, _) in enumerate(log) if event == b"started"][1]
    steps = [json.loads(data)["step"] for event, data in log[second_start:] if event == b"progress"]
    assert steps[0] == 0 and min(steps[1:]) >= done["resumed_from_step"]  # step 0 is the start's own
    assert not redis.exists(checkpoint)  # gone with the job's end
    resumed = client.get(f"/v1/jobs/{job_id}/images/0").data

    # The same job again, on the same worker, never stopped.
    again = post_job(client, **job).get_json()["id"]
    uninterrupted = wait_for_status(client, again, "succeeded", timeout=120)
    assert uninterrupted["attempt"] == 1 and uninterrupted["resumed_from_step"] is None
    assert client.get(f"/v1/jobs/{again}/images/0").data == resumed
    second.popen.kill()


def test_stop_timeout_interrupts_and_requeues(client: FlaskClient, workers: Callable[..., Process]) -> None:
    worker = workers(stop_timeout_s=1)
    running = post_job(client, **LONG).get_json()["id"]
    wait_for_step(client, running)
    worker.popen.send_signal(signal.SIGTERM)
    assert worker.popen.wait(60) == 0
    assert view(client, running)["status"] == "queued"


def finishing_process(worker_pid: int) -> int | None:
    """The pid of the worker's finishing process (a ``spawn`` child; not RQ's resource tracker)."""
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue  # not a process, or one that just ended
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == worker_pid and b"spawn_main" in command:
            return int(entry.name)
    return None


def loads_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_finishing_process_runs_without_torch_and_a_crash_of_it_loses_no_job(
        client: FlaskClient, workers: Callable[..., Process]) -> None:
    worker = workers(**ONE_AT_A_TIME)  # one job an execution: the second waits with its images
    finishing = wait_for(lambda: finishing_process(worker.popen.pid), what="the finishing process")
    # Its GIL is its own only if it never loads torch: the worker does, and the check can tell.
    assert loads_torch(worker.popen.pid) and not loads_torch(finishing)

    # Held still, it cannot answer: the worker finishes one more GPU section and waits with that
    # job's images, while the job handed over stays running (its last step is the finisher's to record).
    os.kill(finishing, signal.SIGSTOP)
    ids = [post_job(client, width=64, height=64, steps=2, seed=seed).get_json()["id"] for seed in range(4)]
    wait_for(lambda: "waiting for the finishing process" in worker.output(),
             what="the worker to wait with the second job's images")
    assert [view(client, job_id)["status"] for job_id in ids] == ["running", "running", "queued", "queued"]
    assert all(view(client, job_id)["progress"]["step"] < 2 for job_id in ids[:2])  # not the last yet
    os.kill(finishing, signal.SIGKILL)

    ended = [wait_for_status(client, job_id, "succeeded", "failed", "canceled") for job_id in ids]
    assert [job["status"] for job in ended] == ["succeeded"] * 4
    assert [job["attempt"] for job in ended] == [2, 1, 1, 1]  # the lost one ran again, once
    assert "its finishing was lost" in worker.output()
    replacement = wait_for(lambda: finishing_process(worker.popen.pid), what="a new finishing process")
    assert replacement != finishing and worker.popen.poll() is None
    assert post_job(client, width=64, height=64, steps=1).status_code == 202


# Each device fault in a whole-pipeline execution and in the step-level loop.
EXECUTIONS = {"whole": {"step_scheduling": False}, "loop": {"step_scheduling": True, "max_batch": 4}}


@pytest.mark.parametrize("execution", EXECUTIONS)
def test_out_of_memory_fails_the_job_and_the_worker_goes_on(
        client: FlaskClient, workers: Callable[..., Process], execution: str) -> None:
    worker = workers(fault_injection=True, **EXECUTIONS[execution])
    oom = post_job(client, prompt="__oom__ a huge picture", width=64, height=64, steps=2).get_json()["id"]
    failed = wait_for_status(client, oom, "failed", "succeeded")
    assert failed["status"] == "failed" and failed["error"]["code"] == "out_of_memory"
    after = post_job(client, width=64, height=64, steps=2).get_json()["id"]
    assert wait_for_status(client, after, "succeeded", "failed")["status"] == "succeeded"
    assert worker.popen.poll() is None


@pytest.mark.parametrize("execution", EXECUTIONS)
def test_lost_device_exits_non_zero_and_the_job_is_retried(
        client: FlaskClient, workers: Callable[..., Process], execution: str) -> None:
    broken = workers(fault_injection=True, **EXECUTIONS[execution])
    body = {"prompt": "__device_lost__ then fine", "width": 64, "height": 64, "steps": 2}
    job_id = post_job(client, **body).get_json()["id"]
    assert broken.popen.wait(60) == 3
    assert "device unusable" in broken.output()
    workers()  # a healthy device: the supervisor's restart
    done = wait_for_status(client, job_id, "succeeded", "failed", timeout=60)
    assert done["status"] == "succeeded" and done["attempt"] == 2


def test_redis_restart_loses_no_queued_job(private_redis: RedisServer, tmp_path: Path,
                                           model_cache: Path) -> None:
    settings = Settings(redis_url=private_redis.url, queue_name="restart", cache_dir=model_cache,
                        heartbeat_ttl_s=2, drain_s=0)
    clients = app_client(settings)
    client = next(clients)
    worker = start_worker(settings, tmp_path / "worker.log")
    try:
        # The first job runs for about a second even on a fast machine (a 256x256 job of 6 steps took
        # 0.1 s there, over before any poll saw it step): Redis stops while it runs, the rest waiting.
        sizes = [{"width": 512, "height": 512, "steps": 24}] + [{"width": 256, "height": 256, "steps": 6}] * 5
        ids = [post_job(client, seed=i, **size).get_json()["id"] for i, size in enumerate(sizes)]
        wait_for_step(client, ids[0])
        private_redis.stop()
        assert post_job(client).status_code == 503
        private_redis.start()
        views = [wait_for_status(client, i, "succeeded", "failed", "canceled", timeout=120) for i in ids]
        assert [v["status"] for v in views] == ["succeeded"] * len(ids)
        assert worker.popen.poll() is None, "the worker reconnects instead of exiting"
    finally:
        worker.stop()
        clients.close()


def test_random_kills_lose_nothing(settings: Settings, tmp_path: Path) -> None:
    roomy = settings.model_copy(update={"queue_capacity": 1000})
    clients = app_client(roomy)
    client = next(clients)
    rng = random.Random(int(os.environ.get("SLOTQ_TEST_SEED", "7")))
    # Each request twice with the same seed: twins must end with identical bytes if both succeed.
    bodies = [{"width": 64, "height": 64, "steps": 1 + i % 3, "seed": i} for i in range(100)]
    ids = [post_job(client, **body).get_json()["id"] for body in bodies for _ in range(2)]
    survivor = None
    try:
        for round_ in range(8):
            worker = start_worker(settings, tmp_path / f"kill-{round_}.log")
            time.sleep(rng.uniform(0.0, 1.5))  # the kill's random moment, not a wait for a condition
            worker.popen.kill()
            worker.popen.wait()
        survivor = start_worker(settings, tmp_path / "survivor.log")
        views = [wait_for_status(client, i, "succeeded", "failed", "canceled", timeout=120) for i in ids]
        assert survivor.stop() == 0
        images: dict[int, set[bytes]] = {}
        for current in views:
            if current["status"] == "succeeded":
                png = client.get(current["images"][0]).data
                images.setdefault(current["request"]["seed"], set()).add(png)
    finally:
        if survivor is not None:
            survivor.stop()  # a no-op once it has stopped; left running, it would take later tests' jobs
        clients.close()
    with Redis.from_url(settings.redis_url) as redis:
        assert len(waiting_ids(redis, settings)) == 0
        assert all(redis.llen(key) == 0 for key in redis.keys("slotq:claims:*"))
        assert redis.zcard(f"rq:wip:{settings.queue_name}") == 0  # RQ's started-job registry
    outcomes = {(v["status"], (v["error"] or {}).get("code")) for v in views}
    assert outcomes <= {("succeeded", None), ("failed", "worker_lost")}, outcomes
    assert all(len(pngs) == 1 for pngs in images.values())
    print(f"{len(ids)} jobs, {sum(v['status'] == 'succeeded' for v in views)} succeeded, "
          f"{sum(v['attempt'] > 1 for v in views)} ran more than once")
