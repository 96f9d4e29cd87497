"""One worker serving several models of a folder (SLOTQ_WORKER_MODELS, worker/models.py): a real worker
process on tiny SD and SDXL single files, one pipeline on its device at a time (SLOTQ_MODEL_CACHE=1)."""

from __future__ import annotations

import io
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image

from shared.contract.settings import Settings
from tests.conftest import (
    ONE_AT_A_TIME,
    Process,
    app_client,
    own_database,
    post_job,
    start_worker,
    wait_for,
    wait_for_status,
)

DATABASE = 12  # apart from the others' (0 per test, 1 the worker, 2-3, 5-9, 11, 13 other modules)
MODELS = ("sd", "xl")
SMALL = {"width": 64, "height": 64, "steps": 2}


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> tuple[Path, dict[str, str]]:
    """A folder with a tiny SD and a tiny SDXL single file, and the configs each takes its layout from."""
    from worker.tiny.checkpoints import write_checkpoint, write_configs
    from worker.tiny.model import ensure_tiny_model

    root = tmp_path_factory.mktemp("two-models")
    folder, configs = root / "models", {}
    for name, tiny, family in (("sd", "tiny", "sd"), ("xl", "tiny-sdxl", "sdxl")):
        source = ensure_tiny_model(model_cache, tiny)
        write_checkpoint(source, folder / f"{name}.safetensors")
        configs[family] = str(write_configs(source, root / f"{family}-configs"))
    return folder, configs


@pytest.fixture
def two_models(redis_url: str, model_cache: Path, models_dir: tuple[Path, dict[str, str]]) -> Settings:
    url = own_database(redis_url, DATABASE)
    folder, configs = models_dir
    return Settings(redis_url=url, queue_name="models-tests", cache_dir=model_cache, drain_s=0,
                    models_dir=folder, model_names=["sd"], worker_models=["*"], model_cache=1,
                    affinity_max_skip=8, checkpoint_configs=configs, device="cpu", dtype="float32",
                    torch_threads=1, queue_capacity=100, heartbeat_ttl_s=2)


@pytest.fixture
def client(two_models: Settings) -> Iterator[FlaskClient]:
    yield from app_client(two_models)


def worker_of(settings: Settings, tmp_path: Path, name: str = "two-models") -> Process:
    return start_worker(settings.model_copy(update={"worker_name": name}), tmp_path / f"{name}.log")


def image_of(client: FlaskClient, view: dict[str, Any]) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(client.get(view["images"][0]).data)))


