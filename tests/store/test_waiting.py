"""shared/store/waiting.py: the line in RQ's own lists, priority classes, shed-by-class and fair
share between tenants, against a real Redis.

The order asserted on the line is the order a worker takes jobs: it pops from the same sorted sets
in one script. The tests with the session's worker check that order where jobs really run; the
first ones check that RQ's own tools (`rq info`, rq.Queue) see exactly the jobs that wait.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import pytest
from flask.testing import FlaskClient
from redis import Redis
from rq import Queue
from rq.job import Job

from shared.contract import keys
from shared.contract.settings import Settings
from shared.store import waiting
from shared.store.connection import text
from tests.conftest import (
    Process,
    app_client,
    data_url,
    http_post_job,
    rq_queues,
    start_image,
    wait_for,
    wait_for_status,
    waiting_ids,
)

KEYS = {"key-a": "alice", "key-c": "carol",
        "key-batch": {"tenant": "batch", "priorities": ["low"]},
        "key-ops": {"tenant": "ops", "priorities": ["high", "normal"]}}


def submit(client: FlaskClient, key: str | None = None, **body: Any) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.post("/v1/jobs", data=json.dumps({"prompt": "a red fox", **body}),
                       content_type="application/json", headers=headers)


def with_settings(settings: Settings, **changes: Any) -> Iterator[FlaskClient]:
    yield from app_client(Settings(**(settings.model_dump() | changes)))


@pytest.fixture
def classes(settings: Settings) -> Iterator[FlaskClient]:
    """Capacity 10: low admitted while fewer than 5 wait, high while fewer than 12."""
    yield from with_settings(settings, queue_capacity=10, low_share=0.5, high_reserve=0.2)


@pytest.fixture
def keyed(settings: Settings) -> Iterator[FlaskClient]:
    yield from with_settings(settings, api_keys=KEYS, queue_capacity=100)


def submit_id(client: FlaskClient, key: str | None, priority: str) -> str:
    response = submit(client, key, priority=priority)
    assert response.status_code == 202, response.get_json()
    return str(response.get_json()["id"])


def codes(responses: list[Any]) -> list[int]:
    return [response.status_code for response in responses]


def rq_info(redis_url: str) -> str:
    """What `rq info` prints of this Redis's queues."""
    result = subprocess.run([sys.executable, "-m", "rq.cli", "info", "--url", redis_url, "--only-queues"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_rq_info_and_rq_queue_see_exactly_the_waiting_jobs_of_two_classes_and_tenants(
        keyed: FlaskClient, settings: Settings, redis: Redis) -> None:
    submitted = {submit_id(keyed, key, priority): (key, priority)
                 for key in ("key-a", "key-c") for priority in ("high", "normal", "normal")}
    assert len(submitted) == 6
    queues = {queue.name: queue for queue in rq_queues(redis, settings)}
    name = settings.line
    assert set(queues) == {f"{name}:high:alice", f"{name}:normal:alice", f"{name}:high:carol",
                           f"{name}:normal:carol"}
    assert queues[f"{name}:normal:carol"].count == 2 and queues[f"{name}:high:alice"].count == 1
    listed = [job_id for queue in queues.values() for job_id in queue.get_job_ids()]
    assert sorted(listed) == sorted(submitted)
    for job_id in listed:
        assert Job.fetch(job_id, connection=redis).get_status() == "queued"
    assert re.search(r"\b6 jobs total", rq_info(settings.redis_url)), rq_info(settings.redis_url)


def test_a_job_leaves_its_rq_list_when_canceled_or_claimed(client: FlaskClient, settings: Settings,
                                                          redis: Redis) -> None:
    first, second = (submit_id(client, None, "normal") for _ in range(2))
    normal = Queue(f"{settings.line}:normal", connection=redis)
    assert normal.get_job_ids() == [first, second]
    assert client.delete(f"/v1/jobs/{first}").status_code == 200
    assert normal.get_job_ids() == [second] and waiting_ids(redis, settings) == [second]
    assert re.search(r"\b1 jobs total", rq_info(settings.redis_url))
    claims = keys.claims_key("test-worker")
    claimed = waiting.claim(redis, settings.line, claims)
    assert claimed is not None and claimed.job_id == second
    assert normal.count == 0 and redis.lrange(claims, 0, -1) == [second.encode()]
    assert re.search(r"\b0 jobs total", rq_info(settings.redis_url))


def test_the_lowest_class_is_refused_first(classes: FlaskClient) -> None:
    assert codes([submit(classes, priority="low") for _ in range(6)]) == [202] * 5 + [429]
    refused = submit(classes, priority="low")
    assert refused.get_json()["error"]["code"] == "queue_full" and int(refused.headers["Retry-After"]) >= 1
    # Normal jobs still have the rest of the capacity: exactly 10 may wait, as in v1.
    assert codes([submit(classes) for _ in range(6)]) == [202] * 5 + [429]
    # High jobs may use 20 % beyond it.
    assert codes([submit(classes, priority="high") for _ in range(3)]) == [202, 202, 429]
    state = classes.get("/v1/queue").get_json()
    assert state["by_priority"] == {"high": 2, "normal": 5, "low": 5} and state["waiting"] == 12
    assert state["limits"] == {"high": 12, "normal": 10, "low": 5}


def test_the_line_is_ordered_by_class(classes: FlaskClient, redis: Redis, settings: Settings) -> None:
    low = submit(classes, priority="low").get_json()["id"]
    normal = submit(classes).get_json()["id"]
    high = submit(classes, priority="high").get_json()["id"]
    assert waiting_ids(redis, settings) == [high, normal, low]
    assert [classes.get(f"/v1/jobs/{i}").get_json()["position"] for i in (high, normal, low)] == [0, 1, 2]


def test_the_worker_runs_the_highest_class_first(worker_client: FlaskClient) -> None:
    blocker = submit(worker_client, width=512, height=512, steps=20).get_json()["id"]
    wait_for(lambda: worker_client.get(f"/v1/jobs/{blocker}").get_json()["status"] != "queued",
             what="the first job to start")
    tiny = {"width": 64, "height": 64, "steps": 1}
    order = ("low", "normal", "high", "normal")
    ids = [submit(worker_client, priority=p, **tiny).get_json()["id"] for p in order]
    assert worker_client.get(f"/v1/jobs/{blocker}").get_json()["status"] == "running"  # all of them waited
    views = [wait_for_status(worker_client, i, "succeeded") for i in ids]
    started = sorted(range(4), key=lambda index: views[index]["started_at"])
    assert started == [2, 1, 3, 0]  # high, then normal in arrival order, then low


def test_keys_may_be_limited_to_some_priorities(keyed: FlaskClient) -> None:
    refused = submit(keyed, "key-batch", priority="high")
    assert refused.status_code == 403
    assert refused.get_json()["error"]["code"] == "priority_not_allowed"
    assert "low" in refused.get_json()["error"]["message"]
    # Without a priority, a key that may not use normal runs at the first one it lists.
    assert submit(keyed, "key-batch").get_json()["request"]["priority"] == "low"
    assert submit(keyed, "key-ops").get_json()["request"]["priority"] == "normal"
    assert submit(keyed, "key-ops", priority="low").status_code == 403
    assert codes([submit(keyed, "key-a", priority=p) for p in ("high", "normal", "low")]) == [202] * 3
    unknown = submit(keyed, "key-a", priority="urgent")
    assert unknown.status_code == 422 and unknown.get_json()["error"]["details"][0]["loc"] == ["priority"]


def test_tenants_take_turns_by_cost_within_a_class(keyed: FlaskClient, redis: Redis,
                                                   settings: Settings) -> None:
    tenant_of = {}
    for _ in range(3):  # 4 units each
        tenant_of[submit(keyed, "key-a", width=512, height=512, steps=4).get_json()["id"]] = ("alice", 4.0)
    for _ in range(8):  # 1 unit each
        tenant_of[submit(keyed, "key-c", width=256, height=256, steps=4).get_json()["id"]] = ("carol", 1.0)
    order = waiting_ids(redis, settings)
    assert len(order) == 11
    # Start-time fair queueing: in every prefix of the order, the work the two tenants were served
    # differs by at most one job's cost, however they arrived (alice's burst came first).
    served = Counter[str]()
    for job_id in order[:-3]:  # while both still have work waiting
        tenant, cost = tenant_of[job_id]
        served[tenant] += cost
        assert abs(served["alice"] - served["carol"]) <= 4.0, (order, served)
    assert [tenant_of[i][0] for i in order[:2]].count("alice") == 1  # both start at once


def test_a_newcomer_is_not_starved_by_a_burst_across_api_processes(
        worker: Process, worker_settings: Settings, start_api: Callable[..., Process]) -> None:
    """A 500-job burst from one tenant, posted by concurrent clients through two API processes:
    another tenant's single job runs after at most one more execution of the burst (one job at a
    time, or a batch of up to SLOTQ_MAX_BATCH)."""
    changes = {"api_keys": json.dumps(KEYS), "queue_capacity": 1000}
    apis = [start_api(worker_settings, **changes) for _ in range(2)]
    tiny = {"prompt": "x", "width": 64, "height": 64, "steps": 1}

    def post(index: int, key: str = "key-a") -> tuple[int, dict[str, Any]]:
        return http_post_job(apis[index % 2].url, tiny, key)[:2]

    with ThreadPoolExecutor(8) as pool:
        burst = list(pool.map(post, range(500)))
    assert Counter(status for status, _ in burst) == {202: 500}
    status, newcomer = post(0, "key-c")
    assert status == 202 and newcomer["position"] <= 1
    clients = with_settings(worker_settings, api_keys=KEYS, queue_capacity=1000)
    client = next(clients)
    try:
        headers = {"Authorization": "Bearer key-c"}
        done = wait_for(lambda: _ended(client.get(f"/v1/jobs/{newcomer['id']}", headers=headers).get_json()),
                        what="the newcomer's job to end")
        assert done["status"] == "succeeded"
        alice = {"Authorization": "Bearer key-a"}
        views = [client.get(f"/v1/jobs/{view['id']}", headers=alice).get_json() for _, view in burst]
        arrived, started = _at(newcomer["created_at"]), _at(done["started_at"])
        overtook = [v for v in views if v["started_at"] and arrived < _at(v["started_at"]) < started]
        assert len(overtook) <= max(1, worker_settings.max_batch), overtook
        assert sum(1 for v in views if v["status"] == "queued") > 100  # the burst was really waiting
    finally:
        for _, view in burst:  # leave the session's worker an empty queue
            client.delete(f"/v1/jobs/{view['id']}", headers={"Authorization": "Bearer key-a"})
        clients.close()


def _ended(view: dict[str, Any]) -> dict[str, Any] | None:
    return view if view["status"] not in ("queued", "running") else None


def _at(moment: str) -> float:
    return datetime.fromisoformat(moment).timestamp()


def test_class_limits_are_exact_across_api_processes(settings: Settings,
                                                     start_api: Callable[..., Process]) -> None:
    apis = [start_api(settings, queue_capacity=20, low_share=0.5, high_reserve=0.2) for _ in range(2)]

    def post(index: int, priority: str) -> int:
        return http_post_job(apis[index % 2].url, {"prompt": "x", "priority": priority})[0]

    with ThreadPoolExecutor(16) as pool:
        low = Counter(pool.map(post, range(40), ["low"] * 40))
        normal = Counter(pool.map(post, range(40), ["normal"] * 40))
        high = Counter(pool.map(post, range(40), ["high"] * 40))
    assert (low, normal, high) == ({202: 10, 429: 30}, {202: 10, 429: 30}, {202: 4, 429: 36})


def test_a_refusal_is_one_script_call_that_writes_nothing(classes: FlaskClient, redis: Redis) -> None:
    for _ in range(10):
        submit(classes)
    submit(classes)  # the first refusal may load the script into Redis

    commands = _commands_during(redis, lambda: submit(classes))
    refused = commands.pop("response")
    assert refused.status_code == 429
    assert [c.split()[0] for c in commands["client"]] == ["EVALSHA"]
    assert commands["lua"] and not [c for c in commands["lua"] if c.split()[0] in WRITES], commands["lua"]

    submit(classes, priority="high")  # an admission may load the script too
    commands = _commands_during(redis, lambda: submit(classes, priority="high"))
    assert commands.pop("response").status_code == 202
    assert [c.split()[0] for c in commands["client"]] == ["EVALSHA"]  # an admission, too, is one call


WRITES = {"SET", "HSET", "ZADD", "ZREM", "RPUSH", "LPUSH", "LTRIM", "DEL", "EXPIRE", "HINCRBY", "HDEL",
          "ZPOPMIN", "LREM"}


def _commands_during(redis: Redis, action: Callable[[], Any]) -> dict[str, Any]:
    """The commands Redis ran on this test's database during ``action``, by whom."""
    seen: dict[str, Any] = {"client": [], "lua": []}
    db = redis.connection_pool.connection_kwargs.get("db", 0)
    marker = redis.client()  # connected before the monitor starts, so only its ECHO shows
    marker.ping()
    with redis.monitor() as monitor:
        seen["response"] = action()
        marker.echo("end-of-action")
        for event in monitor.listen():
            command = event["command"]
            if command == "ECHO end-of-action":
                break
            if event["db"] == db:
                seen["lua" if event["client_type"] == "lua" else "client"].append(command.upper())
    marker.close()
    return seen


# --- affinity: a worker's claim prefers the adapters it holds, within SLOTQ_AFFINITY_MAX_SKIP ---------

@pytest.fixture
def adapter_line(settings: Settings, tmp_path: Any) -> Iterator[FlaskClient]:
    """Capacity 100, two adapters known by name (the claim never loads them)."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.safetensors").write_bytes(b"")
    yield from with_settings(settings, queue_capacity=100, lora_dir=tmp_path)


def take_all(redis: Redis, settings: Settings, max_skip: int, resident: tuple[str, ...] = ("a", "b"),
             count: int | None = None) -> list[str]:
    """Claim as a worker does, each time with the adapters key of the job it took last."""
    last, taken = "", []
    claims = keys.claims_key("affine-worker")
    while count is None or len(taken) < count:
        affinity = waiting.Affinity(max_skip, last, resident)
        claimed = waiting.claim(redis, settings.line, claims, affinity)
        if claimed is None:
            break
        taken.append(claimed.job_id)
        last = claimed.record.get(b"adapters", b"").decode()
    return taken


def alternating(client: FlaskClient, jobs: int = 40) -> tuple[list[str], dict[str, str]]:
    ids, adapter = [], {}
    for index in range(jobs):
        name = "ab"[index % 2]
        job_id = submit(client, loras=[{"name": name}], width=64, height=64).get_json()["id"]
        ids.append(job_id)
        adapter[job_id] = name
    return ids, adapter


def switches(order: list[str], adapter: dict[str, str]) -> int:
    return sum(adapter[before] != adapter[after] for before, after in zip(order, order[1:], strict=False))


def test_affinity_starts_an_alternating_line_in_runs_and_passes_no_job_over_more_than_the_bound(
        adapter_line: FlaskClient, redis: Redis, settings: Settings) -> None:
    ids, adapter = alternating(adapter_line)
    order = take_all(redis, settings, max_skip=8)
    assert sorted(order) == sorted(ids) and waiting_ids(redis, settings) == []
    # In admission order it switches 39 times; in runs of one adapter, about 40 / 8 times.
    print("started as", "".join(adapter[i] for i in order), f"({switches(order, adapter)} switches)")
    assert switches(order, adapter) <= 40 // 8 + 1, [adapter[i] for i in order]
    for job_id in ids:  # passed over: later jobs that started before it
        later = ids[ids.index(job_id) + 1:]
        assert sum(other in later for other in order[:order.index(job_id)]) <= 8
    assert max(int(redis.hget(Job.key_for(i), "skips") or 0) for i in ids) <= 8


def test_without_affinity_the_line_starts_in_order(adapter_line: FlaskClient, redis: Redis,
                                                   settings: Settings) -> None:
    ids, adapter = alternating(adapter_line, 12)
    assert take_all(redis, settings, max_skip=0) == ids
    assert all(redis.hget(Job.key_for(i), "skips") is None for i in ids)


def test_a_high_job_starts_next_whatever_its_adapters(adapter_line: FlaskClient, redis: Redis,
                                                      settings: Settings) -> None:
    alternating(adapter_line, 20)
    first = take_all(redis, settings, max_skip=8, count=3)
    high = submit(adapter_line, priority="high", loras=[{"name": "b"}], width=64, height=64).get_json()["id"]
    last = redis.hget(Job.key_for(first[-1]), "adapters").decode()
    claimed = waiting.claim(redis, settings.line, keys.claims_key("affine-worker"),
                            waiting.Affinity(8, last, ("a",)))
    assert claimed is not None and claimed.job_id == high


def test_resident_adapters_go_before_ones_that_must_be_loaded(adapter_line: FlaskClient, redis: Redis,
                                                              settings: Settings) -> None:
    needs_load = submit(adapter_line, loras=[{"name": "b"}], width=64, height=64).get_json()["id"]
    resident = submit(adapter_line, loras=[{"name": "a", "scale": 0.5}], width=64, height=64).get_json()["id"]
    bare = submit(adapter_line, width=64, height=64).get_json()["id"]
    claims = keys.claims_key("affine-worker")
    # It ran `a` at 1.0 last: no job has that, so the first whose adapters are all resident goes.
    took = waiting.claim(redis, settings.line, claims, waiting.Affinity(8, "a:1.0", ("a",)))
    assert took is not None and took.job_id == resident
    took = waiting.claim(redis, settings.line, claims, waiting.Affinity(8, "", ("a",)))
    assert took is not None and took.job_id == bare  # it ran the bare model last: the bare job
    assert waiting_ids(redis, settings) == [needs_load]


@pytest.fixture
def control_line(settings: Settings, tmp_path: Any) -> Iterator[FlaskClient]:
    """Capacity 100, two ControlNets known by name (the claim never loads them)."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    yield from with_settings(settings, queue_capacity=100, controlnet_dir=tmp_path)


def test_affinity_counts_controlnets_as_it_counts_adapters(control_line: FlaskClient, redis: Redis,
                                                            settings: Settings) -> None:
    image = data_url(start_image(64, 64))
    ids, net = [], {}
    for index in range(24):
        name = "ab"[index % 2]
        body = {"controlnets": [{"name": name, "image": image}], "width": 64, "height": 64}
        ids.append(submit(control_line, **body).get_json()["id"])
        net[ids[-1]] = name
    order = take_all(redis, settings, max_skip=8, resident=("@a", "@b"))
    assert sorted(order) == sorted(ids)
    assert switches(order, net) <= 24 // 8 + 1, [net[i] for i in order]  # 23 in admission order
    needs_load = submit(control_line, controlnets=[{"name": "b", "image": image}], width=64,
                        height=64).get_json()["id"]
    resident = submit(control_line, controlnets=[{"name": "a", "image": image, "scale": 0.5}], width=64,
                      height=64).get_json()["id"]
    bare = submit(control_line, width=64, height=64).get_json()["id"]
    claims = keys.claims_key("affine-worker")
    # It ran `a` at 1.0 last and holds `a`: the job whose ControlNet is resident goes first.
    took = waiting.claim(redis, settings.line, claims, waiting.Affinity(8, "@a:1.0", ("@a",)))
    assert took is not None and took.job_id == resident
    assert waiting_ids(redis, settings) == [needs_load, bare]


# --- a worker serving several models claims from all their lines (SLOTQ_WORKER_MODELS) -----------------

@pytest.fixture
def model_lines(settings: Settings) -> Iterator[FlaskClient]:
    """Two models, each its own line; capacity 100 each."""
    yield from with_settings(settings, queue_capacity=100, model_names=["a", "b"])


def alternating_models(client: FlaskClient, jobs: int = 40) -> tuple[list[str], dict[str, str]]:
    ids, model = [], {}
    for index in range(jobs):
        name = "ab"[index % 2]
        job_id = submit(client, model=name, width=64, height=64).get_json()["id"]
        ids.append(job_id)
        model[job_id] = name
    return ids, model


def take_across(redis: Redis, settings: Settings, max_skip: int, held: str = "a",
                count: int | None = None) -> list[waiting.Claimed]:
    """Claim as a worker serving models a and b with one model on its device does: the line of the
    model it ran last first, that model on the device."""
    taken: list[waiting.Claimed] = []
    claims = keys.claims_key("models-worker")
    while count is None or len(taken) < count:
        lines = [settings.line_of(held), settings.line_of("b" if held == "a" else "a")]
        claimed = waiting.claim(redis, lines, claims, waiting.Affinity(max_skip, on_device=(lines[0],)))
        if claimed is None:
            break
        taken.append(claimed)
        held = claimed.line.rsplit(":", 1)[-1]
    return taken


def test_a_worker_of_two_models_takes_an_alternating_line_in_runs_within_the_bound(
        model_lines: FlaskClient, redis: Redis, settings: Settings) -> None:
    ids, model = alternating_models(model_lines)
    taken = take_across(redis, settings, max_skip=8)
    order = [claimed.job_id for claimed in taken]
    assert sorted(order) == sorted(ids)
    assert all(claimed.line == settings.line_of(model[claimed.job_id]) for claimed in taken)
    assert waiting_ids(redis, settings, "a") == waiting_ids(redis, settings, "b") == []
    print("started as", "".join(model[i] for i in order), f"({switches(order, model)} switches)")
    assert switches(order, model) <= 40 // 8 + 1, [model[i] for i in order]
    for job_id in ids:  # passed over: later jobs that started before it
        later = ids[ids.index(job_id) + 1:]
        assert sum(other in later for other in order[:order.index(job_id)]) <= 8
    assert max(int(redis.hget(Job.key_for(i), "skips") or 0) for i in ids) <= 8


def test_without_affinity_the_lines_of_two_models_start_in_admission_order(
        model_lines: FlaskClient, redis: Redis, settings: Settings) -> None:
    ids, _ = alternating_models(model_lines, 12)
    assert [claimed.job_id for claimed in take_across(redis, settings, max_skip=0)] == ids


def test_a_high_job_for_the_model_not_held_starts_next(model_lines: FlaskClient, redis: Redis,
                                                       settings: Settings) -> None:
    alternating_models(model_lines, 20)
    assert {claimed.line for claimed in take_across(redis, settings, max_skip=8, count=3)} == {
        settings.line_of("a")}
    high = submit(model_lines, model="b", priority="high", width=64, height=64).get_json()["id"]
    (claimed,) = take_across(redis, settings, max_skip=8, count=1)
    assert (claimed.job_id, claimed.line) == (high, settings.line_of("b"))


def test_each_models_line_keeps_its_own_cap_and_fair_order(settings: Settings, redis: Redis) -> None:
    for client in with_settings(settings, queue_capacity=3, model_names=["a", "b"],
                                api_keys={"key-a": "alice", "key-c": "carol"}):
        alice = [submit(client, "key-a", model="a", width=64, height=64) for _ in range(2)]
        carol = submit(client, "key-c", model="a", width=64, height=64)
        assert [answer.status_code for answer in (*alice, carol)] == [202, 202, 202]
        assert submit(client, "key-c", model="a", width=64, height=64).status_code == 429  # a's line is full
        other = submit(client, "key-c", model="b", width=64, height=64)
        assert other.status_code == 202  # b's line is not
        claimed = [each.job_id for each in take_across(redis, settings, max_skip=0)]
        first, second = (answer.get_json()["id"] for answer in alice)
        # Fair share inside a's line holds across the worker's lines: carol's job, admitted behind
        # alice's two, goes before alice's second.
        assert claimed.index(carol.get_json()["id"]) < claimed.index(second), claimed
        assert set(claimed) == {first, second, carol.get_json()["id"], other.get_json()["id"]}


def test_affinity_keeps_fair_share_between_tenants_within_the_bound(settings: Settings, redis: Redis,
                                                                     tmp_path: Any) -> None:
    """Alice's burst runs adapter `a`, Carol's `b`: a worker that ran `a` prefers Alice's jobs, but
    no job starts more than max_skip claims later than fair share alone would start it."""
    for name in ("a", "b"):
        (tmp_path / f"{name}.safetensors").write_bytes(b"")
    max_skip, tenant_of = 4, {}
    for client in with_settings(settings, queue_capacity=100, lora_dir=tmp_path, api_keys=KEYS):
        for key, name in (("key-a", "a"), ("key-c", "b")):  # alice's twelve, then carol's twelve
            for _ in range(12):
                response = submit(client, key, loras=[{"name": name}], width=64, height=64)
                tenant_of[response.get_json()["id"]] = name
    fair = waiting_ids(redis, settings)  # the order without affinity: the tenants take turns
    turns = "".join(tenant_of[job_id] for job_id in fair)
    assert all(sorted(turns[i:i + 2]) == ["a", "b"] for i in range(0, 24, 2)), turns
    affine = take_all(redis, settings, max_skip=max_skip)
    print("started as", "".join(tenant_of[job_id] for job_id in affine))
    assert sorted(affine) == sorted(fair) and switches(affine, tenant_of) < switches(fair, tenant_of)
    late = [affine.index(job_id) - index for index, job_id in enumerate(fair)]
    assert 0 < max(late) <= max_skip, late  # reordered, within the bound
    for claims in range(1, len(affine) + 1):  # so neither tenant falls behind its turns by more
        served = [tenant_of[job_id] for job_id in affine[:claims]]
        assert abs(served.count("a") - served.count("b")) <= max_skip + 1, served


# --- the classes' waiting-cost sums, which ETAs read, follow every way a job leaves or comes back ---

def waiting_costs(redis: Redis, line: str) -> tuple[dict[str, float], dict[str, float]]:
    """Each class's kept sum, and the sum of the `cost` fields of the jobs that wait in it."""
    sums = redis.hgetall(f"{keys.line_key(line)}:costs")
    kept = {name.decode(): float(value) for name, value in sums.items()}
    actual = {}
    for class_ in ("high", "normal", "low"):
        ids = redis.zrange(f"{keys.line_key(line)}:{class_}", 0, -1)
        actual[class_] = sum(float(redis.hget(Job.key_for(i.decode()), "cost") or 0) for i in ids)
    return {class_: kept.get(class_, 0.0) for class_ in actual}, actual


def test_the_cost_sums_follow_claims_batches_requeues_cancels_and_expiry_back_to_zero(
        keyed: FlaskClient, redis: Redis, settings: Settings) -> None:
    # Every script that moves a job in or out of the line keeps its class's sum in step: after each
    # move the sums equal what the waiting jobs cost, and a drained line's sums are zero.
    line, claims = settings.line, keys.claims_key("sums-worker")
    sizes = [(64, 4), (128, 8), (256, 4), (64, 12)]
    for index in range(16):
        key = ["key-a", "key-c", "key-ops", "key-batch"][index % 4]
        priority = {"key-batch": "low", "key-ops": "high"}.get(key, "normal")
        side, steps = sizes[index // 4]
        response = submit(keyed, key, priority=priority, width=side, height=side, steps=steps)
        assert response.status_code == 202, response.get_json()
    doomed = submit(keyed, "key-a", width=128, height=128, deadline_s=0.05).get_json()["id"]
    canceled = submit_id(keyed, "key-c", "normal")

    def in_step(after: str) -> None:
        kept, actual = waiting_costs(redis, line)
        assert kept == pytest.approx(actual, abs=1e-9), after

    in_step("admissions")
    assert all(waiting_costs(redis, line)[0].values())  # every class holds work
    assert keyed.delete(f"/v1/jobs/{canceled}", headers={"Authorization": "Bearer key-c"}).status_code == 200
    in_step("a cancel")
    queue = Queue(settings.queue_name, connection=redis)
    wait_for(lambda: waiting.expire_due(queue, settings, line)
             and waiting.position(redis, line, doomed) is None, what="the job past its deadline to expire")
    in_step("an expiry")
    first = waiting.claim(redis, line, claims)
    assert first is not None
    in_step("a claim")
    waiting.requeue(redis, line, first.job_id)
    in_step("a requeue")
    again = waiting.claim(redis, line, claims, waiting.Affinity(2, "", ()))
    assert again is not None and again.job_id == first.job_id  # the head of its class again
    in_step("a claim with affinity")
    batches = 0
    while (claimed := waiting.claim(redis, line, claims)) is not None:
        batches += bool(waiting.claim_compatible(redis, line, claims, claimed, 3, 8))
        in_step("a batch's claims")
    assert batches and sum(waiting.counts(redis, line).values()) == 0
    assert waiting_costs(redis, line)[0] == pytest.approx({"high": 0, "normal": 0, "low": 0}, abs=1e-9)


def test_recounting_sets_the_sums_of_jobs_admitted_before_they_were_kept(keyed: FlaskClient, redis: Redis,
                                                                         settings: Settings) -> None:
    # A Redis holding a line from a version that kept no sums: the worker recounts them at start.
    for key, priority in [("key-a", "normal"), ("key-c", "normal"), ("key-ops", "high"),
                          ("key-batch", "low")]:
        submit_id(keyed, key, priority)
    submit(keyed, "key-a", width=256, height=256, steps=12)
    kept, actual = waiting_costs(redis, settings.line)
    redis.delete(f"{keys.line_key(settings.line)}:costs")
    assert waiting.recount_costs(redis, settings.line) == pytest.approx(actual)
    assert waiting_costs(redis, settings.line)[0] == pytest.approx(actual)
    assert all(actual.values()) and kept == pytest.approx(actual)


def test_a_join_claims_jobs_of_the_first_ones_size_and_class_whatever_their_steps(
        settings: Settings, redis: Redis) -> None:
    clients = with_settings(settings, queue_capacity=20)
    client = next(clients)
    try:
        def job(**body: Any) -> str:
            response = submit(client, **({"width": 64, "height": 64} | body))
            assert response.status_code == 202, response.get_json()
            return str(response.get_json()["id"])

        first = job(steps=4)
        joiners = [job(steps=30, guidance_scale=2.0), job(steps=8, scheduler="euler", num_images=2)]
        others = [job(steps=4, width=128), job(steps=4, priority="low"), job(steps=4, speed="fast"),
                  job(steps=4, prompt_syntax="weighted")]
    finally:
        clients.close()
    line, claims = settings.line, keys.claims_key("join-worker")
    claimed = waiting.claim(redis, line, claims)
    assert claimed is not None and claimed.job_id == first
    # By batch key none of them would batch with the first (other steps or sampler); by join key two do.
    assert waiting.claim_compatible(redis, line, claims, claimed, 8, 16) == []
    joined = waiting.claim_compatible(redis, line, claims, claimed, 8, 16, by="join")
    assert [each.job_id for each in joined] == joiners
    assert [text(each) for each in redis.lrange(claims, 0, -1)] == [first, *joiners]  # each one claimed
    assert sorted(waiting_ids(redis, settings)) == sorted(others)


def test_the_wait_of_a_higher_class_is_read_for_preemption(settings: Settings, redis: Redis,
                                                          client: FlaskClient) -> None:
    line = settings.line
    assert waiting.waited_above(redis, line, "low") is None  # nothing waits
    submit_id(client, None, "low")
    assert waiting.waited_above(redis, line, "low") is None  # not above
    submit_id(client, None, "normal")
    time.sleep(0.2)
    waited = waiting.waited_above(redis, line, "low")
    assert waited is not None and 0.2 <= waited < 5
    assert waiting.waited_above(redis, line, "normal") is None
    assert waiting.waited_above(redis, line, "high") is None


def test_joins_pass_a_job_of_another_size_over_at_most_max_skip_times(settings: Settings,
                                                                      redis: Redis) -> None:
    clients = with_settings(settings, queue_capacity=20)
    client = next(clients)
    try:
        def job(side: int) -> str:
            response = submit(client, width=side, height=side, steps=4)
            assert response.status_code == 202, response.get_json()
            return str(response.get_json()["id"])

        first, other, *small = job(64), job(128), job(64), job(64), job(64)
    finally:
        clients.close()
    line, claims = settings.line, keys.claims_key("join-worker")
    claimed = waiting.claim(redis, line, claims)
    assert claimed is not None and claimed.job_id == first

    def join(max_skip: int) -> list[str]:
        return [each.job_id for each in
                waiting.claim_compatible(redis, line, claims, claimed, 1, 16, by="join", max_skip=max_skip)]

    assert join(0) == []  # no bound to spend: nothing passes the 128x128 job at the head
    # Each join that takes a job behind it counts one pass on it; at the bound, nothing behind it goes.
    assert [join(2), join(2), join(2)] == [small[:1], small[1:2], []]
    assert redis.hget(Job.key_for(other), "skips") == b"2"
    assert waiting_ids(redis, settings) == [other, small[2]]
    assert waiting.claim(redis, line, claims).job_id == other  # type: ignore[union-attr]  # next
