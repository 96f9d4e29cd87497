"""worker/prompts.py: A1111's prompt syntax parsed as A1111 parses it, and encoded by compel on each
tiny model (SD, SDXL, Flux): a weight of 1 gives the plain prompt's image, a weight changes it, a
batch of prompts of different lengths and negatives work, and a family it cannot weight is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import torch
from diffusers import AutoPipelineForImage2Image, DiffusionPipeline

from shared.contract.models import Family
from tests.conftest import start_image
from worker.prompts import parse_weighted, weighted_arguments

SIDE, STEPS = 64, 3
# The most two images of the same words may differ, in [0, 1] (the issue allows 1/255, 40 times more):
# on the CPU in float32 they are the same bit for bit.
SAME = 1e-4
# The least a weight must change an image: (red:1.6) moves tiny Flux's, the least moved, by 8.7e-4.
CHANGED = 5e-4
LONG = "a red barn in a field, " * 5  # 115 tokens of the tiny models' one-character tokenizer: two chunks

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize(("prompt", "fragments"), [
    ("a red barn", [("a red barn", 1.0)]),
    ("(a red barn:1.0)", [("a red barn", 1.0)]),
    ("(red:1.6) barn", [("red", 1.6), (" barn", 1.0)]),
    ("((red)) [barn]", [("red", 1.21), (" ", 1.0), ("barn", 1 / 1.1)]),
    ("(red [barn]:1.5) sky", [("red ", 1.5), ("barn", 1.5 / 1.1), (" sky", 1.0)]),
    ("( red : 0.5 )", [(" red ", 0.5)]),
    (r"\(red\) \[barn\] a\\b", [(r"(red) [barn] a\b", 1.0)]),
    ("(open red", [("open red", 1.1)]),  # a bracket left open runs to the end
    ("closed) red] a:b", [("closed) red] a:b", 1.0)]),  # brackets that close nothing are text
    ("", [("", 1.0)]),
])
def test_parses_a1111_syntax(prompt: str, fragments: list[tuple[str, float]]) -> None:
    parsed = parse_weighted(prompt)
    assert [text for text, _ in parsed] == [text for text, _ in fragments]
    assert [weight for _, weight in parsed] == pytest.approx([weight for _, weight in fragments])


def test_a_weight_that_is_no_number_is_refused() -> None:
    with pytest.raises(ValueError, match=r"the weight '1\.2\.3' in the prompt .* is not a number"):
        parse_weighted("(red:1.2.3) barn")




@pytest.fixture(scope="module")
def pipe(cache: Path, model: str) -> Any:
    """The tiny model's text-to-image pipeline, loaded as the worker loads one."""
    from worker.tiny.model import ensure_tiny_model

    pipe = DiffusionPipeline.from_pretrained(ensure_tiny_model(cache, model), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def images(pipe: Any, prompts: list[str], negatives: list[str] | None = None, *,
           weighted: Family | None = None, per_prompt: int = 1, seeds: list[int] | None = None,
           **extra: Any) -> np.ndarray:
    """The images of a batch as ImagePipeline.generate_batch makes them (pixels in [0, 1], a CPU
    generator per image, seeded by its prompt's seed plus its index): from the prompts as text, or,
    given the family, from the embeddings of weighted_arguments, a row an image."""
    generators = [torch.Generator("cpu").manual_seed(seed + image)
                  for seed in seeds or [0] * len(prompts) for image in range(per_prompt)]
    text: dict[str, Any] = {"prompt": prompts, "negative_prompt": negatives}
    if weighted is not None:  # as the worker passes them: a row an image
        text, per_prompt = weighted_arguments(pipe, weighted, prompts, negatives, per_prompt), 1
    with torch.inference_mode():
        return pipe(**text, width=SIDE, height=SIDE, num_inference_steps=STEPS, generator=generators,
                    num_images_per_prompt=per_prompt, output_type="np", **extra).images


def difference(first: np.ndarray, second: np.ndarray) -> float:
    assert first.shape == second.shape
    return float(np.abs(first - second).max())


def test_a_weight_of_one_gives_the_plain_image(pipe: Any, family: Family) -> None:
    plain = images(pipe, ["a red barn"])
    assert difference(images(pipe, ["(a red barn:1.0)"], weighted=family), plain) <= SAME
    assert difference(images(pipe, ["a red barn"], weighted=family), plain) <= SAME


def test_a_weight_changes_the_image(pipe: Any, family: Family) -> None:
    weighted = images(pipe, ["(red:1.6) barn"], weighted=family)
    assert difference(weighted, images(pipe, ["red barn"])) > CHANGED
    assert difference(weighted, images(pipe, ["(red:1.6) barn"])) > CHANGED  # the brackets are not text
    assert difference(images(pipe, ["[red] barn"], weighted=family), images(pipe, ["red barn"])) > CHANGED


def test_a_batch_of_prompts_of_different_lengths(pipe: Any, family: Family) -> None:
    """Each image of a batch within one chunk is its image alone; a longer prompt pads the others."""
    prompts, seeds = ["a red barn", "(a tall:1.3) white lighthouse on a [rocky] cliff"], [0, 100]
    batch = images(pipe, prompts, weighted=family, per_prompt=2, seeds=seeds)
    assert batch.shape == (4, SIDE, SIDE, 3)
    for index, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        alone = images(pipe, [prompt], weighted=family, per_prompt=2, seeds=[seed])
        assert difference(batch[2 * index:2 * index + 2], alone) <= SAME
    assert difference(batch[:2], images(pipe, prompts[:1], per_prompt=2)) <= SAME  # as the plain prompt's

    arguments = weighted_arguments(pipe, family, ["a red barn", f"({LONG}:1.2)"], ["blurry", ""])
    tokens = {name: tensor.shape[1] for name, tensor in arguments.items() if "pooled" not in name}
    # Flux's T5 reads its fixed 512 tokens; CLIP's 77 a chunk, the long prompt two (no truncation).
    assert set(tokens.values()) == {512 if family == "flux" else 2 * 77}, tokens
    assert all(tensor.shape[0] == 2 for tensor in arguments.values())
    long = images(pipe, ["a red barn", LONG], weighted=family)
    assert not np.isnan(long).any()
    if family != "flux":  # what the chunk beyond 77 tokens says reaches the image
        assert difference(long[1], images(pipe, [LONG])[0]) > CHANGED


def test_negatives(pipe: Any, family: Family) -> None:
    # Flux takes a negative prompt only with true classifier-free guidance, which the worker leaves off.
    guidance: dict[str, Any] = {"true_cfg_scale": 2.0} if family == "flux" else {}
    plain = images(pipe, ["a red barn"], ["blurry"], **guidance)
    assert difference(plain, images(pipe, ["a red barn"], **guidance)) > CHANGED  # a negative shows
    weighted = images(pipe, ["a red barn"], ["(blurry:1.0)"], weighted=family, **guidance)
    assert difference(weighted, plain) <= SAME
    stronger = images(pipe, ["a red barn"], ["(blurry:1.6)"], weighted=family, **guidance)
    assert difference(stronger, plain) > CHANGED
    # A batch where one request has a negative and one has none (""), as the worker passes them.
    mixed = images(pipe, ["a red barn", "(red:1.6) barn"], ["", "blurry"], weighted=family, seeds=[0, 100],
                   **guidance)
    assert difference(mixed[:1], images(pipe, ["a red barn"], [""], **guidance)) <= SAME


def test_image_to_image(pipe: Any, family: Family) -> None:
    """The worker's image-to-image twin takes the same arguments, two images a prompt."""
    twin = AutoPipelineForImage2Image.from_pipe(pipe)
    twin.set_progress_bar_config(disable=True)
    image: dict[str, Any] = {"image": [start_image(SIDE, SIDE)], "strength": 0.8}
    plain = images(twin, ["a red barn"], per_prompt=2, **image)
    assert plain.shape == (2, SIDE, SIDE, 3)
    weighted = images(twin, ["(a red barn:1.0)"], weighted=family, per_prompt=2, **image)
    assert difference(weighted, plain) <= SAME
    assert difference(images(twin, ["(red:1.6) barn"], weighted=family, per_prompt=2, **image),
                      images(twin, ["red barn"], per_prompt=2, **image)) > CHANGED


def test_a_family_it_cannot_weight_is_refused() -> None:
    with pytest.raises(ValueError, match="weighted prompts .* are not supported on a sd3 model; "
                                         "these families support them: sd, sdxl, flux"):
        weighted_arguments(cast(Any, None), cast(Family, "sd3"), ["(red:1.2) barn"], None)