def test_an_alternating_line_runs_in_runs_and_each_image_is_its_own_models(
        client: FlaskClient, two_models: Settings, tmp_path: Path) -> None:
    ids = [post_job(client, model=MODELS[index % 2], seed=index // 2 % 2, **SMALL).get_json()["id"]
           for index in range(40)]
    # One job an execution: each job's model_load is its own execution's (a batch's jobs share one).
    worker = worker_of(two_models.model_copy(update=ONE_AT_A_TIME), tmp_path)
    try:
        views = [wait_for_status(client, job_id, "succeeded", "failed") for job_id in ids]
        assert all(view["status"] == "succeeded" for view in views), [v["error"] for v in views]
        order = sorted(views, key=lambda view: view["started_at"])
        runs = [view["model"] for view in order]
        switches = sum(before != after for before, after in zip(runs, runs[1:], strict=False))
        print("ran as", "".join(model[0] for model in runs), f"({switches} switches)")
        # In admission order it would switch 39 times; with affinity about 40 / 8 at most.
        assert switches <= 40 // 8 + 1, runs
        # Each switch loaded the model from disk (one on the device at a time), and the job says so.
        loads = [view["model_load"] for view in order]
        assert sum(load["source"] == "disk" for load in loads) == switches + (runs[0] != "sd"), loads
        assert all(load["seconds"] > 0 for load in loads if load["source"] == "disk")
        assert all(load == {"source": "device", "seconds": 0.0} for load in loads if load["source"] != "disk")
        # Each image is the one its model makes alone for its seed: run each pair again on its own.
        alone = {}
        for model in MODELS:
            for seed in (0, 1):
                job_id = post_job(client, model=model, seed=seed, **SMALL).get_json()["id"]
                alone[model, seed] = image_of(client, wait_for_status(client, job_id, "succeeded"))
        assert not np.array_equal(alone["sd", 0], alone["xl", 0])  # the two models differ
        assert not np.array_equal(alone["sd", 0], alone["sd", 1])  # and so do the seeds
        for view in views:
            key = view["model"], view["request"]["seed"]
            assert np.array_equal(image_of(client, view), alone[key]), key
        listed = {model["name"]: model for model in client.get("/v1/models").get_json()["models"]}
        assert listed["sd"]["worker_names"] == listed["xl"]["worker_names"] == ["two-models"]
        # One model on the device: that of the job it ran last (the API reads the heartbeats anew
        # each 2 s).
        wait_for(lambda: [name for name in MODELS if listed_held(client, name)] == ["xl"], what="a heartbeat")
        # /v1/workers reads each worker's last heartbeat, which may be a beat behind /v1/models' set.
        listed_worker = wait_for(lambda: next((each for each in workers_listed(client)
                                               if each["on_device"] == ["xl"]), None), what="its next beat")
        assert len(workers_listed(client)) == 1  # once, though on two lines
        assert listed_worker["models"] == list(MODELS)
    finally:
        assert worker.stop() == 0, worker.output()


def listed_held(client: FlaskClient, name: str) -> bool:
    listed = {model["name"]: model for model in client.get("/v1/models").get_json()["models"]}
    return listed[name]["held_by"] == ["two-models"]


def test_a_high_job_for_the_model_not_on_the_device_starts_next(
        client: FlaskClient, two_models: Settings, tmp_path: Path) -> None:
    # One job an execution: with batching, the line's jobs posted before the high one may share the
    # execution it waits for, as many as arrived before the first claim (a race this test is not about).
    worker = worker_of(two_models.model_copy(update=ONE_AT_A_TIME), tmp_path)
    try:
        line = [post_job(client, model="sd", seed=index, width=64, height=64, steps=30).get_json()["id"]
                for index in range(6)]
        wait_for(lambda: client.get(f"/v1/jobs/{line[0]}").get_json()["status"] == "running",
                 what="the first job to run")
        high = post_job(client, model="xl", priority="high", seed=1, **SMALL).get_json()["id"]
        views = {job_id: wait_for_status(client, job_id, "succeeded") for job_id in [*line, high]}
        after = [job_id for job_id in line if views[job_id]["started_at"] > views[high]["started_at"]]
        # Running when it came: the first, and at most one claimed ahead as the first decoded.
        assert len(after) >= len(line) - 2, [views[job_id]["started_at"] for job_id in line]
        assert views[high]["model_load"]["source"] == "disk"
    finally:
        assert worker.stop() == 0, worker.output()


def test_a_job_of_a_dead_worker_runs_again_on_another_and_a_deadline_expires_on_the_other_line(
        client: FlaskClient, two_models: Settings, tmp_path: Path) -> None:
    first = worker_of(two_models, tmp_path, "first")
    try:
        long = post_job(client, model="xl", seed=5, width=256, height=256, steps=100).get_json()["id"]
        wait_for(lambda: (client.get(f"/v1/jobs/{long}").get_json()["progress"] or {}).get("step", 0) >= 2,
                 what="the xl job to run")
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.stop()
    # While no worker lives, a job of the other line with a deadline waits, and expires when it passes.
    doomed = post_job(client, model="sd", deadline_s=1, **SMALL).get_json()["id"]
    second = worker_of(two_models, tmp_path, "second")
    try:
        assert wait_for_status(client, doomed, "expired", "succeeded")["status"] == "expired"
        view = wait_for_status(client, long, "succeeded", "failed", timeout=240)
        assert (view["status"], view["attempt"], view["worker"]) == ("succeeded", 2, "second"), view
    finally:
        assert second.stop() == 0, second.output()


@pytest.mark.parametrize(("setting", "says"), [
    ({"offload": "model"}, "offload=model (SLOTQ_OFFLOAD or the model's sidecar \"memory\") moves weights"),
    ({"quantize": "bnb-4bit"}, "quantize=bnb-4bit (SLOTQ_QUANTIZE or the model's sidecar \"memory\") runs on "
                               "CUDA only"),
])
def test_a_memory_setting_the_device_cannot_do_stops_the_worker_at_start_saying_why(
        two_models: Settings, tmp_path: Path, setting: dict[str, str], says: str) -> None:
    worker = start_worker(two_models.model_copy(update=setting), tmp_path / "refused.log", wait=False)
    assert worker.popen.wait(120) == 1
    assert says in worker.output() and "cannot start" in worker.output()
    assert "loading sd" not in worker.output()  # refused before any weight was read


def test_the_step_level_loop_takes_no_joiner_while_another_models_job_waits(
        client: FlaskClient, two_models: Settings, tmp_path: Path) -> None:
    # In the line's order across models (no affinity), so that the next claim after the loop is the
    # oldest job: the other model's.
    joining = two_models.model_copy(update={"step_scheduling": True, "max_batch": 4, "affinity_max_skip": 0,
                                            "preempt_after_s": -1})
    worker = worker_of(joining, tmp_path)
    try:
        size = {"width": 256, "height": 256}
        long = post_job(client, model="sd", seed=1, steps=100, **size).get_json()["id"]
        wait_for(lambda: (client.get(f"/v1/jobs/{long}").get_json()["progress"] or {"step": 0})["step"] >= 2,
                 what="the sd job to run")
        other = post_job(client, model="xl", seed=2, steps=4, **size).get_json()["id"]
        time.sleep(0.3)  # the loop looks at the other lines every 0.1 s
        joiner = post_job(client, model="sd", seed=3, steps=4, **size).get_json()["id"]
        assert client.get(f"/v1/jobs/{long}").get_json()["status"] == "running"  # it could have joined
        views = {job_id: wait_for_status(client, job_id, "succeeded") for job_id in (long, other, joiner)}
        # The sd job did not join the running sd batch ahead of the waiting xl job: it ran after it.
        assert views[joiner]["started_at"] > views[other]["started_at"] > views[long]["started_at"]
        assert views[joiner]["started_at"] > views[long]["finished_at"]
    finally:
        assert worker.stop() == 0, worker.output()


def workers_listed(client: FlaskClient) -> list[dict]:
    return client.get("/v1/workers").get_json()["workers"]
