"""The tiny random pipelines: built offline, loaded like a real checkpoint, usable for every task."""

from __future__ import annotations

import inspect
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting, DiffusionPipeline
from PIL import Image, ImageDraw

from worker.tiny.files import write_once
from worker.tiny.model import TINY_MODELS, ensure_tiny_model

# Each tiny model's pipeline class and the attribute that holds its denoiser.
FAMILIES = {
    "tiny": ("StableDiffusionPipeline", "unet"),
    "tiny-sdxl": ("StableDiffusionXLPipeline", "unet"),
    "tiny-flux": ("FluxPipeline", "transformer"),
}
names = pytest.mark.parametrize("name", list(TINY_MODELS))


def _no_network(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("the tiny models must not touch the network")


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Offline mode for the hub, and any connection attempt fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads HF_HUB_OFFLINE when first imported, so refuse sockets as well.
    monkeypatch.setattr(socket.socket, "connect", _no_network)
    monkeypatch.setattr(socket, "getaddrinfo", _no_network)


def load(folder: Path) -> Any:
    """Load a tiny model exactly as the worker loads a real checkpoint."""
    pipe = DiffusionPipeline.from_pretrained(folder, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def pipe(name: str, tmp_path: Path, offline: None) -> Any:
    return load(ensure_tiny_model(tmp_path, name))


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def start_image() -> Image.Image:
    """A 256x256 RGB start image with some structure for img2img and inpainting."""
    image = Image.new("RGB", (256, 256), (200, 80, 40))
    ImageDraw.Draw(image).ellipse((40, 40, 216, 216), fill=(30, 90, 220))
    return image


def derived(auto: Any, pipe: Any) -> Any:
    """The img2img or inpainting pipeline that shares pipe's components."""
    other = auto.from_pipe(pipe)
    other.set_progress_bar_config(disable=True)  # from_pipe does not carry the progress bar config
    return other


def size_kwargs(other: Any, side: int) -> dict[str, int]:
    """width/height when the call takes them: Flux's img2img would otherwise make 1024x1024."""
    accepted = inspect.signature(other.__call__).parameters
    return {"width": side, "height": side} if "width" in accepted else {}


@names
def test_builds_once_and_loads_as_its_family(name: str, tmp_path: Path, offline: None) -> None:
    folder = ensure_tiny_model(tmp_path, name)
    assert folder == tmp_path / TINY_MODELS[name]
    stamp = (folder / "model_index.json").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path, name) == folder  # a second call reuses the folder
    assert (folder / "model_index.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # no temporary folder left behind
    pipe_class, denoiser = FAMILIES[name]
    loaded = load(folder)
    assert type(loaded).__name__ == pipe_class
    assert getattr(loaded, denoiser) is not None
    assert loaded.vae_scale_factor == 8


def test_default_name_is_the_tiny_sd_model(tmp_path: Path, offline: None) -> None:
    assert ensure_tiny_model(tmp_path) == tmp_path / "tiny-sd-v1"


def test_an_unknown_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-nope"):
        ensure_tiny_model(tmp_path, "tiny-nope")
    assert not list(tmp_path.iterdir())


@names
def test_a_build_is_deterministic(name: str, tmp_path: Path, offline: None) -> None:
    first, second = ensure_tiny_model(tmp_path / "a", name), ensure_tiny_model(tmp_path / "b", name)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file()) == files
    assert any(p.suffix == ".safetensors" for p in files)
    for path in files:
        assert (first / path).read_bytes() == (second / path).read_bytes(), path


def test_write_once_shows_the_folder_only_when_whole(tmp_path: Path) -> None:
    final = tmp_path / "cache" / "built"

    def write(folder: Path) -> None:
        assert not final.exists()  # a reader meanwhile finds nothing, not half a folder
        (folder / "part").mkdir()
        (folder / "part" / "weights").write_text("w")

    assert write_once(final, write) == final
    assert (final / "part" / "weights").read_text() == "w"
    assert [p.name for p in final.parent.iterdir()] == ["built"]  # no temporary folder left behind
    assert write_once(final, lambda folder: pytest.fail("a whole folder is built again")) == final


def test_write_once_takes_the_folder_of_a_builder_that_won_the_race(tmp_path: Path) -> None:
    final = tmp_path / "built"

    def write(folder: Path) -> None:
        (folder / "mine").write_text("loser")
        final.mkdir()  # another builder renames its whole folder into place first
        (final / "theirs").write_text("winner")

    assert write_once(final, write) == final
    assert [p.name for p in final.iterdir()] == ["theirs"]
    assert [p.name for p in tmp_path.iterdir()] == ["built"]


def test_write_once_with_two_builders_at_once_keeps_one_whole_folder(tmp_path: Path) -> None:
    final, both_built = tmp_path / "built", threading.Barrier(2, timeout=10)
    results: list[Path] = []
    errors: list[BaseException] = []

    def write(folder: Path) -> None:
        for index in range(3):
            (folder / f"file-{index}").write_text(threading.current_thread().name)
        both_built.wait()  # both rename after both have built: one of them loses the race

    def build() -> None:
        try:
            results.append(write_once(final, write))
        except BaseException as exc:  # reported below, where the test can fail on it
            errors.append(exc)

    threads = [threading.Thread(target=build, name=f"builder-{n}") for n in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert (errors, results) == ([], [final, final])
    assert {(final / f"file-{index}").read_text() for index in range(3)} in ({"builder-0"}, {"builder-1"})
    assert [p.name for p in tmp_path.iterdir()] == ["built"]


def test_write_once_cleans_up_a_failed_build(tmp_path: Path) -> None:
    final = tmp_path / "built"

    def write(folder: Path) -> None:
        (folder / "half").write_text("h")
        raise RuntimeError("the build broke")

    with pytest.raises(RuntimeError, match="the build broke"):
        write_once(final, write)
    assert list(tmp_path.iterdir()) == []


def test_write_once_refuses_an_incomplete_folder_in_the_way(tmp_path: Path) -> None:
    final = tmp_path / "built"
    final.mkdir()
    (final / "leftover").write_text("x")  # no marker: not a whole build, and never taken for one

    def marked(folder: Path) -> bool:
        return (folder / "marker").is_file()

    with pytest.raises(OSError):
        write_once(final, lambda folder: (folder / "marker").write_text("m"), marked)
    assert [p.name for p in tmp_path.iterdir()] == ["built"]
    assert [p.name for p in final.iterdir()] == ["leftover"]


@names
def test_text_to_image(name: str, pipe: Any) -> None:
    image = pipe("a red fox", num_inference_steps=2, width=64, height=64).images[0]
    assert isinstance(image, Image.Image)
    assert (image.size, image.mode) == ((64, 64), "RGB")


@names
def test_the_same_seed_gives_the_same_pixels(name: str, pipe: Any) -> None:
    def run(seed: int) -> np.ndarray:
        generator = torch.Generator("cpu").manual_seed(seed)
        return pixels(pipe("a red fox", num_inference_steps=2, width=64, height=64,
                           generator=generator).images[0])

    first = run(1)
    assert np.array_equal(run(1), first)
    assert not np.array_equal(run(2), first)


@names
def test_image_to_image_shares_weights_and_keeps_the_size(name: str, pipe: Any) -> None:
    img2img = derived(AutoPipelineForImage2Image, pipe)
    denoiser = FAMILIES[name][1]
    assert getattr(img2img, denoiser) is getattr(pipe, denoiser)
    totals: list[int] = []

    def step_end(p: Any, step: int, timestep: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        totals.append(p.num_timesteps)
        return kwargs

    start = start_image()
    image = img2img("a red fox", image=start, strength=0.5, num_inference_steps=4,
                    callback_on_step_end=step_end, **size_kwargs(img2img, 256)).images[0]
    assert image.size == (256, 256)
    # strength 0.5 runs half of the 4 steps, and num_timesteps already says so during the call.
    assert totals == [2, 2]


@names
def test_inpainting_keeps_the_size_and_repaints(name: str, pipe: Any) -> None:
    inpaint = derived(AutoPipelineForInpainting, pipe)
    assert getattr(inpaint, FAMILIES[name][1]) is getattr(pipe, FAMILIES[name][1])
    mask = Image.new("L", (256, 256), 0)  # black: keep
    ImageDraw.Draw(mask).rectangle((64, 64, 191, 191), fill=255)  # white: repaint
    start = start_image()
    image = inpaint("a red fox", image=start, mask_image=mask, strength=0.5, num_inference_steps=4,
                    width=256, height=256).images[0]
    assert image.size == (256, 256)
    assert not np.array_equal(pixels(image), pixels(start))


@pytest.mark.parametrize("name", ["tiny-flux"])
def test_flux_takes_guidance_as_an_input(name: str, pipe: Any) -> None:
    # guidance_embeds=True, as in FLUX.1-dev: guidance_scale changes the image without CFG.
    def run(guidance: float) -> np.ndarray:
        generator = torch.Generator("cpu").manual_seed(0)
        return pixels(pipe("a red fox", num_inference_steps=2, width=64, height=64,
                           guidance_scale=guidance, generator=generator).images[0])

    assert not np.array_equal(run(1.0), run(5.0))
