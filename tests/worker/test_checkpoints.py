"""Single-file checkpoints: written from the tiny models, loaded offline, the same weights and images."""

from __future__ import annotations

import pickle
import shutil
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint
from huggingface_hub import constants as hub_constants
from safetensors.torch import load_file, save_file

from shared.contract.jobs import JobRequest
from shared.contract.models import Family
from shared.contract.settings import CHECKPOINT_CONFIGS, Settings
from worker.checkpoints import CheckpointError, family_of_checkpoint, load_checkpoint
from worker.pipeline import ImagePipeline, load_pipeline
from worker.tiny_checkpoints import unet_to_ldm, vae_to_ldm, write_checkpoint, write_configs
from worker.tiny_model import ensure_tiny_model

FAMILIES: dict[str, Family] = {"tiny": "sd", "tiny-sdxl": "sdxl"}
Files = tuple[Path, Path, Path]  # a tiny model's diffusers folder, its single file, its configs
Pair = tuple[ImagePipeline, ImagePipeline]  # a tiny model loaded from its folder and from its file
COMPONENTS = ("unet", "vae", "text_encoder", "text_encoder_2")
REQUEST = JobRequest(prompt="a lighthouse at dusk", negative_prompt="fog", width=64, height=64, steps=2,
                     seed=7)


