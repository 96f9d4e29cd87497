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
from shared.contract.checkpoints import FolderModel, folder_models, header_names
from shared.contract.settings import Settings
from tests.conftest import (
    Process,
    app_client,
    own_database,
    post_job,
    running_worker,
    wait_for_status,
    waiting_ids,
)

DATABASE = 11  # apart from the others' (0 per test, 1 the worker, 2-3, 5-9, 13 other modules)


@pytest.fixture(scope="module")
def tiny_folder(model_cache: Path) -> Path:
    from worker.tiny.model import ensure_tiny_model

    return ensure_tiny_model(model_cache, "tiny")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, tiny_folder: Path) -> Path:
    """A folder with a tiny SD single file, a tiny diffusers folder, a pickle and a badly named file."""
    from worker.tiny.checkpoints import write_checkpoint

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
    from worker.tiny.checkpoints import write_configs

    return write_configs(tiny_folder, tmp_path_factory.mktemp("configs") / "tiny")


# --- the folder, read without torch ------------------------------------------------------------------

def test_the_folder_offers_its_safetensors_and_diffusers_folders(models_dir: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    checkpoints.listing.forget()  # read afresh, so that the skipped ones are logged
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


def _header(path: Path, *names: str) -> Path:
    """A safetensors file holding these one-number tensors, written by hand: no torch needed."""
    header = json.dumps({name: {"dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]}
                         for i, name in enumerate(names)}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4 * len(names)))
    return path


FLUX_NAMES = ("double_blocks.0.img_attn.qkv.weight", "single_blocks.0.linear1.weight", "img_in.weight",
              "final_layer.linear.weight")


def test_the_header_tells_a_flux_transformer(tmp_path: Path, model_cache: Path,
                                             caplog: pytest.LogCaptureFixture) -> None:
    from worker.tiny.checkpoints import write_checkpoint
    from worker.tiny.model import ensure_tiny_model

    write_checkpoint(ensure_tiny_model(model_cache, "tiny-flux"), tmp_path / "tiny-flux.safetensors")
    _header(tmp_path / "bfl.safetensors", *FLUX_NAMES)
    _header(tmp_path / "comfy.safetensors", *(f"model.diffusion_model.{name}" for name in FLUX_NAMES))
    # A full Flux checkpoint (transformer, VAE, text encoders in one file): rare, not loaded.
    _header(tmp_path / "full.safetensors", *(f"model.diffusion_model.{name}" for name in FLUX_NAMES),
            "vae.decoder.conv_in.weight", "cond_stage_model.transformer.text_model.final_layer_norm.weight")
    with caplog.at_level(logging.WARNING):
        models = folder_models(tmp_path)
    assert {name: model.family for name, model in models.items()} == {
        "bfl": "flux", "comfy": "flux", "tiny-flux": "flux"}
    assert "full.safetensors: a Flux file with 2 weights outside a FLUX.1 transformer" in caplog.text
    assert "a full Flux checkpoint" in caplog.text


def _gguf(path: Path, *names: str) -> Path:
    """A GGUF file written by hand: metadata of three kinds (a string, a number, an array of strings),
    then each one-number tensor's name, shape, type (float32) and offset, then the numbers."""
    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value.encode())) + value.encode()

    header = struct.pack("<4sIQQ", b"GGUF", 3, len(names), 3)
    header += text("general.architecture") + struct.pack("<I", 8) + text("flux")
    header += text("general.quantization_version") + struct.pack("<II", 4, 2)
    header += text("tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2) + text("a") + text("b")
    for index, name in enumerate(names):
        header += text(name) + struct.pack("<IQIQ", 1, 1, 0, 32 * index)
    path.write_bytes(header + bytes(32 * len(names)))
    return path


def test_a_gguf_file_is_offered_as_a_flux_transformer_only(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    _gguf(tmp_path / "flux-q8.gguf", *FLUX_NAMES)
    (tmp_path / "flux-q8.json").write_text(json.dumps({"memory": {"offload": "model"}}))
    _gguf(tmp_path / "llama.gguf", "blk.0.attn_q.weight", "token_embd.weight")
    _gguf(tmp_path / "sd.gguf", "cond_stage_model.transformer.text_model.final_layer_norm.weight")
    (tmp_path / "cut.gguf").write_bytes(_gguf(tmp_path / "whole.gguf", *FLUX_NAMES).read_bytes()[:60])
    (tmp_path / "whole.gguf").unlink()
    with caplog.at_level(logging.WARNING):
        models = folder_models(tmp_path)
    assert list(models) == ["flux-q8"]
    assert (models["flux-q8"].family, models["flux-q8"].memory) == ("flux", {"offload": "model"})
    assert header_names(tmp_path / "flux-q8.gguf") == list(FLUX_NAMES)
    assert "llama.gguf: not an SD or SDXL checkpoint in the single-file layout, nor a FLUX.1" in caplog.text
    assert "sd.gguf: a GGUF file of sd: GGUF files are loaded as FLUX.1 transformers only" in caplog.text
    assert "cut.gguf: not a readable GGUF file" in caplog.text


@pytest.fixture
def sidecar_dir(tmp_path: Path) -> Path:
    """A folder with a model file, a diffusers folder (their layout only) and a VAE file, no sidecar yet."""
    _header(tmp_path / "file.safetensors", "cond_stage_model.transformer.text_model.final_layer_norm.weight")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    (tmp_path / "vaes").mkdir()
    _header(tmp_path / "vaes" / "ae.safetensors", "decoder.conv_in.weight", "encoder.conv_in.weight")
    return tmp_path


def test_a_sidecar_names_a_vae_file_and_memory_settings(sidecar_dir: Path) -> None:
    unsaid = folder_models(sidecar_dir)["file"]
    assert (unsaid.vae, unsaid.memory) == (None, {})
    vae = sidecar_dir / "vaes" / "ae.safetensors"
    (sidecar_dir / "file.json").write_text(json.dumps({"vae": "vaes/ae.safetensors",
                                                       "memory": {"offload": "model", "vae_tiling": True}}))
    (sidecar_dir / "folder.json").write_text(json.dumps({"vae": str(vae),
                                                         "memory": {"quantize": "bnb-4bit"}}))
    models = _read_afresh(sidecar_dir)
    assert models["file"] == FolderModel(name="file", path=sidecar_dir / "file.safetensors", family="sd",
                                         size=models["file"].size, vae=vae,
                                         memory={"offload": "model", "vae_tiling": True})
    assert (models["folder"].family, models["folder"].vae) == ("flux", vae)
    assert models["folder"].memory == {"quantize": "bnb-4bit"}
    settings = Settings(models_dir=sidecar_dir, quantize="torchao-int8", vae_slicing=True)
    memory = settings.memory_of("file")  # the service's settings under the model's own
    assert (memory.offload, memory.vae_tiling, memory.vae_slicing, memory.quantize) == (
        "model", True, True, "torchao-int8")


@pytest.mark.parametrize(("sidecar", "reason"), [
    ({"vae": "vaes/absent.safetensors"}, '"vae" {dir}/vaes/absent.safetensors: no such file'),
    ({"vae": "vaes/ae.ckpt"}, '"vae" {dir}/vaes/ae.ckpt: .ckpt files are pickles, which can run code'),
    ({"vae": "vaes/ae.bin"}, ".bin files are pickles"),
    ({"vae": "file.safetensors"}, "not a VAE (no decoder weights)"),
    ({"vae": 3}, '"vae" is not a file name: 3'),
    ({"memory": {"offload": "always"}}, '"memory" is not valid (offload: Input should be'),
    ({"memory": {"cpu_offload": True}},
     "(cpu_offload: Extra inputs are not permitted); its settings are offload, vae_slicing"),
    ({"memory": {"vae_tiling": "sometimes"}}, "vae_tiling: Input should be a valid boolean"),
    ({"memory": ["offload"]}, '"memory" is not an object'),
])
@pytest.mark.parametrize("model", ["file", "folder"])
def test_a_sidecar_with_an_unusable_vae_or_memory_makes_its_model_not_offered(
        model: str, sidecar: dict[str, object], reason: str, sidecar_dir: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    marker = sidecar_dir / "unpickled"
    (sidecar_dir / "vaes" / "ae.ckpt").write_bytes(pickle.dumps({"state_dict": _Trap(marker)}))
    (sidecar_dir / "vaes" / "ae.bin").write_bytes(pickle.dumps({"state_dict": _Trap(marker)}))
    assert model in _read_afresh(sidecar_dir)  # offered without its sidecar
    (sidecar_dir / f"{model}.json").write_text(json.dumps(sidecar))
    with caplog.at_level(logging.WARNING):
        models = _read_afresh(sidecar_dir)
    assert model not in models and len(models) == 1
    assert f"not offered: {sidecar_dir / model}.json: " in caplog.text
    assert reason.format(dir=sidecar_dir) in caplog.text
    assert not marker.exists()


def _read_afresh(models_dir: Path) -> dict[str, FolderModel]:
    """The folder's models, read again: a change within one tick of the file system's clock leaves the
    folder's mtime as it was."""
    checkpoints.listing.forget()
    return folder_models(models_dir)


class _Trap:
    """Unpickling this touches a marker file: what a malicious VAE file could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return (Path.touch, (self.marker,))


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
    url = own_database(redis_url, DATABASE)
    return Settings(redis_url=url, queue_name="folder-tests", cache_dir=model_cache, drain_s=0,
                    models_dir=models_dir, model_name="sd-file", model_names=["sd-file"],
                    checkpoint_configs={"sd": str(configs)}, device="cpu", dtype="float32", torch_threads=1)


@pytest.fixture(scope="module")
def folder_worker(folder_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(folder_settings, tmp_path_factory, "models-dir")


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
