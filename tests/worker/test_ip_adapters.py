"""IP-Adapters: the tiny ones, the folder's listing, the adapters and image encoder on a loaded pipeline,
the arguments of a batch's reference images, and the image-to-image and inpainting twins."""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import AutoPipelineForImage2Image, AutoPipelineForInpainting, DiffusionPipeline
from PIL import Image, ImageDraw
from safetensors.torch import load_file

from shared.contract.ip_adapters import available_ip_adapters, image_encoder_path, ip_adapter_paths
from worker.ip_adapters import IpAdapters, ip_adapter_arguments, share_image_encoder
from worker.tiny.ip_adapters import IP_ADAPTERS, ensure_tiny_ip_adapters
from worker.tiny.model import ensure_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Mean absolute pixel difference (pixels in [0, 1]) that no rounding noise reaches. Measured at scale 1: an
# adapter moves the image by 0.10, plume's and slate's images are 0.10 apart, the square's and the
# circle's references give images 0.08 apart (SD and SDXL alike).
VISIBLE = 0.02
# At scale 0 diffusers skips the adapter's attention: measured equal to the bit on this CPU (float32); the
# bound allows another machine's kernels.
SAME = 1e-6
# One image alone or in a batch: the same seeded noise, but batched kernels may sum in another order
# (measured 1.6e-6 on this CPU).
BATCHED = 1e-5
PROMPT = "a lighthouse on a cliff"
VARIANTS = {"image": AutoPipelineForImage2Image, "inpaint": AutoPipelineForInpainting}


@pytest.fixture(scope="module", params=["tiny", "tiny-sdxl"])
def model(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def folder(cache: Path, model: str) -> Path:
    return ensure_tiny_ip_adapters(cache, model)


def load_pipe(cache: Path, model: str) -> Any:
    """The tiny model's pipeline, loaded as the worker loads a real checkpoint."""
    pipe = DiffusionPipeline.from_pretrained(ensure_tiny_model(cache, model), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(cache: Path, model: str) -> Any:
    return load_pipe(cache, model)


@pytest.fixture(scope="module")
def bare(pipe: Any) -> np.ndarray:
    """The model's image before any IP-Adapter was loaded."""
    return generate(pipe)


@pytest.fixture(scope="module")
def adapters(folder: Path, model: str, pipe: Any, bare: np.ndarray) -> IpAdapters:
    return IpAdapters(folder, model, 2)  # made after ``bare``: no adapter touched that image


def shape(kind: str, fill: tuple[int, int, int], ground: tuple[int, int, int]) -> Image.Image:
    """A 64 px drawing: a square or a circle on a plain ground."""
    image = Image.new("RGB", (64, 64), ground)
    draw = ImageDraw.Draw(image)
    (draw.rectangle if kind == "square" else draw.ellipse)((16, 16, 47, 47), fill=fill)
    return image


SQUARE = shape("square", (230, 230, 230), (20, 20, 20))
CIRCLE = shape("circle", (200, 40, 40), (240, 220, 120))


def generate(pipe: Any, *, prompts: int = 1, seeds: tuple[int, ...] = (5,), per_prompt: int = 1,
             **arguments: Any) -> np.ndarray:
    """Small images of one seed each, as floats in [0, 1]; one image where one."""
    images = pipe([PROMPT] * prompts, height=64, width=64, num_inference_steps=2, guidance_scale=6.0,
                  num_images_per_prompt=per_prompt, output_type="np",
                  generator=[torch.Generator().manual_seed(seed) for seed in seeds], **arguments).images
    return images[0] if len(images) == 1 else images


def references(*images: Image.Image, per_request: int = 1) -> dict[str, Any]:
    """The call's arguments for these reference images of a 64 px, guided batch."""
    return ip_adapter_arguments(list(images), width=64, height=64, per_request=per_request)


def encoder_weights(folder: Path, model: str) -> Path:
    path = image_encoder_path(folder, model)
    assert path is not None, f"no image encoder for {model} in {folder}"
    return path / "model.safetensors"


def difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).mean())


