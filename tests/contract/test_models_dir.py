"""The folder of models (SLOTQ_MODELS_DIR, shared/contract/checkpoints.py): what it offers at the door
without a worker, and a real worker serving a single file of it."""

from __future__ import annotations

import io
import json
import logging
import pickle
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image
from redis import Redis

from shared.contract import checkpoints
from shared.contract.checkpoints import folder_models, header_names
from shared.contract.settings import Settings
from tests.conftest import Process, app_client, post_job, start_worker, wait_for_status, waiting_ids

DATABASE = 11  # apart from the others' (0 per test, 1 the worker, 2-3, 5-9, 13 other modules)


@pytest.fixture(scope="module")
def tiny_folder(model_cache: Path) -> Path:
    from worker.tiny_model import ensure_tiny_model

    return ensure_tiny_model(model_cache, "tiny")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, tiny_folder: Path) -> Path:
    """A folder with a tiny SD single file, a tiny diffusers folder, a pickle and a badly named file."""
    from worker.tiny_checkpoints import write_checkpoint

    folder = tmp_path_factory.mktemp("models")
    write_checkpoint(tiny_folder, folder / "sd-file.safetensors")
    shutil.copytree(tiny_folder, folder / "sd-folder")
    (folder / "old.ckpt").write_bytes(pickle.dumps({"state_dict": {}}))
    shutil.copy(folder / "sd-file.safetensors", folder / "has space.safetensors")  # no job could name it
    (folder / "README.txt").write_text("not a model")
    return folder


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory, tiny_folder: Path) -> Path:
    """The tiny model's configs without its weights: where its single file takes its layout from."""
    from worker.tiny_checkpoints import write_configs

    return write_configs(tiny_folder, tmp_path_factory.mktemp("configs") / "tiny")


# --- the folder, read without torch ------------------------------------------------------------------

