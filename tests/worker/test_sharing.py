"""Sharing the device (worker/sharing.py, worker/models.py's release): an idle worker lets go of its
model, an operator's hold keeps a worker from claiming while another takes the jobs, and a GPU worker
yields where another program took the device's memory; real workers on a real Redis."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from flask.testing import FlaskClient

from shared.contract.settings import Settings
from tests.conftest import (
    Process,
    app_client,
    own_database,
    post_job,
    running_worker,
    wait_for,
    wait_for_status,
)
from worker.sharing import MB, DeviceSharing

DATABASE = 16  # apart from the others' (0 per test, 1 the worker, 2-15 other modules)
ADMIN = {"Authorization": "Bearer admin-key"}
IDLE_S = 2.0


@pytest.fixture(scope="module")
def sharing_settings(redis_url: str, model_cache: Path) -> Settings:
    # A heartbeat every half second: a hold is read within one.
    return Settings(redis_url=own_database(redis_url, DATABASE), queue_name="sharing", queue_capacity=20,
                    cache_dir=model_cache, drain_s=0, heartbeat_ttl_s=2, admin_keys=["admin-key"])


@pytest.fixture(scope="module")
def keeper(sharing_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """The worker that lets go of its model after IDLE_S idle seconds."""
    yield from running_worker(sharing_settings, tmp_path_factory, "keeper", worker_name="keeper",
                              idle_release_s=IDLE_S)


@pytest.fixture(scope="module")
def other(sharing_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """A worker of the same line that holds its model for as long as it lives (the default)."""
    yield from running_worker(sharing_settings, tmp_path_factory, "other", worker_name="other")


@pytest.fixture
def api(sharing_settings: Settings, keeper: Process, other: Process) -> Iterator[FlaskClient]:
    for client in app_client(sharing_settings):
        yield client
        for name in ("keeper", "other"):  # no test leaves a worker held for the next
            client.post(f"/v1/admin/workers/{name}/resume", headers=ADMIN)


def workers(client: FlaskClient) -> dict[str, dict[str, Any]]:
    listed = client.get("/v1/admin/workers", headers=ADMIN).get_json()["workers"]
    return {view["name"]: view for view in listed}


def place(client: FlaskClient, name: str) -> tuple[str, datetime] | None:
    """Where the worker's one model is and since when, as its last heartbeat said."""
    view = workers(client).get(name)
    if view is None or not view["model_places"]:
        return None
    (held,) = view["model_places"]
    return held["place"], datetime.fromisoformat(held["since"])


def hold(client: FlaskClient, name: str, **body: Any) -> None:
    """Hold a worker and wait until its heartbeat says so (it then claims nothing)."""
    asked = datetime.now(UTC)
    answer = client.post(f"/v1/admin/workers/{name}/release", json=body, headers=ADMIN)
    assert answer.status_code == 200 and answer.get_json()["held"], answer.get_json()
    said(client, name, asked, lambda view: view["held"])


def said(client: FlaskClient, name: str, asked: datetime, true: Callable[[dict[str, Any]], bool]
         ) -> dict[str, Any]:
    """The worker's view once a heartbeat after ``asked`` says ``true`` of it (an earlier one may
    still say what it was)."""
    def now_true() -> dict[str, Any] | None:
        view = workers(client)[name]
        return view if datetime.fromisoformat(view["last_beat_at"]) > asked and true(view) else None

    return dict(wait_for(now_true, what=f"{name}'s heartbeat to say so"))


def rss(process: Process) -> int:
    """The process's resident memory, in bytes."""
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def job(client: FlaskClient, side: int = 64) -> str:
    return str(post_job(client, width=side, height=side, steps=2).get_json()["id"])


def test_an_idle_worker_lets_go_of_its_model_and_the_next_job_loads_it_again(api: FlaskClient,
                                                                             keeper: Process) -> None:
    hold(api, "other")  # every job runs on the keeper
    first = wait_for_status(api, job(api), "succeeded")
    assert first["worker"] == "keeper"
    ended = datetime.fromisoformat(first["finished_at"])
    loaded = rss(keeper)
    def released_since() -> datetime | None:
        held = place(api, "keeper")
        return held[1] if held and held[0] == "released" and held[1] > ended else None

    since = wait_for(released_since, what="the keeper to let go of its model after the job")
    # Not before SLOTQ_IDLE_RELEASE_S: idle time counts from the execution's end, just before this.
    assert (since - ended).total_seconds() > IDLE_S - 0.5
    assert "device released (idle)" in keeper.output()
    # On the CPU the weights were the process's memory: dropped, they are the system's again (the tiny
    # model's are 1.1 MiB).
    assert loaded - rss(keeper) >= 2**20
    second = wait_for_status(api, job(api), "succeeded")
    assert second["worker"] == "keeper" and second["model_load"]["source"] == "disk"


def test_a_held_worker_lets_go_claims_nothing_while_another_takes_the_jobs_and_resume_brings_it_back(
        api: FlaskClient, other: Process) -> None:
    hold(api, "other")
    assert workers(api)["other"]["state"] == "held" and workers(api)["other"]["held_until"] is None
    # It has no idle release: only the hold makes it let go of its model.
    wait_for(lambda: (place(api, "other") or ("",))[0] == "released", what="the held worker to let go")
    assert "device released (held)" in other.output()
    ids = [job(api, side) for side in (64, 72, 80)]
    views = [wait_for_status(api, job_id, "succeeded") for job_id in ids]
    assert {view["worker"] for view in views} == {"keeper"}
    hold(api, "keeper")
    waiting = job(api)
    time.sleep(1.5)  # an idle worker claims within milliseconds of an admission
    assert api.get(f"/v1/jobs/{waiting}").get_json()["status"] == "queued"
    resumed = api.post("/v1/admin/workers/other/resume", headers=ADMIN)
    assert resumed.get_json() == {"worker": "other", "held": False}
    view = wait_for_status(api, waiting, "succeeded")
    assert view["worker"] == "other" and view["model_load"]["source"] == "disk"