def test_an_ip_adapter_changes_the_image_and_follows_its_reference(pipe: Any, adapters: IpAdapters,
                                                                    bare: np.ndarray) -> None:
    adapters.use(pipe, "plume", 1.0)
    squared, circled = generate(pipe, **references(SQUARE)), generate(pipe, **references(CIRCLE))
    assert difference(squared, bare) > VISIBLE
    assert difference(squared, circled) > VISIBLE
    assert np.array_equal(generate(pipe, ip_adapter_image=SQUARE), squared)  # diffusers' own argument
    adapters.use(pipe, "slate", 1.0)
    assert difference(generate(pipe, **references(SQUARE)), squared) > VISIBLE


def test_at_scale_0_an_ip_adapter_changes_nothing(pipe: Any, adapters: IpAdapters, bare: np.ndarray) -> None:
    adapters.use(pipe, "plume", 1.0)
    assert difference(generate(pipe, **references(SQUARE)), bare) > VISIBLE
    adapters.use(pipe, "plume", 0.0)
    assert np.abs(generate(pipe, **references(SQUARE)) - bare).max() <= SAME
    adapters.use(pipe, "plume", 0.5)  # a scale in between: the reference acts, less
    half = difference(generate(pipe, **references(SQUARE)), bare)
    adapters.use(pipe, "plume", 1.0)
    assert VISIBLE / 4 < half < difference(generate(pipe, **references(SQUARE)), bare)


def test_without_an_ip_adapter_the_pipeline_makes_the_bare_image_again(pipe: Any, adapters: IpAdapters,
                                                                        bare: np.ndarray) -> None:
    adapters.use(pipe, "slate", 1.0)
    assert difference(generate(pipe, **references(CIRCLE)), bare) > VISIBLE
    loads = adapters.loads
    adapters.use(pipe, None, 1.0)
    assert adapters.active is None and pipe.unet.encoder_hid_proj is None
    assert np.array_equal(generate(pipe), bare)  # no reference image asked for, the image to the bit
    adapters.use(pipe, "slate", 1.0)  # back from memory, not from disk
    assert adapters.loads == loads and difference(generate(pipe, **references(CIRCLE)), bare) > VISIBLE


def test_a_batch_gives_each_request_the_image_of_its_own_reference(pipe: Any, adapters: IpAdapters) -> None:
    adapters.use(pipe, "plume", 1.0)
    alone = [generate(pipe, seeds=(5,), **references(SQUARE)),
             generate(pipe, seeds=(6,), **references(CIRCLE))]
    batch = generate(pipe, prompts=2, seeds=(5, 6), **references(SQUARE, CIRCLE))
    assert difference(batch[0], batch[1]) > VISIBLE
    for index, image in enumerate(alone):
        assert np.abs(batch[index] - image).max() <= BATCHED
    # Without the masks diffusers gives every prompt both references: neither request's image.
    mixed = generate(pipe, prompts=2, seeds=(5, 6), ip_adapter_image=[[SQUARE, CIRCLE]])
    assert difference(mixed[0], alone[0]) > VISIBLE and difference(mixed[1], alone[1]) > VISIBLE
    same = generate(pipe, prompts=2, seeds=(5, 6), **references(SQUARE, SQUARE.copy()))
    assert np.abs(same[0] - alone[0]).max() <= BATCHED


def test_a_batch_of_several_images_per_request_keeps_each_requests_reference(pipe: Any,
                                                                             adapters: IpAdapters) -> None:
    adapters.use(pipe, "plume", 1.0)
    alone = [generate(pipe, seeds=(5, 6), per_prompt=2, **references(SQUARE, per_request=2)),
             generate(pipe, seeds=(7, 8), per_prompt=2, **references(CIRCLE, per_request=2))]
    batch = generate(pipe, prompts=2, seeds=(5, 6, 7, 8), per_prompt=2,
                     **references(SQUARE, CIRCLE, per_request=2))
    assert np.abs(batch[:2] - alone[0]).max() <= BATCHED and np.abs(batch[2:] - alone[1]).max() <= BATCHED


