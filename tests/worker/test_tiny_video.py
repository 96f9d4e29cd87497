"""The tiny random video pipelines: built offline once, loaded like a real checkpoint, seeded; the
image-to-video one makes a clip of its start image."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from PIL import Image

from tests.conftest import start_image
from worker.tiny.video import TINY_VIDEO_MODELS, ensure_tiny_video_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Each tiny model's pipeline class and clip sizes (frames, height, width) it takes: the first is the
# 9-frame 64x64 clip; the second is longer and not square, at the model's own steps of size (Wan:
# 4k+1 frames, sides a multiple of 16; LTX: 8k+1 frames, sides a multiple of 32).
FAMILIES = {
    "tiny-wan": ("WanPipeline", [(9, 64, 64), (13, 48, 80)]),
    "tiny-wan-i2v": ("WanImageToVideoPipeline", [(9, 64, 64), (13, 48, 80)]),
    "tiny-ltx": ("LTXPipeline", [(9, 64, 64), (17, 64, 96)]),
}
STARTS_FROM_IMAGE = {"tiny-wan-i2v"}
CLIPS = [pytest.param(name, size, id=f"{name}-{'x'.join(map(str, size))}")
         for name, (_, sizes) in FAMILIES.items() for size in sizes]


@pytest.fixture(scope="module")
def pipes(cache: Path, offline: None) -> dict[str, Any]:
    """Each tiny video model built under the module's cache and loaded as the worker loads a real
    checkpoint, with the hub offline and any connection attempt failing."""
    loaded = {}
    with pytest.MonkeyPatch.context() as patch:
        # huggingface_hub reads HF_HUB_OFFLINE when first imported: the sockets are refused as well.
        patch.setenv("HF_HUB_OFFLINE", "1")
        for name in TINY_VIDEO_MODELS:
            folder = ensure_tiny_video_model(cache, name)
            pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
            pipe.set_progress_bar_config(disable=True)
            loaded[name] = pipe
    return loaded


def clip(pipe: Any, seed: int, frames: int = 9, height: int = 64, width: int = 64,
         image: Image.Image | None = None) -> np.ndarray:
    """A 2-step clip as float frames in [0, 1]: (videos, frames, height, width, channels). An
    image-to-video pipeline's starts from ``image``, by default a seeded picture of the clip's size."""
    generator = torch.Generator("cpu").manual_seed(seed)
    start = {}
    if type(pipe).__name__ == FAMILIES["tiny-wan-i2v"][0]:
        start["image"] = image or start_image(width, height, seed=3)
    return pipe(prompt="a red fox", num_frames=frames, height=height, width=width, num_inference_steps=2,
                generator=generator, output_type="np", **start).frames


@pytest.mark.parametrize("name", list(TINY_VIDEO_MODELS))
def test_loads_as_its_family(name: str, pipes: dict[str, Any], cache: Path) -> None:
    pipe = pipes[name]
    assert type(pipe).__name__ == FAMILIES[name][0]
    assert pipe.transformer is not None
    assert ensure_tiny_video_model(cache, name) == cache / TINY_VIDEO_MODELS[name]


@pytest.mark.parametrize(("name", "size"), CLIPS)
def test_a_clip_has_frames_of_the_asked_size(name: str, size: tuple[int, int, int],
                                                      pipes: dict[str, Any]) -> None:
    frames, height, width = size
    video = clip(pipes[name], 0, frames, height, width)
    assert isinstance(video, np.ndarray)
    assert video.shape == (1, frames, height, width, 3)
    assert 0.0 <= video.min() and video.max() <= 1.0
    assert video.std() > 0  # a picture, not one flat colour


@pytest.mark.parametrize("name", list(TINY_VIDEO_MODELS))
def test_the_same_seed_gives_the_same_frames(name: str, pipes: dict[str, Any]) -> None:
    first = clip(pipes[name], 1)
    assert np.array_equal(clip(pipes[name], 1), first)
    assert not np.array_equal(clip(pipes[name], 2), first)


@pytest.mark.parametrize("name", sorted(STARTS_FROM_IMAGE))
def test_an_image_to_video_clip_moves_with_its_start_image(name: str, pipes: dict[str, Any]) -> None:
    first = clip(pipes[name], 1)
    other = clip(pipes[name], 1, image=start_image(64, 64, seed=4))
    assert np.abs(first - other).mean() > 0.005  # a few levels of 255 (seen: 0.011)


@pytest.mark.parametrize("name", list(TINY_VIDEO_MODELS))
def test_a_second_call_writes_nothing(name: str, tmp_path: Path) -> None:
    folder = ensure_tiny_video_model(tmp_path, name)
    assert folder == tmp_path / TINY_VIDEO_MODELS[name]

    def snapshot() -> dict[str, tuple[int, bytes]]:
        return {str(p.relative_to(tmp_path)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
                for p in [folder, *folder.rglob("*")]}

    before = snapshot()
    assert any(path.endswith(".safetensors") for path in before)
    assert ensure_tiny_video_model(tmp_path, name) == folder
    assert snapshot() == before
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary folder left behind


def test_an_unknown_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-nope") as refused:
        ensure_tiny_video_model(tmp_path, "tiny-nope")
    assert all(name in str(refused.value) for name in TINY_VIDEO_MODELS)  # it names the known ones
    assert not list(tmp_path.iterdir())