def test_a_hold_for_some_seconds_lapses_by_itself(api: FlaskClient) -> None:
    hold(api, "other")
    hold(api, "keeper", hold_s=3)
    until = workers(api)["keeper"]["held_until"]
    assert until is not None
    waiting = job(api)
    time.sleep(1.0)
    assert api.get(f"/v1/jobs/{waiting}").get_json()["status"] == "queued"
    view = wait_for_status(api, waiting, "succeeded")  # no resume: the hold lapsed
    assert view["worker"] == "keeper"
    assert datetime.fromisoformat(view["started_at"]) >= datetime.fromisoformat(until)


def test_release_and_resume_answer_404_for_no_live_worker_and_422_for_a_bad_hold(api: FlaskClient) -> None:
    for action in ("release", "resume"):
        answer = api.post(f"/v1/admin/workers/ghost/{action}", headers=ADMIN)
        assert answer.status_code == 404 and answer.get_json()["error"]["code"] == "not_found"
    bad = api.post("/v1/admin/workers/keeper/release", json={"hold_s": -1}, headers=ADMIN)
    assert bad.status_code == 422 and bad.get_json()["error"]["code"] == "invalid_request"
    assert not workers(api)["keeper"]["held"]  # the refused request held nothing
    for action in ("release", "resume"):  # logged and counted as the line's actions are
        assert api.post(f"/v1/admin/workers/keeper/{action}", headers=ADMIN).status_code == 200
    metrics = api.get("/metrics").get_data(as_text=True)
    assert 'slotq_admin_actions_total{action="release",model=""} 1.0' in metrics
    assert 'slotq_admin_actions_total{action="resume_worker",model=""} 1.0' in metrics


# --- the decisions alone, with the device's memory read as given ------------------------------------


def sharing(yield_below_mb: int, device: str, readings: list[int], held_mb: int = 300) -> DeviceSharing:
    settings = Settings(yield_below_mb=yield_below_mb)
    free = iter(readings)
    return DeviceSharing(settings, torch.device(device), lambda: next(free) * MB, lambda: held_mb * MB)


def test_a_gpu_worker_yields_below_the_free_memory_set_and_comes_back_once_its_own_fits_again() -> None:
    # 1000 MB asked free; the worker held 300 MB: back once 1300 MB are free.
    decide = sharing(1000, "cuda", [2000, 500, 1200, 1299, 1300, 900])
    yielding = "yielding"
    assert [decide.keep_free() for _ in range(6)] == [None, yielding, yielding, yielding, None, yielding]


def test_no_yielding_on_the_cpu_nor_where_it_is_off_and_a_hold_comes_first() -> None:
    assert sharing(1000, "cpu", [0]).keep_free() is None  # the CPU's memory is not read
    assert sharing(0, "cuda", [0]).keep_free() is None
    held = sharing(1000, "cuda", [5000])
    held.held.set()
    assert held.keep_free() == "held"


def test_idle_release_is_due_after_its_seconds_and_never_where_it_is_0() -> None:
    never = DeviceSharing(Settings(), torch.device("cpu"))
    never.last_busy -= 10**6
    assert not never.idle_due()
    soon = DeviceSharing(Settings(idle_release_s=5), torch.device("cpu"))
    assert not soon.idle_due()
    soon.last_busy -= 5
    assert soon.idle_due()
    soon.busy()
    assert not soon.idle_due()


def test_slotq_worker_release_resume_and_drain_with_stay_from_a_shell(
        api: FlaskClient, sharing_settings: Settings, start_api: Callable[..., Process], other: Process
) -> None:
    served = start_api(sharing_settings)

    def slotq(*arguments: str, key: str = "admin-key") -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "slotq.cli", "worker", *arguments, "--url", served.url,
                               "--admin-key", key], capture_output=True, text=True, timeout=60, check=False)

    asked = datetime.now(UTC)
    released = slotq("release", "other", "--hold-s", "600")
    assert released.returncode == 0 and json.loads(released.stdout)["held"] is True, released.stderr
    said(api, "other", asked, lambda view: view["state"] == "held" and view["held_until"] is not None)
    asked = datetime.now(UTC)
    resumed = slotq("resume", "other")
    assert resumed.returncode == 0 and json.loads(resumed.stdout) == {"worker": "other", "held": False}
    said(api, "other", asked, lambda view: not view["held"])
    asked = datetime.now(UTC)
    stayed = slotq("drain", "other", "--stay")
    assert stayed.returncode == 0 and json.loads(stayed.stdout)["exit"] is False, stayed.stderr
    said(api, "other", asked, lambda view: view["state"] == "held" and view["held_until"] is None)
    assert other.popen.poll() is None  # drained, it stays
    refused = slotq("release", "ghost")
    assert refused.returncode == 1 and "No live worker" in refused.stderr
    not_admin = slotq("resume", "other", key="wrong")
    assert not_admin.returncode == 1 and "unauthorized" in not_admin.stderr.lower()
