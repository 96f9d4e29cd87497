"""The tiny LoRA adapters: three per tiny model, loaded and scaled through diffusers' own LoRA API."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline

from shared.contract.models import FAMILY_SPECS, TINY_VIDEO_MODELS
from shared.contract.models import TINY_MODELS as FAMILIES
from tests.conftest import start_image
from worker.pipeline import family_of
from worker.tiny.loras import ADAPTERS, RECIPES, ensure_tiny_loras
from worker.tiny.model import TINY_MODELS, ensure_tiny_model
from worker.tiny.video import ensure_tiny_video_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


NAMES = list(ADAPTERS)
# The mean absolute pixel difference (pixels in [0, 1]) a change must pass; far above rounding noise
# (1e-5). The tiny Wan's clips are nearly flat: two of its seeds differ by about 0.003.
VISIBLE = 0.02
VISIBLE_OF = {"tiny-wan": 0.0008, "tiny-wan-i2v": 0.002}


@pytest.fixture(scope="module", params=list(RECIPES))
def model(request: pytest.FixtureRequest) -> str:
    """Each tiny model, those that make clips too."""
    return request.param


@pytest.fixture(scope="module")
def visible(model: str) -> float:
    return VISIBLE_OF.get(model, VISIBLE)


@pytest.fixture(scope="module")
def loras(cache: Path, model: str) -> Path:
    return ensure_tiny_loras(cache, model)


@pytest.fixture(scope="module")
def pipe(cache: Path, model: str, loras: Path) -> Any:
    """The tiny model's pipeline, loaded as the worker loads a real checkpoint."""
    ensure = ensure_tiny_video_model if model in TINY_VIDEO_MODELS else ensure_tiny_model
    pipe = DiffusionPipeline.from_pretrained(ensure(cache, model), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: Any) -> np.ndarray:
    """One small image (or a clip's fewest frames), the same seed every call, as floats in [0, 1]."""
    spec = FAMILY_SPECS[family_of(pipe)]
    asked: dict[str, Any] = {"num_frames": spec.frame_multiple + 1} if spec.frame_multiple else {}
    if spec.starts_from_image:
        asked["image"] = start_image(64, 64, seed=1)
    output = pipe(prompt="a lighthouse on a cliff", height=64, width=64, num_inference_steps=2,
                  output_type="np", generator=torch.Generator().manual_seed(5), **asked)
    return output.frames[0] if spec.frame_multiple else output.images[0]


@pytest.fixture(scope="module")
def bare(pipe: Any) -> np.ndarray:
    """The model's image before any adapter is loaded."""
    return generate(pipe)


@contextmanager
def adapter(pipe: Any, loras: Path, name: str) -> Iterator[Any]:
    """The pipeline with this one adapter loaded, deleted again afterwards."""
    # One at a time: a second adapter loaded beside the first makes peft warn ("Already found a
    # peft_config attribute"), which this suite's filterwarnings = error turns into a failure.
    pipe.load_lora_weights(loras, weight_name=f"{name}.safetensors", adapter_name=name)
    try:
        yield pipe
    finally:
        pipe.delete_adapters(name)


def with_scale(pipe: Any, name: str, scale: float) -> np.ndarray:
    """The image with the named adapter at this scale."""
    pipe.set_adapters([name], adapter_weights=[scale])
    return generate(pipe)


def test_each_model_has_its_own_folder_of_the_three_adapters(loras: Path, model: str) -> None:
    assert loras.name == RECIPES[model].folder
    assert sorted(path.name for path in loras.iterdir()) == ["ink.safetensors", "moss.safetensors",
                                                             "neon.safetensors"]


def test_the_sd_folder_is_unchanged_and_every_model_has_another(cache: Path) -> None:
    assert ensure_tiny_loras(cache) == cache / "tiny-sd-loras-v1"  # the default model, where it was
    folders = {ensure_tiny_loras(cache, model) for model in RECIPES}
    assert len(folders) == len(FAMILIES) and all(folder.parent == cache for folder in folders)
    assert not any(cache.glob(".*tmp*"))  # no build left a temporary folder behind


def test_a_build_is_deterministic(cache: Path, model: str, loras: Path, tmp_path: Path) -> None:
    folder = TINY_MODELS.get(model) or ensure_tiny_video_model(cache, model).name
    shutil.copytree(cache / folder, tmp_path / folder)  # the same model, not rebuilt
    again = ensure_tiny_loras(tmp_path, model)
    for name in NAMES:
        assert (again / f"{name}.safetensors").read_bytes() == (loras / f"{name}.safetensors").read_bytes()


def test_a_second_call_reuses_the_folder(cache: Path, model: str, loras: Path) -> None:
    before = (loras / "ink.safetensors").stat().st_mtime_ns
    assert ensure_tiny_loras(cache, model) == loras
    assert (loras / "ink.safetensors").stat().st_mtime_ns == before


@pytest.mark.parametrize("name", NAMES)
def test_an_adapter_changes_the_image_and_at_scale_0_is_the_bare_model(pipe: Any, bare: np.ndarray,
                                                                       loras: Path, name: str,
                                                                       visible: float) -> None:
    with adapter(pipe, loras, name):
        changed = with_scale(pipe, name, 1.0)
        assert np.abs(changed - bare).mean() > visible, "the adapter barely changes the image"
        assert np.allclose(with_scale(pipe, name, 0.0), bare, atol=1e-5)
        half = with_scale(pipe, name, 0.5)  # short of saturation: half a scale is its own image
        assert np.abs(half - bare).mean() > visible / 2 and np.abs(half - changed).mean() > visible / 2
    assert np.array_equal(generate(pipe), bare)  # deleted, it leaves the model as it was


def test_each_adapter_changes_the_image_its_own_way(pipe: Any, loras: Path, visible: float) -> None:
    images = []
    for name in NAMES:
        with adapter(pipe, loras, name):
            images.append(with_scale(pipe, name, 1.0))
    for i, first in enumerate(images):
        for second in images[i + 1:]:
            assert np.abs(first - second).mean() > visible


def test_an_unknown_model_has_no_adapters(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny model 'tiny-sd3'"):
        ensure_tiny_loras(tmp_path, "tiny-sd3")
    assert not any(tmp_path.iterdir())
