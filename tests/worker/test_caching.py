"""worker/caching.py: the fast tier skips deep work on each tiny model (SD, SDXL, Flux), its image stays
close to the normal one, and the normal image is exactly the same after it, also after a failure."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from math import ceil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import AutoPipelineForImage2Image, DiffusionPipeline

from shared.contract.models import Family
from tests.conftest import start_image
from worker.caching import UNET_INTERVAL, fast_tier

SIDE, STEPS = 64, 12

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pipe(cache: Path, model: str) -> Any:
    """The tiny model's text-to-image pipeline, loaded as the worker loads one."""
    from worker.tiny.model import ensure_tiny_model

    pipe = DiffusionPipeline.from_pretrained(ensure_tiny_model(cache, model), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: Any, seed: int = 0, **arguments: Any) -> np.ndarray:
    """One image as ImagePipeline.generate_batch makes it: pixels in [0, 1]."""
    with torch.inference_mode():
        return pipe("a red fox in the snow", width=SIDE, height=SIDE, num_inference_steps=STEPS,
                    generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
                    **arguments).images[0]


@pytest.fixture(scope="module")
def normal(pipe: Any) -> np.ndarray:
    """The normal tier's image of seed 0, made before any fast one."""
    return generate(pipe)


@contextmanager
def counting(module: torch.nn.Module) -> Iterator[list[int]]:
    """How many times a module ran, counted by a torch forward hook (outside the cache's hooks)."""
    calls = [0]
    handle = module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        yield calls
    finally:
        handle.remove()


def deep_layer(pipe: Any) -> torch.nn.Module:
    """A layer that the fast tier skips on a cached step: inside the UNet's mid block, or inside the
    transformer's last block (a hook on the block itself would see the cache's stand-in call)."""
    if hasattr(pipe, "unet"):
        return pipe.unet.mid_block.resnets[0]
    return pipe.transformer.single_transformer_blocks[-1].proj_out


def difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).mean())


def assert_fast_and_close(pipe: Any, family: Family, normal: np.ndarray, other_seed: np.ndarray,
                          **arguments: Any) -> None:
    """The fast tier runs the deep layers on fewer steps, and its image differs from the normal one by
    a little: less than a tenth of what another seed changes."""
    with counting(deep_layer(pipe)) as calls, fast_tier(pipe, family, tiny=True):
        fast = generate(pipe, **arguments)
    steps = calls[0]
    with counting(deep_layer(pipe)) as calls:
        assert np.array_equal(generate(pipe, **arguments), normal)  # also: the count without the tier
    assert 0 < steps < calls[0], (steps, calls[0])
    if family != "flux":  # a fixed interval: the first step, and every interval-th after it
        assert steps == ceil(calls[0] / UNET_INTERVAL[family])
    assert 0 < difference(fast, normal) < difference(other_seed, normal) / 10, \
        (difference(fast, normal), difference(other_seed, normal))


def test_the_fast_tier_skips_deep_work_and_makes_a_close_image(pipe: Any, family: Family,
                                                               normal: np.ndarray) -> None:
    assert_fast_and_close(pipe, family, normal, generate(pipe, seed=1))


def test_after_the_fast_tier_the_normal_image_is_exactly_the_same(pipe: Any, family: Family,
                                                                   normal: np.ndarray) -> None:
    with counting(deep_layer(pipe)) as calls, fast_tier(pipe, family, tiny=True):
        generate(pipe)
    assert calls[0] < STEPS
    assert np.array_equal(generate(pipe), normal)


def test_a_failure_inside_the_fast_tier_restores_the_normal_tier(pipe: Any, family: Family,
                                                                  normal: np.ndarray) -> None:
    def cancel(pipe: Any, step: int, timestep: object, kwargs: dict) -> dict:
        if step == 4:  # after 5 steps, full and cached ones
            raise RuntimeError("canceled")
        return kwargs

    with counting(deep_layer(pipe)) as calls, pytest.raises(RuntimeError, match="canceled"), \
            fast_tier(pipe, family, tiny=True):
        generate(pipe, callback_on_step_end=cancel)
    assert calls[0] < 5  # of the 5 steps run, some skipped
    assert np.array_equal(generate(pipe), normal)


def test_the_fast_tier_runs_on_an_image_to_image_twin(pipe: Any, family: Family, normal: np.ndarray) -> None:
    """A twin made with from_pipe shares the denoiser, so the hooks reach it (Flux's twin names no cache
    context of its own), and leave both pipelines as they were."""
    twin = AutoPipelineForImage2Image.from_pipe(pipe)
    twin.set_progress_bar_config(disable=True)
    image = {"image": start_image(SIDE, SIDE), "strength": 0.8}
    twin_normal = generate(twin, **image)
    assert_fast_and_close(twin, family, twin_normal, generate(twin, seed=1, **image), **image)
    assert np.array_equal(generate(pipe), normal)


def test_only_flux_has_a_threshold_of_its_own_for_a_tiny_model(pipe: Any, family: Family,
                                                                 normal: np.ndarray) -> None:
    """At a trained FLUX.1's threshold the random Flux's first block moves too much between steps to
    skip any; the UNets skip at their interval either way."""
    with counting(deep_layer(pipe)) as calls, fast_tier(pipe, family):
        fast = generate(pipe)
    with fast_tier(pipe, family, tiny=True):
        tiny = generate(pipe)
    if family == "flux":
        assert calls[0] == STEPS and np.array_equal(fast, normal) and not np.array_equal(tiny, normal)
    else:
        assert calls[0] == ceil(STEPS / UNET_INTERVAL[family]) and np.array_equal(fast, tiny)


def test_diffusers_still_has_the_hook_api_the_fast_tier_builds_on() -> None:
    """worker/caching.py is the one user of diffusers' hook API (diffusers>=0.42): a change fails here."""
    from diffusers import FluxTransformer2DModel
    from diffusers.hooks import HookRegistry, ModelHook

    class Doubled(ModelHook):
        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return 2 * self.fn_ref.original_forward(*args, **kwargs)

    layer = torch.nn.Identity()
    try:
        registry = HookRegistry.check_if_exists_or_initialize(layer)
        registry.register_hook(Doubled(), "doubled")
        hooked = layer(torch.ones(1)).item()
        registry.remove_hook("doubled", recurse=True)
        registry.invalidate_child_registries_cache()
    except (AttributeError, TypeError) as error:
        pytest.fail(f"diffusers' HookRegistry or ModelHook changed ({error}): update worker/caching.py")
    assert (hooked, layer(torch.ones(1)).item()) == (2.0, 1.0), \
        "diffusers' hooks no longer wrap and unwrap a module's forward: update worker/caching.py"
    missing = [name for name in ("enable_cache", "disable_cache", "cache_context")
               if not hasattr(FluxTransformer2DModel, name)]
    assert not missing, f"diffusers' transformers lost {missing}: update worker/caching.py"