def test_the_arguments_mask_each_row_of_the_batch_to_its_requests_reference() -> None:
    assert references(SQUARE, SQUARE.copy()) == {"ip_adapter_image": [[SQUARE]]}  # one reference: no mask
    arguments: dict[str, Any] = ip_adapter_arguments([SQUARE, CIRCLE, SQUARE], width=96, height=64,
                                                     per_request=2, guided=False)
    assert arguments["ip_adapter_image"] == [[SQUARE, CIRCLE]]
    (mask,) = arguments["cross_attention_kwargs"]["ip_adapter_masks"]
    assert mask.shape == (6, 2, 8, 12)  # a row per image, a slot per distinct reference, the latents' size
    assert mask[:, 1, 0, 0].tolist() == [0, 0, 1, 1, 0, 0] and (mask.sum(dim=1) == 1).all()
    guided = references(SQUARE, CIRCLE)["cross_attention_kwargs"]["ip_adapter_masks"][0]
    assert guided[:, 0, 0, 0].tolist() == [1, 0, 1, 0]  # the unconditional rows first, then the same again
    with pytest.raises(ValueError, match="needs a reference image"):
        references()


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_a_twin_runs_with_the_ip_adapter_once_given_the_image_encoder(pipe: Any, adapters: IpAdapters,
                                                                      kind: str) -> None:
    inputs: dict[str, Any] = {"image": shape("circle", (90, 140, 30), (10, 10, 60)), "strength": 0.75}
    if kind == "inpaint":
        inputs["mask_image"] = Image.new("L", (64, 64), 0)
        ImageDraw.Draw(inputs["mask_image"]).rectangle((8, 8, 55, 55), fill=255)
    adapters.use(pipe, None, 1.0)
    twin = VARIANTS[kind].from_pipe(pipe)
    twin.set_progress_bar_config(disable=True)
    plain = generate(twin, **inputs)
    adapters.use(pipe, "plume", 1.0)
    assert twin.unet is pipe.unet and twin.image_encoder is None  # from_pipe copied the components then
    share_image_encoder(pipe, twin)
    assert twin.image_encoder is adapters.encoder and twin.feature_extractor is pipe.feature_extractor
    assert difference(generate(twin, **inputs, **references(SQUARE)), plain) > VISIBLE
    adapters.use(pipe, "plume", 0.0)
    assert np.abs(generate(twin, **inputs, **references(SQUARE)) - plain).max() <= SAME
    later = VARIANTS[kind].from_pipe(pipe)  # made after the load: it has the encoder already
    assert later.image_encoder is adapters.encoder


