"""Files from outside in the folders (shared/contract/checkpoints.py, controlnets.py, ip_adapters.py):
whatever a file in SLOTQ_MODELS_DIR, SLOTQ_CONTROLNET_DIR or SLOTQ_IP_ADAPTER_DIR holds, it is offered or
not offered, with one line in the log, and takes nothing else down: not the listing, not admission, not
a worker's start."""

from __future__ import annotations

import json
import logging
import os
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from shared.contract import checkpoints, controlnets, folders, ip_adapters
from shared.contract.checkpoints import MAX_NESTING, FolderModel, folder_models, nests_deeper
from shared.contract.controlnets import controlnet_paths
from shared.contract.ip_adapters import ip_adapter_paths
from shared.contract.settings import Settings
from tests.conftest import app_client, post_job, start_worker, wait_for_status

DEEP = 200_000
# An object, as a header or a sidecar must be, of 400 kB: within the bound on a sidecar's size.
DEEP_JSON = b'{"a":' + b"[" * DEEP + b"]" * DEEP + b"}"
SD_KEY = "cond_stage_model.transformer.text_model.final_layer_norm.weight"
GOOD_HEADER = json.dumps({SD_KEY: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
ROLES = ["checkpoint", "gguf", "sidecar", "model_index"]
GGUF_START = struct.pack("<4sI", b"GGUF", 3)  # then counts, metadata and tensors of any bytes
CONFIG_ROLES = ["controlnet_config", "controlnet_sidecar", "encoder_config"]
FILES = hsettings(max_examples=150, deadline=None, database=None, print_blob=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# JSON of any shape, its keys often those the readers look for.
KEYS = st.sampled_from(["family", "vae", "memory", "_class_name", "offload", "sd", "__metadata__"]) | st.text(
    max_size=10)
LEAVES = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
JSON = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(KEYS, inner, max_size=4), max_leaves=30)
CONTENTS = st.binary(max_size=400) | JSON.map(lambda value: json.dumps(value).encode())


def safetensors(header: bytes) -> bytes:
    """A safetensors file with this header (its length first) and one number."""
    return struct.pack("<Q", len(header)) + header + bytes(4)


def deep_gguf() -> bytes:
    """A GGUF file whose one metadata value is an array of arrays, DEEP levels down."""
    key = b"general.deep"
    return (GGUF_START + struct.pack("<QQ", 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * DEEP + struct.pack("<IQ", 4, 0))


def models_folder(root: Path, role: str, content: bytes) -> Path:
    """A models folder with the model "good" and, as the role says, "bad" made with this content."""
    folder = root / "models"
    folder.mkdir()
    (folder / "good.safetensors").write_bytes(safetensors(GOOD_HEADER))
    if role == "checkpoint":
        (folder / "bad.safetensors").write_bytes(safetensors(content))
    elif role == "gguf":
        (folder / "bad.gguf").write_bytes(content if content.startswith(b"GGUF") else GGUF_START + content)
    elif role == "sidecar":
        (folder / "bad.safetensors").write_bytes(safetensors(GOOD_HEADER))
        (folder / "bad.json").write_bytes(content)
    else:
        (folder / "bad").mkdir()
        (folder / "bad" / "model_index.json").write_bytes(content)
    return folder


def control_folders(root: Path, role: str, content: bytes) -> tuple[Path, Path]:
    """A ControlNet folder and an IP-Adapter folder, each offering "good" and "bad" to any model, one
    of their configurations of this content."""
    nets, adapters = root / "controlnets", root / "ip-adapters"
    for name in ("good", "bad"):
        (nets / name).mkdir(parents=True)
        (nets / name / "config.json").write_text("{}")
        (nets / name / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    (nets / "single.safetensors").write_bytes(b"")
    (adapters / "image_encoder").mkdir(parents=True)
    (adapters / "image_encoder" / "model.safetensors").write_bytes(b"")
    (adapters / "plume.safetensors").write_bytes(b"")
    written = {"controlnet_config": nets / "bad" / "config.json", "controlnet_sidecar": nets / "single.json",
               "encoder_config": adapters / "image_encoder" / "config.json"}
    (adapters / "image_encoder" / "config.json").write_text("{}")
    written[role].write_bytes(content)
    return nets, adapters


def _read_afresh(models_dir: Path) -> dict[str, FolderModel]:
    """The folder's models, every file read again (a path of a removed folder may come back within one
    tick of the file system's clock)."""
    checkpoints.listing.forget()
    folders.forget_parsed()
    return folder_models(models_dir)


def _controls_afresh(nets: Path, adapters: Path) -> tuple[set[str], set[str]]:
    controlnets.listing.forget()
    ip_adapters.listing.forget()
    return set(controlnet_paths(nets, "any")), set(ip_adapter_paths(adapters, "any"))


# --- any content ---------------------------------------------------------------------------------------

@FILES
@given(role=st.sampled_from(ROLES), content=CONTENTS)
def test_any_file_of_the_models_folder_is_offered_or_not_beside_the_good_one(role: str,
                                                                             content: bytes) -> None:
    with tempfile.TemporaryDirectory() as root:
        models = _read_afresh(models_folder(Path(root), role, content))
    assert "good" in models and set(models) <= {"good", "bad"}


@FILES
@given(role=st.sampled_from(CONFIG_ROLES), content=CONTENTS)
def test_any_configuration_of_a_controlnet_or_image_encoder_is_read_or_refused(role: str,
                                                                               content: bytes) -> None:
    """What it configures is offered where it is a JSON object within the bounds, else not."""
    with tempfile.TemporaryDirectory() as root:
        nets, adapters = _controls_afresh(*control_folders(Path(root), role, content))
    refused = set() if _bounded_object(content) else {"controlnet_config": {"bad"},
                                                        "controlnet_sidecar": {"single"},
                                                        "encoder_config": {"plume"}}[role]
    assert (nets, adapters) == ({"good", "bad", "single"} - refused, {"plume"} - refused)


def _bounded_object(content: bytes) -> bool:
    """Whether this is a JSON object nested at most MAX_NESTING deep, read the trusting way."""
    try:
        value = json.loads(content.decode("utf-8"))
    except ValueError:
        return False
    return isinstance(value, dict) and _depth(value) <= MAX_NESTING


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@hsettings(FILES, max_examples=300)
@given(value=st.recursive(LEAVES | st.just("[{\\\"]}"), lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(alphabet='[]{}"\\ab', max_size=5), inner, max_size=3),
                          max_leaves=60),
       limit=st.integers(1, 8))
def test_the_nesting_is_told_as_json_loads_would_recurse(value: Any, limit: int) -> None:
    """Brackets and escapes inside strings count for nothing; the bound is exact."""
    assert nests_deeper(json.dumps(value).encode(), limit) == (_depth(value) > limit)


# --- nested 200,000 deep -------------------------------------------------------------------------------

@pytest.mark.parametrize("role", ROLES)
def test_a_file_nested_200000_deep_is_not_offered_and_the_others_are(
        role: str, tmp_path: Path, settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    folder = models_folder(tmp_path, role, deep_gguf() if role == "gguf" else DEEP_JSON)
    with caplog.at_level(logging.WARNING):
        assert list(_read_afresh(folder)) == ["good"]
    logged = [record.getMessage() for record in caplog.records if "bad" in record.getMessage()]
    assert len(logged) == 1 and "not offered" in logged[0], logged
    assert f"deeper than {MAX_NESTING} levels" in logged[0]
    # No worker here: the synchronous surfaces admit the job, then stop waiting for it at once.
    for client in app_client(settings.model_copy(update={"models_dir": folder, "sync_wait_s": 0.1})):
        listed = [model["name"] for model in client.get("/v1/models").get_json()["models"]]
        assert "good" in listed and "bad" not in listed
        response = post_job(client, model="good")
        assert response.status_code == 202, response.get_json()
        assert post_job(client, model="bad").get_json()["error"]["code"] == "unknown_model"
        openai = client.post("/v1/images/generations",
                             json={"prompt": "a fox", "model": "good", "size": "64x64"})
        a1111 = client.post("/sdapi/v1/txt2img", json={"prompt": "a fox", "width": 64, "height": 64,
                                                       "override_settings": {"sd_model_checkpoint": "good"}})
        assert openai.status_code == 504 and openai.get_json()["error"]["code"] == "sync_wait_exceeded"
        assert a1111.status_code == 504 and a1111.get_json()["code"] == "sync_wait_exceeded"
        assert client.get("/v1/queue").get_json()["waiting"] == 3  # each surface's job, admitted


# --- files that are not regular ------------------------------------------------------------------------

def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _promptly(read: Callable[[], Any], fifo: Path) -> Any:
    """What read() returns, or the test fails if it is still reading after 5 s (blocked on the FIFO)."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(read()), daemon=True)
    thread.start()
    thread.join(5)
    if thread.is_alive():
        try:  # a writer's end opened and closed lets the blocked reader go
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        pytest.fail(f"the listing blocked on the FIFO {fifo}")
    return result[0]


@pytest.mark.parametrize("place", ["models/bad.safetensors", "models/bad.json",
                                   "models/folder/model_index.json", "controlnets/bad.safetensors",
                                   "ip-adapters/bad.safetensors"])
def test_a_fifo_is_skipped_unopened(place: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    models, nets, adapters = tmp_path / "models", tmp_path / "controlnets", tmp_path / "ip-adapters"
    models.mkdir()
    (models / "good.safetensors").write_bytes(safetensors(GOOD_HEADER))
    if place == "models/bad.json":
        (models / "bad.safetensors").write_bytes(safetensors(GOOD_HEADER))
    nets.mkdir()
    (nets / "good.safetensors").write_bytes(b"")
    (adapters / "image_encoder").mkdir(parents=True)
    (adapters / "image_encoder" / "config.json").write_text("{}")
    (adapters / "image_encoder" / "model.safetensors").write_bytes(b"")
    (adapters / "good.safetensors").write_bytes(b"")
    fifo = _fifo(tmp_path / place)
    with caplog.at_level(logging.WARNING):
        offered = _promptly(lambda: (list(_read_afresh(models)),
                                     *map(sorted, _controls_afresh(nets, adapters))), fifo)
    assert offered == (["good"], ["good"], ["good"])
    logged = [record.getMessage() for record in caplog.records if str(fifo) in record.getMessage()]
    assert len(logged) == 1 and "not a regular file" in logged[0], logged


# --- pickled weights and parsing once ------------------------------------------------------------------

def test_a_diffusers_folder_whose_weights_are_pickles_alone_is_not_offered(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folders = {
        "pickled": ["unet/diffusion_pytorch_model.bin"],
        "text-pickled": ["unet/diffusion_pytorch_model.safetensors", "text_encoder/pytorch_model.bin"],
        "both": ["unet/diffusion_pytorch_model.bin", "unet/diffusion_pytorch_model.safetensors"],
        "safe": ["unet/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"],
    }
    index = json.dumps({"_class_name": "StableDiffusionPipeline"})
    for name, files in folders.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text(index)
        for file in files:
            (tmp_path / name / file).parent.mkdir(exist_ok=True)
            (tmp_path / name / file).write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert list(_read_afresh(tmp_path)) == ["both", "safe"]
    assert f"{tmp_path / 'pickled' / 'unet'}: its weights are pickles alone" in caplog.text
    assert f"{tmp_path / 'text-pickled' / 'text_encoder'}: its weights are pickles alone" in caplog.text


def test_a_header_is_parsed_once_while_its_file_is_unchanged(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid header of 100 MB takes seconds to parse: a change of the folder reads it not again."""
    parsed: list[Path] = []
    header_names = checkpoints.header_names

    def counted(path: Path) -> list[str]:
        parsed.append(path)
        return header_names(path)

    monkeypatch.setattr(checkpoints, "header_names", counted)
    (tmp_path / "good.safetensors").write_bytes(safetensors(GOOD_HEADER))
    assert list(_read_afresh(tmp_path)) == ["good"]
    (tmp_path / "notes.txt").write_text("the folder changes")
    checkpoints.listing.forget()  # as a change of its mtime does, which may fall within one tick
    assert list(folder_models(tmp_path)) == ["good"]
    assert parsed == [tmp_path / "good.safetensors"]
    (tmp_path / "good.safetensors").write_bytes(safetensors(GOOD_HEADER + b" "))  # another version
    checkpoints.listing.forget()
    assert list(folder_models(tmp_path)) == ["good"] and len(parsed) == 2


def test_a_header_past_the_bound_is_not_offered_unread(tmp_path: Path) -> None:
    """A valid header just over MAX_HEADER_BYTES is refused by its length, before it is read: the
    listing's one parse of a file stays about a second."""
    padded = GOOD_HEADER + b" " * (checkpoints.MAX_HEADER_BYTES + 1 - len(GOOD_HEADER))
    (tmp_path / "huge.safetensors").write_bytes(safetensors(padded))
    (tmp_path / "good.safetensors").write_bytes(safetensors(GOOD_HEADER))
    assert list(_read_afresh(tmp_path)) == ["good"]


# --- a real worker -------------------------------------------------------------------------------------

@pytest.fixture
def hostile_models(tmp_path: Path, model_cache: Path) -> tuple[Path, Path]:
    """A models folder with the tiny model's single file "good", a file nested deep in each role, and
    a FIFO; and the tiny model's configs."""
    from worker.tiny.checkpoints import write_checkpoint, write_configs
    from worker.tiny.model import ensure_tiny_model

    tiny = ensure_tiny_model(model_cache, "tiny")
    folder = tmp_path / "models"
    folder.mkdir()
    good = write_checkpoint(tiny, folder / "good.safetensors")
    (folder / "deep.safetensors").write_bytes(safetensors(DEEP_JSON))
    (folder / "deep-sidecar.safetensors").write_bytes(good.read_bytes())
    (folder / "deep-sidecar.json").write_bytes(DEEP_JSON)
    (folder / "deep-index").mkdir()
    (folder / "deep-index" / "model_index.json").write_bytes(DEEP_JSON)
    _fifo(folder / "fifo.safetensors")
    return folder, write_configs(tiny, tmp_path / "configs")


def test_a_worker_whose_folder_holds_hostile_files_serves_the_good_model(
        hostile_models: tuple[Path, Path], settings: Settings, model_cache: Path, tmp_path: Path) -> None:
    folder, configs = hostile_models
    served = Settings(redis_url=settings.redis_url, queue_name="untrusted-tests", cache_dir=model_cache,
                      drain_s=0, models_dir=folder, worker_models=["*"], model_names=["good"],
                      checkpoint_configs={"sd": str(configs)}, device="cpu", dtype="float32", torch_threads=1)
    assert served.served_models == ["good"]
    worker = start_worker(served, tmp_path / "worker.log")
    try:
        for client in app_client(served):
            job_id = post_job(client, model="good", width=64, height=64, steps=2, seed=3).get_json()["id"]
            view = wait_for_status(client, job_id, "succeeded", "failed")
            assert view["status"] == "succeeded", view
    finally:
        assert worker.stop() == 0, worker.output()