def _no_network(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a single-file checkpoint must load without the network")


@pytest.fixture(scope="module")
def offline() -> Any:
    """Any connection attempt fails the module's tests: loading is offline."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", _no_network)
        patch.setattr(socket, "getaddrinfo", _no_network)
        yield


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Files]:
    """Each tiny model's diffusers folder, its single file, and its configs without weights."""
    root = tmp_path_factory.mktemp("checkpoints")
    made = {}
    for name in FAMILIES:
        folder = ensure_tiny_model(root / "cache", name)
        # Configs only, as a real configuration source is: weights missing from the file cannot be
        # quietly taken from the folder (diffusers falls back to a component's folder weights).
        configs = write_configs(folder, root / f"{name}-configs")
        made[name] = (folder, write_checkpoint(folder, root / f"{name}.safetensors"), configs)
    return made


def _settings(model: str | Path, cache_dir: Path, configs: dict[Family, str] | None = None) -> Settings:
    """A worker's settings on the CPU in float32, one thread (no calibration at warm-up)."""
    return Settings(model=str(model), cache_dir=cache_dir, device="cpu", dtype="float32", torch_threads=1,
                    checkpoint_configs=configs or dict(CHECKPOINT_CONFIGS))


@pytest.fixture(scope="module")
def loaded(files: dict[str, Files], offline: None) -> dict[str, Pair]:
    """Each tiny model loaded by the worker twice: from its diffusers folder and from its single file."""
    pairs = {}
    for name, family in FAMILIES.items():
        folder, checkpoint, configs = files[name]
        cache_dir = folder.parent
        from_folder = load_pipeline(_settings(name, cache_dir))
        from_file = load_pipeline(_settings(checkpoint, cache_dir, {family: str(configs)}))
        pairs[name] = (from_folder, from_file)
    return pairs


names = pytest.mark.parametrize("name", list(FAMILIES))


@names
def test_the_family_is_read_from_the_keys(name: str, files: dict[str, Files]) -> None:
    assert family_of_checkpoint(files[name][1]) == FAMILIES[name]


@names
def test_the_file_loads_the_folders_weights_exactly(name: str, loaded: dict[str, Pair]) -> None:
    from_folder, from_file = loaded[name]
    assert type(from_file.pipe) is type(from_folder.pipe)
    assert from_file.info.family == FAMILIES[name]
    compared = 0
    for component in COMPONENTS:
        if not hasattr(from_folder.pipe, component):
            continue
        expected = getattr(from_folder.pipe, component).state_dict()
        got = getattr(from_file.pipe, component).state_dict()
        assert sorted(got) == sorted(expected), component
        unequal = [key for key in expected if not torch.equal(got[key], expected[key])]
        assert not unequal, f"{component}: {unequal[:5]}"
        compared += 1
    assert compared == (4 if name == "tiny-sdxl" else 3)


@names
def test_the_file_makes_the_folders_image(name: str, loaded: dict[str, Pair]) -> None:
    from_folder, from_file = loaded[name]
    (expected,), (got,) = from_folder.generate(REQUEST), from_file.generate(REQUEST)
    assert got.size == (64, 64)
    assert np.asarray(expected).std() > 0  # an image, not a blank
    assert np.array_equal(np.asarray(got), np.asarray(expected))


class _Trap:
    """Unpickling this touches a marker file: what a malicious .ckpt could do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("suffix", [".ckpt", ".pt", ".bin"])
def test_a_pickle_is_refused_and_never_unpickled(suffix: str, tmp_path: Path) -> None:
    marker, checkpoint = tmp_path / "unpickled", tmp_path / f"model{suffix}"
    checkpoint.write_bytes(pickle.dumps({"state_dict": _Trap(marker)}))
    with pytest.raises(CheckpointError, match="pickles, which can run code"):
        load_pipeline(_settings(checkpoint, tmp_path))
    with pytest.raises(CheckpointError, match="only .safetensors files are loaded"):
        family_of_checkpoint(checkpoint)
    assert not marker.exists()
    pickle.loads(checkpoint.read_bytes())  # the file is a live trap: unpickled, it leaves the marker
    assert marker.exists()


def test_a_file_of_no_known_family_is_refused(tmp_path: Path) -> None:
    checkpoint = tmp_path / "lora.safetensors"
    save_file({"lora_unet_down.lora_up.weight": torch.zeros(2, 2)}, str(checkpoint))
    with pytest.raises(CheckpointError, match="not an SD or SDXL checkpoint"):
        family_of_checkpoint(checkpoint)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        family_of_checkpoint(garbage)
    with pytest.raises(CheckpointError, match="no such checkpoint file"):
        family_of_checkpoint(tmp_path / "missing.safetensors")


@pytest.mark.parametrize(("left_out", "message"), [
    (".decoder.up.0.block.0.", "lacks weights of its UNet or VAE"),
    (".text_model.encoder.layers.1.", r"lacks \d+ weights of the text_encoder, such as encoder.layers.1."),
])
def test_a_file_that_lacks_weights_is_refused(left_out: str, message: str, files: dict[str, Files],
                                              tmp_path: Path, offline: None) -> None:
    _, checkpoint, configs = files["tiny"]
    state = load_file(checkpoint)
    lacking = {name: tensor for name, tensor in state.items() if left_out not in name}
    assert len(lacking) < len(state)
    save_file(lacking, str(tmp_path / "pruned.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path / "pruned.safetensors", {"sd": str(configs)}, torch.float32)


def test_a_hub_id_is_read_from_the_local_cache_only(files: dict[str, Files], tmp_path: Path,
                                                    offline: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A hub cache holding one repository's configs, as `hf download` leaves it.
    commit = "0" * 40
    repository = tmp_path / "hub" / "models--slotq--tiny-sd"
    (repository / "refs").mkdir(parents=True)
    (repository / "refs" / "main").write_text(commit)
    shutil.copytree(files["tiny"][2], repository / "snapshots" / commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    pipe = load_checkpoint(files["tiny"][1], {"sd": "slotq/tiny-sd"}, torch.float32)
    assert type(pipe).__name__ == "StableDiffusionPipeline"
    # Not in the cache: refused at once with the command that fetches it, where diffusers would download.
    with pytest.raises(CheckpointError, match="hf download slotq/not-cached"):
        load_checkpoint(files["tiny"][1], {"sd": "slotq/not-cached"}, torch.float32)


def test_the_configs_setting_reads_family_equals_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTQ_CHECKPOINT_CONFIGS", " sdxl=/configs/sdxl , sd=org/sd ")
    assert Settings().checkpoint_configs == {"sd": "org/sd", "sdxl": "/configs/sdxl",
                                             "flux": "black-forest-labs/FLUX.1-dev"}
    monkeypatch.setenv("SLOTQ_CHECKPOINT_CONFIGS", '{"sd": "org/sd"}')  # JSON, as slotq/harness.py passes it
    assert Settings().checkpoint_configs["sd"] == "org/sd"
    monkeypatch.delenv("SLOTQ_CHECKPOINT_CONFIGS")
    assert Settings().checkpoint_configs["sdxl"] == "stabilityai/stable-diffusion-xl-base-1.0"
    for bad in ("sd3=org/x", "sd", "sd="):
        monkeypatch.setenv("SLOTQ_CHECKPOINT_CONFIGS", bad)
        with pytest.raises(ValueError, match="is not family=source"):
            Settings()


def _equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> bool:
    return sorted(left) == sorted(right) and all(torch.equal(left[key], right[key]) for key in left)


def test_the_unet_mapping_is_generic_over_block_counts() -> None:
    # Three levels of two layers, attention at the bottom two and in the middle: not the tiny shape.
    config: dict[str, Any] = dict(
        block_out_channels=(8, 16, 16), layers_per_block=2, norm_num_groups=8, cross_attention_dim=8,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=2)
    torch.manual_seed(0)
    state = UNet2DConditionModel(**config).state_dict()
    ldm = {f"model.diffusion_model.{name}": tensor for name, tensor in unet_to_ldm(state, config).items()}
    assert _equal(convert_ldm_unet_checkpoint(ldm, config), state)


def test_the_vae_mapping_is_generic_over_block_counts() -> None:
    # Three levels of two layers with mid-block attention, whose projections LDM keeps as 1x1 convolutions.
    config: dict[str, Any] = dict(
        block_out_channels=(4, 8, 8), layers_per_block=2, norm_num_groups=4, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3)
    torch.manual_seed(0)
    state = AutoencoderKL(**config).state_dict()
    ldm = {f"first_stage_model.{name}": tensor for name, tensor in vae_to_ldm(state, config).items()}
    assert ldm["first_stage_model.encoder.mid.attn_1.q.weight"].ndim == 4
    assert _equal(convert_ldm_vae_checkpoint(ldm, config), state)