def test_the_weights_and_the_image_encoder_are_read_from_disk(cache: Path, folder: Path, model: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def no_network(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("IP-Adapters reached for the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    fresh = load_pipe(cache, model)
    offline = IpAdapters(folder, model, 2)
    offline.use(fresh, "plume", 1.0)
    assert offline.loads == 1 and offline.holding == ("plume",)
    written = load_file(ip_adapter_paths(folder, model)["plume"])
    crossing = [processor for name, processor in fresh.unet.attn_processors.items()
                if name.endswith("attn2.processor")]
    last = 2 * len(crossing) - 1  # diffusers' numbers: 1, 3, 5...
    assert torch.equal(crossing[0].to_k_ip[0].weight, written["ip_adapter.1.to_k_ip.weight"])
    assert torch.equal(crossing[-1].to_v_ip[0].weight, written[f"ip_adapter.{last}.to_v_ip.weight"])
    projection = fresh.unet.encoder_hid_proj.image_projection_layers[0]
    assert torch.equal(projection.image_embeds.weight, written["image_proj.proj.weight"])
    encoder = load_file(encoder_weights(folder, model))
    assert fresh.image_encoder is offline.encoder
    assert all(torch.equal(tensor, encoder[key]) for key, tensor in fresh.image_encoder.state_dict().items())
    size = fresh.image_encoder.config.image_size
    assert fresh.feature_extractor.crop_size["height"] == size  # of the encoder's images, not CLIP's 224
    assert crossing[0].to_v_ip[0].weight.abs().mean() > 0.5  # made visible: a trained one starts at 0


def test_the_memory_keeps_the_most_recently_used(folder: Path, model: str, cache: Path) -> None:
    fresh = load_pipe(cache, model)
    kept = IpAdapters(folder, model, 1)
    kept.use(fresh, "plume", 1.0)
    kept.use(fresh, "slate", 1.0)  # over capacity: plume goes
    assert kept.holding == ("slate",) and kept.loads == 2 and kept.active == "slate"
    kept.use(fresh, "slate", 0.5)
    assert kept.loads == 2
    kept.use(fresh, "plume", 1.0)
    assert kept.holding == ("plume",) and kept.loads == 3
    two = IpAdapters(folder, model, 2)
    for name in ("plume", "slate", "plume"):
        two.use(fresh, name, 1.0)
    assert two.holding == ("slate", "plume") and two.loads == 2
    with pytest.raises(FileNotFoundError, match="no IP-Adapter 'chalk'"):
        two.use(fresh, "chalk", 1.0)
    with pytest.raises(FileNotFoundError, match="no IP-Adapter 'plume' for tiny-flux"):  # none made for it
        IpAdapters(folder, "tiny-flux", 1).use(fresh, "plume", 1.0)


def test_the_tiny_build_is_deterministic(folder: Path, model: str, tmp_path: Path) -> None:
    again = ensure_tiny_ip_adapters(tmp_path, model)
    assert available_ip_adapters(folder, model) == sorted(IP_ADAPTERS) == available_ip_adapters(again, model)
    for name, path in ip_adapter_paths(folder, model).items():
        assert path.read_bytes() == ip_adapter_paths(again, model)[name].read_bytes(), name
    assert image_encoder_path(folder, model) == folder / "image_encoder"  # shared by both tiny models
    written, rebuilt = load_file(encoder_weights(folder, model)), load_file(encoder_weights(again, model))
    assert written.keys() == rebuilt.keys()
    assert all(torch.equal(written[key], rebuilt[key]) for key in written)


def touch(path: Path) -> None:
    """An empty file; a configuration an empty JSON object (an unreadable one is not offered)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"{}" if path.suffix == ".json" else b"")


def test_the_folder_offers_a_model_its_own_ip_adapters_and_the_top_level_ones(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for name in ("image_encoder/config.json", "image_encoder/model.safetensors", "flat.safetensors",
                 "old.bin", "notes.txt", "bad name!.safetensors", "tiny/own.safetensors",
                 "tiny/flat.safetensors", "tiny/older.ckpt", "tiny-sdxl/image_encoder/config.json",
                 "tiny-sdxl/image_encoder/model.safetensors", "tiny-sdxl/other.safetensors",
                 "pickled/image_encoder/config.json", "pickled/image_encoder/pytorch_model.bin"):
        touch(tmp_path / name)
    with caplog.at_level(logging.WARNING, "shared.contract.ip_adapters"):
        assert available_ip_adapters(tmp_path, "tiny") == ["flat", "own"]
    assert "old.bin: a pickle" in caplog.text and "older.ckpt: a pickle" in caplog.text
    assert ip_adapter_paths(tmp_path, "tiny")["flat"] == tmp_path / "tiny" / "flat.safetensors"  # own first
    assert image_encoder_path(tmp_path, "tiny") == tmp_path / "image_encoder"
    assert available_ip_adapters(tmp_path, "tiny-sdxl") == ["flat", "other"]
    assert image_encoder_path(tmp_path, "tiny-sdxl") == tmp_path / "tiny-sdxl" / "image_encoder"  # its own
    with caplog.at_level(logging.WARNING, "shared.contract.ip_adapters"):
        assert image_encoder_path(tmp_path, "pickled") == tmp_path / "image_encoder"  # the top-level one
    assert "pickled/image_encoder: no .safetensors weights" in caplog.text
    assert available_ip_adapters(None, "tiny") == []
    assert available_ip_adapters(tmp_path / "gone", "tiny") == []
    (tmp_path / "image_encoder" / "model.safetensors").unlink()  # the encoder changed: read again
    assert available_ip_adapters(tmp_path, "tiny") == []  # no image encoder for them: none offered
    assert available_ip_adapters(tmp_path, "tiny-sdxl") == ["flat", "other"]
    touch(tmp_path / "tiny" / "image_encoder" / "config.json")
    touch(tmp_path / "tiny" / "image_encoder" / "model.safetensors")
    assert available_ip_adapters(tmp_path, "tiny") == ["flat", "own"]
