"""A model's memory settings on real tiny pipelines: what the worker refuses at start on this device,
torchao's int8 denoiser, VAE slicing and tiling, and a pipeline moved to host memory and back.

This machine has no GPU: offloading is placed and removed here on the CPU as its own device (the
hooks and the weights they hold go and come back), though the worker refuses it there; bitsandbytes
needs CUDA and is only refused here.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from shared.contract.memory import MemoryOptions
from shared.contract.models import TINY_IMAGE_MODELS as TINY_MODELS
from worker.memory import MemorySettingError, check, place, unplace
from worker.tiny.model import ensure_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a device by name: check() reads its type, nothing runs on it
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install torchao)")
Load = Callable[[str], DiffusionPipeline]


@pytest.fixture
def load(model_cache: Path) -> Load:
    """A tiny model fresh from the session's cache, on the CPU, as the worker loads it."""
    def loaded(name: str) -> DiffusionPipeline:
        pipe = DiffusionPipeline.from_pretrained(ensure_tiny_model(model_cache, name), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    return loaded




def image(pipe: DiffusionPipeline, side: int = 64, seed: int = 0) -> np.ndarray:
    """One 2-step image, floats in [0, 1], height x width x 3."""
    with torch.inference_mode():
        made = pipe("a lighthouse at dusk", width=side, height=side, num_inference_steps=2,
                    generator=torch.Generator("cpu").manual_seed(seed), output_type="np")
    return made.images[0]


def weights(pipe: DiffusionPipeline) -> dict[str, torch.Tensor]:
    """Every parameter of every module of the pipeline, by component and name."""
    return {f"{component}.{name}": parameter
            for component, module in pipe.components.items() if isinstance(module, torch.nn.Module)
            for name, parameter in module.named_parameters()}


def absent(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    """find_spec answers that the package is not installed, as it does where it is not."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == package else find_spec(name, *args))


# --- what the worker refuses at start ---------------------------------------------------------


def test_the_defaults_and_the_vae_settings_pass_on_the_cpu() -> None:
    check(MemoryOptions(), CPU)
    check(MemoryOptions(vae_slicing=True, vae_tiling=True), CPU)


@pytest.mark.parametrize("offload", ["model", "sequential"])
def test_offload_is_refused_on_the_cpu_and_passes_on_cuda(offload: str) -> None:
    check(MemoryOptions(offload=offload), CUDA)  # accelerate is a worker dependency
    with pytest.raises(MemorySettingError) as refused:
        check(MemoryOptions(offload=offload), CPU)
    message = str(refused.value)
    assert isinstance(refused.value, ValueError)
    assert f"offload={offload}" in message and "SLOTQ_OFFLOAD" in message, message
    assert "this worker runs on cpu" in message and "SLOTQ_DEVICE=cuda" in message, message


def test_offload_without_accelerate_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    absent(monkeypatch, "accelerate")
    with pytest.raises(MemorySettingError, match="needs the accelerate package.*pip install accelerate"):
        check(MemoryOptions(offload="model"), CUDA)


def test_bnb_4bit_is_refused_on_the_cpu() -> None:
    with pytest.raises(MemorySettingError) as refused:
        check(MemoryOptions(quantize="bnb-4bit"), CPU)
    message = str(refused.value)
    assert "quantize=bnb-4bit" in message and "CUDA only" in message and "torchao-int8" in message, message


def test_bnb_4bit_without_bitsandbytes_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    absent(monkeypatch, "bitsandbytes")
    with pytest.raises(MemorySettingError) as refused:
        check(MemoryOptions(quantize="bnb-4bit"), CUDA)
    message = str(refused.value)
    assert "pip install bitsandbytes" in message and "CUDA only" not in message, message


def test_every_problem_is_told_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    absent(monkeypatch, "bitsandbytes")
    with pytest.raises(MemorySettingError) as refused:
        check(MemoryOptions(offload="sequential", quantize="bnb-4bit"), CPU)
    message = str(refused.value)
    assert "offload=sequential" in message and "CUDA only" in message, message
    assert "pip install bitsandbytes" in message, message


def test_torchao_int8_without_torchao_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    absent(monkeypatch, "torchao")
    with pytest.raises(MemorySettingError, match=r"quantize=torchao-int8 needs the torchao package.*"
                                                 r"pip install torchao"):
        check(MemoryOptions(quantize="torchao-int8"), CPU)


@needs_torchao
def test_torchao_int8_passes_on_the_cpu() -> None:
    check(MemoryOptions(quantize="torchao-int8"), CPU)


# --- torchao int8 --------------------------------------------------------------------------------


@needs_torchao
@pytest.mark.parametrize("offload", ["none", "model"])
@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_torchao_int8_quantizes_the_denoiser_and_survives_a_move(name: str, offload: str, load: Load) -> None:
    torchao = importlib.import_module("torchao.utils")  # untyped, and optional
    pipe = load(name)
    reference = image(pipe)
    denoiser = pipe.unet if TINY_MODELS[name] != "flux" else pipe.transformer
    size = torchao.get_model_size_in_bytes(denoiser)
    options = MemoryOptions(quantize="torchao-int8", offload=offload)

    place(pipe, CPU, options)
    linears = [module for module in denoiser.modules() if isinstance(module, torch.nn.Linear)]
    assert linears and all(isinstance(module.weight, torchao.TorchAOBaseTensor) for module in linears)
    assert torchao.get_model_size_in_bytes(denoiser) < 0.8 * size  # its Linear weights: int8 for float32
    quantized = image(pipe)
    assert quantized.shape == (64, 64, 3)
    assert np.abs(quantized - reference).max() < 0.05  # close, and not the same: it changed
    assert not np.array_equal(quantized, reference)

    unplace(pipe, options)
    place(pipe, CPU, options)  # not quantized again
    assert all(isinstance(module.weight, torchao.TorchAOBaseTensor) for module in linears)
    assert np.array_equal(image(pipe), quantized)


# --- VAE slicing and tiling -----------------------------------------------------------------------


def test_the_vae_flags_follow_the_options(load: Load) -> None:
    pipe = load("tiny")
    place(pipe, CPU, MemoryOptions(vae_slicing=True, vae_tiling=True))
    assert pipe.vae.use_slicing and pipe.vae.use_tiling
    unplace(pipe, MemoryOptions())
    place(pipe, CPU, MemoryOptions())
    assert not pipe.vae.use_slicing and not pipe.vae.use_tiling


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_a_tiled_decode_makes_nearly_the_untiled_image(name: str, load: Load) -> None:
    pipe = load(name)
    place(pipe, CPU, MemoryOptions())
    whole, another = image(pipe, 256), image(pipe, 256, seed=1)
    # 128-pixel tiles: a 256x256 image (32x32 latents) is decoded in 3x3 overlapping tiles.
    pipe.vae.tile_sample_min_size, pipe.vae.tile_latent_min_size = 128, 16
    place(pipe, CPU, MemoryOptions(vae_tiling=True))
    tiled = image(pipe, 256)
    assert tiled.shape == (256, 256, 3) and not np.isnan(tiled).any()
    assert not np.array_equal(tiled, whole)  # tiling ran: tiles decoded apart differ at their seams
    # Within a quarter of how far another seed's image lies (measured: 6-13 % of it).
    assert np.abs(tiled - whole).mean() < 0.25 * np.abs(another - whole).mean()


def test_a_sliced_decode_makes_the_same_images(load: Load) -> None:
    pipe = load("tiny")
    latents = torch.randn(2, 4, 32, 32, generator=torch.Generator("cpu").manual_seed(0))
    with torch.inference_mode():
        whole = pipe.vae.decode(latents).sample
        place(pipe, CPU, MemoryOptions(vae_slicing=True))
        sliced = pipe.vae.decode(latents).sample
    assert pipe.vae.use_slicing
    torch.testing.assert_close(sliced, whole, rtol=1e-4, atol=1e-4)


# --- moved to host memory and back ---------------------------------------------------------------


def test_unplace_and_place_without_offload(load: Load) -> None:
    pipe = load("tiny")
    place(pipe, CPU, MemoryOptions())
    reference, before = image(pipe), {name: w.detach().clone() for name, w in weights(pipe).items()}
    unplace(pipe, MemoryOptions())
    assert all(w.device == CPU for w in weights(pipe).values())
    place(pipe, CPU, MemoryOptions())
    assert all(torch.equal(w, before[name]) for name, w in weights(pipe).items())
    assert np.array_equal(image(pipe), reference)


def test_model_offload_is_placed_and_removed(load: Load) -> None:
    pipe = load("tiny")
    reference, before = image(pipe), {name: w.detach().clone() for name, w in weights(pipe).items()}
    options = MemoryOptions(offload="model")
    place(pipe, CPU, options)
    assert all(hasattr(pipe.components[name], "_hf_hook") for name in ("text_encoder", "unet", "vae"))
    assert np.array_equal(image(pipe), reference)

    unplace(pipe, options)
    assert not any(hasattr(module, "_hf_hook") for module in pipe.components.values())
    assert all(w.device == CPU and torch.equal(w, before[name]) for name, w in weights(pipe).items())
    place(pipe, CPU, MemoryOptions())
    assert np.array_equal(image(pipe), reference)


def test_sequential_offload_gives_every_weight_back(load: Load) -> None:
    pipe = load("tiny")
    reference, before = image(pipe), {name: w.detach().clone() for name, w in weights(pipe).items()}
    options = MemoryOptions(offload="sequential")
    place(pipe, CPU, options)
    # Offloaded layer by layer: the modules hold no weights, the hooks keep them in host memory.
    # (Running it on the CPU fails inside accelerate; the worker refuses it there anyway.)
    assert {w.device.type for w in weights(pipe).values()} == {"meta"}

    unplace(pipe, options)
    assert all(w.device == CPU and torch.equal(w, before[name]) for name, w in weights(pipe).items())
    place(pipe, CPU, MemoryOptions())
    assert np.array_equal(image(pipe), reference)