def test_the_folder_offers_its_safetensors_and_diffusers_folders(models_dir: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    checkpoints._listed.clear()  # read afresh, so that the skipped ones are logged
    with caplog.at_level(logging.WARNING):
        models = folder_models(models_dir)
    assert list(models) == ["sd-file", "sd-folder"]
    single, diffusers = models["sd-file"], models["sd-folder"]
    assert (single.family, single.path) == ("sd", models_dir / "sd-file.safetensors")
    assert single.size == (models_dir / "sd-file.safetensors").stat().st_size
    assert diffusers.family == "sd"
    files = (models_dir / "sd-folder").rglob("*")
    assert diffusers.size == sum(file.stat().st_size for file in files if file.is_file())
    logged = caplog.text
    assert "old.ckpt: .ckpt files are pickles, which can run code" in logged
    assert "'has space' is not a model name" in logged
    assert "README" not in logged  # not a model: no reason to give
    assert folder_models(None) == {} and folder_models(models_dir / "absent") == {}


def test_the_family_comes_from_the_keys_or_a_sidecar(tmp_path: Path, models_dir: Path) -> None:
    shutil.copy(models_dir / "sd-file.safetensors", tmp_path / "forced.safetensors")
    (tmp_path / "forced.json").write_text(json.dumps({"family": "sdxl", "description": "A1111's notes"}))
    # A header naming SDXL's second encoder, written by hand: no torch needed to make or read one.
    header = json.dumps({"__metadata__": {}, "conditioner.embedders.1.model.ln_final.weight": {
        "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "xl.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    assert header_names(tmp_path / "xl.safetensors") == ["conditioner.embedders.1.model.ln_final.weight"]
    (tmp_path / "lora.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")  # no family known
    (tmp_path / "wrong.safetensors").write_bytes(b"not a safetensors file")
    (tmp_path / "sd3.safetensors").write_bytes((tmp_path / "xl.safetensors").read_bytes())
    (tmp_path / "sd3.json").write_text(json.dumps({"family": "sd3"}))
    models = folder_models(tmp_path)
    assert {name: model.family for name, model in models.items()} == {"forced": "sdxl", "xl": "sdxl"}


# --- the door, no worker -----------------------------------------------------------------------------

@pytest.fixture
def folder_client(settings: Settings, models_dir: Path) -> Iterator[FlaskClient]:
    yield from app_client(settings.model_copy(update={"models_dir": models_dir}))


def test_the_api_lists_the_folders_models_with_family_and_size(folder_client: FlaskClient,
                                                               models_dir: Path) -> None:
    listed = {model["name"]: model for model in folder_client.get("/v1/models").get_json()["models"]}
    assert list(listed) == ["default", "sd-file", "sd-folder"]  # SLOTQ_MODEL_NAMES' first, the default
    assert listed["default"]["size"] is None
    assert listed["sd-file"]["size"] == (models_dir / "sd-file.safetensors").stat().st_size
    assert listed["sd-folder"]["size"] > listed["sd-file"]["size"] // 2
    for name in ("sd-file", "sd-folder"):
        assert (listed[name]["family"], listed[name]["workers"]) == ("sd", 0)
    spec = folder_client.get("/openapi.json").get_json()
    named = spec["components"]["schemas"]["JobRequest"]["properties"]["model"]["anyOf"][0]["enum"]
    assert named == ["default", "sd-file", "sd-folder"]


def test_a_job_for_a_model_of_the_folder_is_admitted_onto_its_line(folder_client: FlaskClient,
                                                                    settings: Settings, redis: Redis) -> None:
    response = post_job(folder_client, model="sd-file", width=64, height=64)
    assert response.status_code == 202, response.get_json()
    job_id = response.get_json()["id"]
    assert waiting_ids(redis, settings, "sd-file") == [job_id]
    assert waiting_ids(redis, settings) == []  # not the default's line


@pytest.mark.parametrize("name", ["old", "has space", "README"])
def test_a_pickle_or_another_file_is_unknown_with_nothing_stored(name: str, folder_client: FlaskClient,
                                                                 redis: Redis) -> None:
    body = post_job(folder_client, model=name).get_json()
    assert body["error"]["code"] == "unknown_model", body
    assert "sd-file, sd-folder" in body["error"]["message"]
    assert redis.keys("*") == []
    assert post_job(folder_client, model="sd-folder").status_code == 202  # the folder's are offered


def test_the_default_may_be_a_model_of_the_folder(models_dir: Path) -> None:
    chosen = Settings(models_dir=models_dir, model_names=["sd-folder", "xl=sdxl"])
    assert chosen.offered_models == {"sd-folder": "sd", "xl": "sdxl", "sd-file": "sd"}
    assert chosen.default_model == "sd-folder"
    # A worker named after a model of the folder serves it, whatever SLOTQ_MODEL says.
    worker = Settings(models_dir=models_dir, model_name="sd-file", model="tiny")
    assert worker.model == str(models_dir / "sd-file.safetensors")
    assert Settings(models_dir=models_dir, model_name="old").model == "tiny"


# --- a real worker on the folder's single file -------------------------------------------------------

@pytest.fixture(scope="module")
def folder_settings(redis_url: str, model_cache: Path, models_dir: Path, configs: Path) -> Settings:
    url = redis_url.removesuffix("/0") + f"/{DATABASE}"
    Redis.from_url(url).flushdb()
    return Settings(redis_url=url, queue_name="folder-tests", cache_dir=model_cache, drain_s=0,
                    models_dir=models_dir, model_name="sd-file", model_names=["sd-file"],
                    checkpoint_configs={"sd": str(configs)}, device="cpu", dtype="float32", torch_threads=1)


@pytest.fixture(scope="module")
def folder_worker(folder_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    process = start_worker(folder_settings, tmp_path_factory.mktemp("models-dir") / "worker.log")
    yield process
    assert process.stop() == 0, process.output()


def test_a_worker_serves_a_single_file_of_the_folder(folder_worker: Process, folder_settings: Settings,
                                                     models_dir: Path) -> None:
    for client in app_client(folder_settings):
        listed = {model["name"]: model for model in client.get("/v1/models").get_json()["models"]}
        held = listed["sd-file"]
        assert (held["workers"], held["family"]) == (1, "sd"), held
        assert held["checkpoint"] == str(models_dir / "sd-file.safetensors")
        assert held["size"] == (models_dir / "sd-file.safetensors").stat().st_size
        job_id = post_job(client, width=64, height=64, steps=2, seed=3).get_json()["id"]  # the default
        view = wait_for_status(client, job_id, "succeeded", "failed")
        assert view["status"] == "succeeded", view
        image = Image.open(io.BytesIO(client.get(view["images"][0]).data))
        assert image.size == (64, 64) and np.asarray(image).std() > 0
    assert "sd-file.safetensors" in folder_worker.output()
