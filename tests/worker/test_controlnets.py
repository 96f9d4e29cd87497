"""ControlNets: the tiny ones, the folder's listing, the LRU of loaded ones, the ControlNet pipelines made
with from_pipe over the loaded pipeline, and the canny preprocessor."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import (
    AutoPipelineForImage2Image,
    AutoPipelineForInpainting,
    DiffusionPipeline,
    MultiControlNetModel,
)
from PIL import Image, ImageDraw

from shared.contract.controlnets import available_controlnets, controlnet_paths
from shared.contract.jobs import JobKind
from worker.controlnets import ControlNets, canny, control_arguments, controlled
from worker.tiny.controlnets import CONTROLNETS, SINGLE_FILE, ensure_tiny_controlnets
from worker.tiny.model import ensure_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


VISIBLE = 0.02  # mean absolute pixel difference (pixels in [0, 1]) that no rounding noise reaches
# At scale 0 a ControlNet adds 0 x its residuals to the UNet's: measured equal to the bit on this CPU
# (float32); the bound allows another machine's kernels.
SAME = 1e-6
# One image alone or in a batch of two: the same seeded noise, but batched kernels may sum in another
# order (measured 0 on this CPU).
BATCHED = 1e-5
PROMPT = "a lighthouse on a cliff"
CLASSES = {
    "tiny": {"text": "StableDiffusionControlNetPipeline", "image": "StableDiffusionControlNetImg2ImgPipeline",
             "inpaint": "StableDiffusionControlNetInpaintPipeline"},
    "tiny-sdxl": {"text": "StableDiffusionXLControlNetPipeline",
                  "image": "StableDiffusionXLControlNetImg2ImgPipeline",
                  "inpaint": "StableDiffusionXLControlNetInpaintPipeline"},
}


@dataclass(frozen=True)
class Control:
    """A control's settings, as the job contract will carry them."""

    scale: float = 1.0
    start: float = 0.0
    end: float = 1.0




@pytest.fixture(scope="module", params=list(CLASSES))
def model(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def folder(cache: Path, model: str) -> Path:
    return ensure_tiny_controlnets(cache, model)


@pytest.fixture(scope="module")
def pipe(cache: Path, model: str) -> Any:
    """The tiny model's pipeline, loaded as the worker loads a real checkpoint."""
    pipe = DiffusionPipeline.from_pretrained(ensure_tiny_model(cache, model), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def bare(pipe: Any) -> np.ndarray:
    """The model's image before any ControlNet pipeline was made from it."""
    return generate(pipe)


@pytest.fixture(scope="module")
def nets(folder: Path, model: str, pipe: Any) -> ControlNets:
    return ControlNets(folder, model, 2, torch.device("cpu"), torch.float32, pipe.unet)


def shape(kind: str) -> Image.Image:
    """A 64 px drawing: a square or a circle, light on dark."""
    image = Image.new("RGB", (64, 64), (20, 20, 20))
    draw = ImageDraw.Draw(image)
    (draw.rectangle if kind == "square" else draw.ellipse)((16, 16, 47, 47), fill=(230, 230, 230))
    return image


SQUARE, CIRCLE = canny(shape("square")), canny(shape("circle"))


def generate(pipe: Any, *, prompts: int = 1, seeds: tuple[int, ...] = (5,), **arguments: Any) -> np.ndarray:
    """Small images of one seed each, as floats in [0, 1]; one image where one prompt."""
    # guidance_scale always: the ControlNet pipelines' defaults differ from the plain ones' (SDXL
    # inpainting: 5.0, not 7.5), as a job always gives its own.
    images = pipe([PROMPT] * prompts, height=64, width=64, num_inference_steps=2, guidance_scale=6.0,
                  output_type="np", generator=[torch.Generator().manual_seed(seed) for seed in seeds],
                  **arguments).images
    return images[0] if prompts == 1 else images


def controls(kind: JobKind, settings: list[Control], images: list[list[Image.Image]]) -> dict[str, Any]:
    """The call's arguments for these controls of a 64 px batch."""
    return control_arguments(kind, settings, images, 64, 64)


def difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).mean())


def test_a_controlnet_changes_the_image_and_follows_its_control_image(pipe: Any, nets: ControlNets,
                                                                     bare: np.ndarray) -> None:
    made = controlled(pipe, "text", [nets.get("chalk")])
    squared, circled = generate(made, image=SQUARE), generate(made, image=CIRCLE)
    assert difference(squared, bare) > VISIBLE
    assert difference(squared, circled) > VISIBLE
    # The arguments' tensor is what the pipeline makes of the image itself.
    assert np.array_equal(generate(made, **controls("text", [Control()], [[SQUARE]])), squared)
    other = generate(controlled(pipe, "text", [nets.get("ember")]), image=SQUARE)
    assert difference(squared, other) > VISIBLE


def test_at_scale_0_a_controlnet_changes_nothing(pipe: Any, nets: ControlNets, bare: np.ndarray) -> None:
    arguments = controls("text", [Control(scale=0.0)], [[SQUARE]])
    unscaled = generate(controlled(pipe, "text", [nets.get("chalk")]), **arguments)
    assert np.abs(unscaled - bare).max() <= SAME


def test_the_plain_pipeline_runs_as_before_after_a_controlled_one(pipe: Any, nets: ControlNets,
                                                                  bare: np.ndarray) -> None:
    assert difference(generate(controlled(pipe, "text", [nets.get("chalk")]), image=SQUARE), bare) > VISIBLE
    assert np.array_equal(generate(pipe), bare)
    assert not hasattr(pipe, "controlnet")


@pytest.mark.parametrize("kind", ["text", "image", "inpaint"])
def test_a_controlled_pipeline_shares_the_loaded_ones_modules(pipe: Any, nets: ControlNets, model: str,
                                                              kind: JobKind) -> None:
    chalk = nets.get("chalk")
    made = controlled(pipe, kind, [chalk])
    assert type(made).__name__ == CLASSES[model][kind]
    assert made.controlnet is chalk
    for name in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert getattr(made, name) is getattr(pipe, name), name
    if model == "tiny-sdxl":
        assert made.text_encoder_2 is pipe.text_encoder_2


@pytest.mark.parametrize("kind", ["image", "inpaint"])
def test_image_to_image_and_inpainting_take_controls(pipe: Any, nets: ControlNets, kind: JobKind) -> None:
    start = shape("circle").rotate(30)
    inputs: dict[str, Any] = {"image": start, "strength": 0.75}
    if kind == "inpaint":
        inputs["mask_image"] = Image.new("L", (64, 64), 0)
        ImageDraw.Draw(inputs["mask_image"]).rectangle((8, 8, 55, 55), fill=255)
    plain = generate((AutoPipelineForImage2Image if kind == "image" else AutoPipelineForInpainting)
                     .from_pipe(pipe), **inputs)
    made = controlled(pipe, kind, [nets.get("chalk")])
    assert difference(generate(made, **inputs, **controls(kind, [Control()], [[SQUARE]])), plain) > VISIBLE
    unscaled = generate(made, **inputs, **controls(kind, [Control(scale=0.0)], [[SQUARE]]))
    assert np.abs(unscaled - plain).max() <= SAME


def test_start_and_end_limit_the_steps_a_controlnet_acts_on(pipe: Any, nets: ControlNets,
                                                            bare: np.ndarray) -> None:
    made = controlled(pipe, "text", [nets.get("chalk")])
    whole = generate(made, **controls("text", [Control()], [[SQUARE]]))
    first_step = generate(made, **controls("text", [Control(end=0.5)], [[SQUARE]]))
    second_step = generate(made, **controls("text", [Control(start=0.5)], [[SQUARE]]))
    # Of two steps, the second, at little noise, changes the image least: about 0.005.
    assert difference(first_step, bare) > VISIBLE and difference(first_step, whole) > VISIBLE / 10
    assert difference(second_step, bare) > VISIBLE / 10 and difference(second_step, whole) > VISIBLE


def test_two_controlnets_run_together_and_batch_by_request(pipe: Any, nets: ControlNets) -> None:
    chalk, ember = nets.get("chalk"), nets.get("ember")
    both = controlled(pipe, "text", [chalk, ember])
    assert isinstance(both.controlnet, MultiControlNetModel)
    assert list(both.controlnet.nets) == [chalk, ember]
    single = generate(controlled(pipe, "text", [chalk]), image=SQUARE)
    together = generate(both, **controls("text", [Control(), Control()], [[SQUARE, CIRCLE]]))
    assert difference(together, single) > VISIBLE  # the second ControlNet acts
    # Each its own scale: the second at 0 acts not at all.
    unscaled = generate(both, **controls("text", [Control(), Control(scale=0.0)], [[SQUARE, CIRCLE]]))
    assert np.abs(unscaled - single).max() <= SAME
    settings = [Control(), Control(scale=0.5, end=0.5)]
    alone = [generate(both, seeds=(seed,), **controls("text", settings, [each]))
             for seed, each in ((5, [SQUARE, CIRCLE]), (6, [CIRCLE, SQUARE]))]
    images = [[SQUARE, CIRCLE], [CIRCLE, SQUARE]]
    batch = generate(both, prompts=2, seeds=(5, 6), **controls("text", settings, images))
    assert difference(batch[0], batch[1]) > VISIBLE
    for index, image in enumerate(alone):
        assert np.abs(batch[index] - image).max() <= BATCHED


def test_the_single_file_loads_as_the_folder_of_the_same_weights(nets: ControlNets) -> None:
    folder, single = nets.get("chalk").state_dict(), nets.get(SINGLE_FILE).state_dict()
    assert folder.keys() == single.keys()
    assert all(torch.equal(folder[key], single[key]) for key in folder)


def test_the_tiny_controlnets_zero_convolutions_are_visible(nets: ControlNets) -> None:
    chalk, ember = nets.get("chalk"), nets.get("ember")
    assert chalk.controlnet_mid_block.weight.abs().mean() > 0.5
    assert not torch.equal(chalk.controlnet_mid_block.weight, ember.controlnet_mid_block.weight)


def test_the_cache_drops_the_least_recently_used(folder: Path, model: str, pipe: Any) -> None:
    cached = ControlNets(folder, model, 2, torch.device("cpu"), torch.bfloat16, pipe.unet)
    chalk = cached.get("chalk")
    assert next(chalk.parameters()).dtype == torch.bfloat16 and chalk.device.type == "cpu"
    cached.get("ember")
    assert cached.get("chalk") is chalk and cached.loads == 2  # a hit, now the most recent
    cached.get(SINGLE_FILE)  # over capacity: ember, the least recently used, goes
    assert cached.holding == ("chalk", SINGLE_FILE) and cached.loads == 3
    cached.get("ember")
    assert cached.holding == (SINGLE_FILE, "ember") and cached.loads == 4
    with pytest.raises(FileNotFoundError, match="no ControlNet 'slate'"):
        cached.get("slate")


def touch(path: Path) -> None:
    """An empty file; a configuration an empty JSON object (an unreadable one is not offered)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"{}" if path.suffix == ".json" else b"")


def test_the_folder_offers_a_model_its_own_controlnets_and_the_top_level_ones(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("top/config.json", "top/diffusion_pytorch_model.safetensors", "flat.safetensors",
                 "old.ckpt", "pickled/config.json", "pickled/diffusion_pytorch_model.bin", "notes.txt",
                 "bad name!.safetensors", "tiny/own.safetensors", "tiny/top.safetensors",
                 "tiny-sdxl/other.safetensors", "edge/config.json",
                 "edge/diffusion_pytorch_model.safetensors"):
        touch(tmp_path / name)
    with caplog.at_level(logging.WARNING, "shared.contract.controlnets"):
        assert available_controlnets(tmp_path, "tiny") == ["edge", "flat", "own", "top"]
    assert "old.ckpt: a pickle" in caplog.text and "pickled: no .safetensors weights" in caplog.text
    assert controlnet_paths(tmp_path, "tiny")["top"] == tmp_path / "tiny" / "top.safetensors"  # its own first
    assert controlnet_paths(tmp_path, "tiny")["edge"] == tmp_path / "edge"
    assert available_controlnets(tmp_path, "tiny-sdxl") == ["edge", "flat", "other", "top"]
    # A top-level ControlNet named like a model is no folder of that model's: its weights no ControlNet.
    assert available_controlnets(tmp_path, "edge") == ["edge", "flat", "top"]
    assert available_controlnets(None, "tiny") == []
    assert available_controlnets(tmp_path / "gone", "tiny") == []
    touch(tmp_path / "tiny" / "new.safetensors")  # the model's folder changed: read again
    assert "new" in available_controlnets(tmp_path, "tiny")


def test_the_tiny_folder_lists_its_controlnets(folder: Path, model: str) -> None:
    assert available_controlnets(folder, model) == sorted([*CONTROLNETS, SINGLE_FILE])


def test_canny_draws_the_edges_white_on_black() -> None:
    edges = np.asarray(SQUARE)
    assert SQUARE.mode == "RGB" and SQUARE.size == (64, 64)
    assert (edges[18:45, 15] == 255).all() and (edges[15, 18:45] == 255).all()  # the square's sides
    assert (edges[20:44, 20:44] == 0).all() and (edges[:12, :12] == 0).all()  # inside and outside: none
    assert not np.asarray(canny(Image.new("RGB", (64, 64), (90, 140, 30)))).any()
