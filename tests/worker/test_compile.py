"""SLOTQ_COMPILE on real tiny pipelines, compiled for real by torch.compile on the CPU: each mode
makes the eager pipeline's images, a new size or a change of LoRA adapters compiles nothing, and
what cannot apply is refused plainly.

Compiling is slow on two cores (the full SD about two and a half minutes cold, docs/compile.md), so
each compiled pipeline is a module fixture that its tests share. Graphs are counted with torch's own
counter (``graphs_compiled``), under the default stance where a test says that nothing compiles:
the warm-up's ``eager_on_recompile`` would otherwise hide a recompilation.
"""

from __future__ import annotations

import io
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch._dynamo
from diffusers import DiffusionPipeline
from diffusers.models.attention_processor import FusedAttnProcessor2_0
from PIL import Image as Picture
from redis import Redis
from safetensors.torch import load_file, save_file
from torch.fx.experimental import _config as fx_config

from shared.contract.adapters import LoraRef
from shared.contract.settings import Settings
from slotq.harness import start_worker, wait_workers
from tests.conftest import app_client, post_job, wait_for_status
from worker.adapters import Adapters
from worker.compile import (
    RECOMPILE_LIMIT,
    SLOTS,
    AdapterSlots,
    CompileError,
    compiled,
    graphs_compiled,
    inductor_cache,
    max_rank,
    prepare,
    warm_up,
    widest_adapter,
)
from worker.tiny.loras import RANK, ensure_tiny_loras
from worker.tiny.model import ensure_tiny_model

pytestmark = [
    # Compiling takes minutes here; the module's fixtures are set up inside its first tests' timeouts.
    pytest.mark.timeout(600),
    # Inductor itself touches torch.jit.script_method as it compiles (torch 2.13), which warns.
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

# The largest pixel difference (pixels in [0, 1]) allowed between the compiled and the eager image:
# channels_last, fused QKV and inductor's kernels round differently; measured at most 4e-6 bare and
# 1.3e-4 with the tiny (strong) adapters, where two seeds differ by 1.0 at most and 0.18 on average.
TOLERANCE = 1e-3
Image = np.ndarray
Run = Callable[..., Image]


@pytest.fixture(scope="module", autouse=True)
def compiler_state(model_cache: Path) -> Iterator[None]:
    """torch on one thread, and the process's compiler as it was after this module: it compiles,
    turns duck sizing off and leaves the stance at eager_on_recompile, all process-wide. Inductor's
    cache is the session's, where the worker of the last test looks too: it compiles what this
    process compiled before from the cache."""
    threads, duck = torch.get_num_threads(), fx_config.use_duck_shape
    limit = torch._dynamo.config.recompile_limit
    torch.set_num_threads(1)  # two cores shared by the suite; compiled CPU kernels keep this count
    cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(model_cache / "inductor")
    yield
    if cache is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    torch.compiler.set_stance("default")
    fx_config.use_duck_shape, torch._dynamo.config.recompile_limit = duck, limit
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def load(model_cache: Path, name: str = "tiny") -> Any:
    """A tiny model fresh from the session's cache, on the CPU, as the worker loads it."""
    pipe = DiffusionPipeline.from_pretrained(ensure_tiny_model(model_cache, name), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def runner(pipe: Any) -> Run:
    """Images of a pipeline, one generator per image as the worker seeds them, floats in [0, 1]."""
    def run(width: int = 64, height: int = 64, images: int = 1, seed: int = 0) -> Image:
        generators = [torch.Generator("cpu").manual_seed(seed + index) for index in range(images)]
        with torch.inference_mode():
            return pipe("a lighthouse at dusk", width=width, height=height, num_inference_steps=2,
                        num_images_per_prompt=images, generator=generators, output_type="np").images
    return run


def assert_close(made: Image, eager: Image) -> None:
    """Within TOLERANCE of the eager image, pixel by pixel."""
    assert made.shape == eager.shape
    difference = float(np.abs(made - eager).max())
    assert difference <= TOLERANCE, f"max pixel difference {difference:.2e} > {TOLERANCE}"


@pytest.fixture(scope="module")
def sd_eager(model_cache: Path) -> dict[tuple[int, int, int], Image]:
    """The eager tiny SD's images by (width, height, seed)."""
    run = runner(load(model_cache))
    return {(width, height, seed): run(width, height, seed=seed)
            for width, height, seed in [(64, 64, 0), (64, 64, 1), (128, 64, 0), (96, 96, 0)]}


# --- what cannot apply, and off ---------------------------------------------------------------


def test_the_tolerance_is_far_below_what_a_seed_changes(sd_eager: dict[tuple[int, int, int], Image]) -> None:
    seeds = np.abs(sd_eager[64, 64, 0] - sd_eager[64, 64, 1])
    assert float(seeds.mean()) > 50 * TOLERANCE and float(seeds.max()) > 500 * TOLERANCE


def test_off_leaves_every_module_as_loaded(model_cache: Path) -> None:
    pipe = load(model_cache)
    processors = {name: type(processor) for name, processor in pipe.unet.attn_processors.items()}
    prepare(pipe, "off")
    assert not compiled(pipe.unet) and not compiled(pipe.vae) and not compiled(pipe.text_encoder)
    assert {name: type(processor) for name, processor in pipe.unet.attn_processors.items()} == processors
    assert pipe.unet.conv_in.weight.is_contiguous()  # not channels_last


def test_an_unknown_mode_is_a_clear_error(model_cache: Path) -> None:
    with pytest.raises(ValueError, match=r"SLOTQ_COMPILE='max' is not one of off, regional, full"):
        prepare(load(model_cache), "max")  # type: ignore[arg-type]


def test_regional_without_repeated_blocks_is_refused_before_anything_changes(
        model_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pipe = load(model_cache)
    monkeypatch.setattr(type(pipe.unet), "_repeated_blocks", [])  # as a model that declares none
    with pytest.raises(ValueError, match=r"SLOTQ_COMPILE=regional: UNet2DConditionModel declares no "
                                         r"repeated blocks \(_repeated_blocks\) to compile; use full or off"):
        prepare(pipe, "regional")
    assert not compiled(pipe.unet) and pipe.unet.conv_in.weight.is_contiguous()
    assert not any(isinstance(p, FusedAttnProcessor2_0) for p in pipe.unet.attn_processors.values())


def test_a_lora_loaded_by_name_is_refused_as_it_would_lose_the_fused_projections(model_cache: Path) -> None:
    pipe = load(model_cache)
    loras = ensure_tiny_loras(model_cache)
    with pytest.raises(ValueError, match="adapters=True needs AdapterSlots"):
        prepare(pipe, "full", adapters=True)
    pipe.load_lora_weights(str(loras), weight_name="ink.safetensors", adapter_name="ink")
    with pytest.raises(ValueError, match="holds LoRA adapters: load them as AdapterSlots"):
        prepare(pipe, "full")
    assert not compiled(pipe.unet)


# --- errors at the first call, the warm-up's stance, the cache folder --------------------------


def test_a_compile_failure_at_warm_up_is_a_compile_error() -> None:
    def breaks(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # fullgraph=True refuses it, as it would refuse a model's
        return x + 1

    broken = torch.compile(breaks, fullgraph=True, backend="eager")
    with pytest.raises(CompileError, match=r"^torch.compile failed at 8x8 \(1 images\); SLOTQ_COMPILE="
                                           r"off serves uncompiled. Unsupported: Call to `torch._dynamo"):
        warm_up(lambda width, height, images: broken(torch.ones(images, height, width)), [(8, 8)])


def test_after_warm_up_a_shape_no_graph_covers_runs_eagerly_without_compiling() -> None:
    double = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)  # a graph per shape
    done = warm_up(lambda width, height, images: double(torch.ones(images, height, width)), [(8, 8)])
    assert done.graphs == 2 and done.seconds > 0  # one image and a batch
    before = graphs_compiled()
    assert torch.equal(double(torch.ones(1, 16, 8)), torch.full((1, 16, 8), 2.0))
    assert graphs_compiled() == before
    with torch.compiler.set_stance("default"):  # the same call compiles where compiling is allowed
        double(torch.ones(1, 24, 8))
    assert graphs_compiled() == before + 1


def test_the_inductor_cache_defaults_under_the_cache_dir_only_where_unset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert inductor_cache(tmp_path) == tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert inductor_cache(tmp_path) == tmp_path / "mine"


# --- full: the denoiser and the VAE decoder ---------------------------------------------------


@pytest.fixture(scope="module")
def sd_full(model_cache: Path) -> tuple[Any, Run, dict[tuple[int, int, int], Image]]:
    """The tiny SD compiled full and warmed up at 64x64 and 128x64, with the warm-up's images."""
    pipe = load(model_cache)
    prepare(pipe, "full")
    run, made = runner(pipe), {}

    def warm(width: int, height: int, images: int) -> None:
        made[width, height, images] = run(width, height, images)

    warm_up(warm, [(64, 64), (128, 64)])
    return pipe, run, made


def test_full_compiles_the_unet_and_the_vae_decoder_in_channels_last_with_fused_qkv(
        sd_full: tuple[Any, Run, dict[tuple[int, int, int], Image]]) -> None:
    pipe, _, _ = sd_full
    assert compiled(pipe.unet) and compiled(pipe.vae.decoder)
    assert not compiled(pipe.vae.encoder) and not compiled(pipe.text_encoder)
    assert pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert pipe.vae.decoder.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert all(isinstance(p, FusedAttnProcessor2_0) for p in pipe.unet.attn_processors.values())


def test_full_makes_the_eager_image_at_two_sizes_and_again_at_the_first_without_compiling(
        sd_full: tuple[Any, Run, dict[tuple[int, int, int], Image]],
        sd_eager: dict[tuple[int, int, int], Image]) -> None:
    _, run, made = sd_full
    assert_close(made[64, 64, 1], sd_eager[64, 64, 0])
    assert_close(made[128, 64, 1], sd_eager[128, 64, 0])
    assert_close(made[64, 64, 2][:1], sd_eager[64, 64, 0])  # a batch's first image is the image alone
    assert_close(made[64, 64, 2][1:], sd_eager[64, 64, 1])
    before = graphs_compiled()
    with torch.compiler.set_stance("default"):
        again = run(64, 64)
    assert graphs_compiled() == before
    assert np.array_equal(again, made[64, 64, 1])


def test_full_compiles_nothing_for_a_new_size_where_compiling_is_allowed(
        sd_full: tuple[Any, Run, dict[tuple[int, int, int], Image]],
        sd_eager: dict[tuple[int, int, int], Image]) -> None:
    _, run, _ = sd_full
    before = graphs_compiled()
    with torch.compiler.set_stance("default"):  # dynamic shapes: the warm-up's graphs serve 96x96
        made = run(96, 96)
        run(128, 64, images=3)
    assert graphs_compiled() == before
    assert_close(made, sd_eager[96, 96, 0])


def test_the_recompile_limit_is_set(sd_full: tuple[Any, Run, dict[tuple[int, int, int], Image]]) -> None:
    assert torch._dynamo.config.recompile_limit == RECOMPILE_LIMIT
    assert fx_config.use_duck_shape is False


# --- regional, with adapter slots -------------------------------------------------------------


@pytest.fixture(scope="module")
def sd_loras(model_cache: Path) -> Path:
    """The tiny SD's adapters: ink, neon and moss."""
    return ensure_tiny_loras(model_cache)


JOBS: list[tuple[str, list[LoraRef]]] = [
    ("bare", []),
    ("ink", [LoraRef(name="ink", scale=1.0)]),
    ("ink at 0.5", [LoraRef(name="ink", scale=0.5)]),
    ("neon", [LoraRef(name="neon", scale=1.0)]),
    ("ink and neon", [LoraRef(name="ink", scale=1.0), LoraRef(name="neon", scale=0.7)]),
    ("moss against", [LoraRef(name="moss", scale=-0.8)]),
]


@pytest.fixture(scope="module")
def lora_eager(model_cache: Path, sd_loras: Path) -> dict[str, Image]:
    """The eager tiny SD's 64x64 image for each job of JOBS, its adapters loaded by name, in the
    memory layout ``prepare`` gives it (channels_last)."""
    # The layout (and on some CPUs the compiled kernels too) moves the strong "neon" adapter's image by
    # up to 1.8e-2 (1.2e-3 on average; the bare image by 3e-6): rounding that the tiny adapter's large
    # weights amplify, not what the slots or the compiler do, which this compares (assert_its_own).
    pipe, adapters, images = load(model_cache), Adapters(sd_loras, 4), {}
    pipe.unet.to(memory_format=torch.channels_last)
    pipe.vae.to(memory_format=torch.channels_last)
    with warnings.catch_warnings():  # peft warns of a second adapter beside the first: meant here
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        for name, loras in JOBS:
            adapters.use(pipe, loras)
            images[name] = runner(pipe)()
    return images


def assert_its_own(made: Image, eager: dict[str, Image], name: str) -> None:
    """The eager image of job ``name``, not of another: on average at most a tenth as far from it as
    from the nearest other job's, and nowhere off by more than the rounding the strongest adapter
    amplifies (lora_eager)."""
    own = float(np.abs(made - eager[name]).mean())
    nearest = min(float(np.abs(made - image).mean()) for other, image in eager.items() if other != name)
    assert own <= nearest / 10, f"{name}: {own:.2e} from its own image, {nearest:.2e} from another's"
    assert float(np.abs(made - eager[name]).max()) <= 25 * TOLERANCE, name


@pytest.fixture(scope="module")
def sd_regional(model_cache: Path, sd_loras: Path) -> tuple[Any, Run, AdapterSlots]:
    """The tiny SD with adapter slots, compiled regional and warmed up at 64x64."""
    pipe = load(model_cache)
    slots = AdapterSlots.ready(pipe, sd_loras)
    prepare(pipe, "regional", adapters=True)
    run = runner(pipe)
    warm_up(lambda width, height, images: run(width, height, images), [(64, 64)])
    return pipe, run, slots


def test_the_slots_take_the_largest_rank_and_the_widest_adapter(sd_loras: Path) -> None:
    assert max_rank(sd_loras) == RANK
    assert widest_adapter(sd_loras) == "ink"  # all three target the same layers: the first name


def test_regional_compiles_only_the_repeated_blocks(sd_regional: tuple[Any, Run, AdapterSlots]) -> None:
    pipe, _, _ = sd_regional
    blocks = [m for m in pipe.unet.modules() if type(m).__name__ in pipe.unet._repeated_blocks]
    assert blocks and all(getattr(block, "_compiled_call_impl", None) is not None for block in blocks)
    assert getattr(pipe.unet, "_compiled_call_impl", None) is None and not compiled(pipe.vae)
    assert pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    # The slots keep the projections apart: a fused processor would bypass their LoRA layers.
    assert not any(isinstance(p, FusedAttnProcessor2_0) for p in pipe.unet.attn_processors.values())


def test_regional_makes_the_eager_image(sd_regional: tuple[Any, Run, AdapterSlots],
                                        sd_eager: dict[tuple[int, int, int], Image]) -> None:
    _, run, slots = sd_regional
    slots.use([])
    assert_close(run(), sd_eager[64, 64, 0])


def test_changing_adapters_compiles_nothing_and_makes_each_eager_image(
        sd_regional: tuple[Any, Run, AdapterSlots], lora_eager: dict[str, Image]) -> None:
    _, run, slots = sd_regional
    assert float(np.abs(lora_eager["ink"] - lora_eager["bare"]).mean()) > 50 * TOLERANCE  # they show
    before, swaps = graphs_compiled(), slots.swaps
    with torch.compiler.set_stance("default"):
        for name, loras in [*JOBS, ("bare", []), ("ink", [LoraRef(name="ink", scale=1.0)])]:
            slots.use(loras)
            assert_its_own(run(), lora_eager, name)
            assert {lora.name for lora in loras} <= set(slots.held), name
    assert graphs_compiled() == before
    # Each adapter read from disk once: four slots hold ink, neon and moss together.
    assert slots.swaps - swaps == 3 and len(slots.held) == len(SLOTS)


def test_an_adapter_the_slots_cannot_take_fails_alone_and_the_slots_go_on(
        model_cache: Path, sd_loras: Path, tmp_path: Path) -> None:
    folder = tmp_path / "loras"  # ink and neon at start; later an adapter with a layer they lack
    folder.mkdir()
    for name in ("ink", "neon"):
        shutil.copy(sd_loras / f"{name}.safetensors", folder)
    pipe = load(model_cache)  # eager: what a swap does is the same compiled or not
    slots, run = AdapterSlots.ready(pipe, folder), runner(pipe)
    slots.use([LoraRef(name="ink", scale=1.0)])
    ink = run()
    weights = load_file(sd_loras / "moss.safetensors")
    extra = "unet.down_blocks.1.attentions.0.transformer_blocks.0.ff.net.2.lora"  # a layer none targets
    weights[f"{extra}.down.weight"] = torch.ones(RANK, 128)
    weights[f"{extra}.up.weight"] = torch.ones(32, RANK)
    save_file(weights, folder / "wide.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"LoRA wide cannot be swapped into this compiled worker's adapter "
                                         r"slots, which take the layers of ink \(or fewer\) up to rank 4"):
        slots.use([LoraRef(name="wide", scale=1.0)])
    assert slots.held.count(None) == len(SLOTS) - 1  # the refused slot holds nothing
    slots.use([LoraRef(name="ink", scale=1.0)])
    assert np.array_equal(run(), ink)


# --- Flux: regional over its two block classes ----------------------------------------------


def test_flux_regional_makes_the_eager_image_with_fused_qkv(model_cache: Path) -> None:
    pipe = load(model_cache, "tiny-flux")
    run = runner(pipe)
    eager = run()
    prepare(pipe, "regional")
    transformer = pipe.transformer
    assert {type(m).__name__ for m in transformer.modules() if compiled(m)} \
        >= {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    assert any(getattr(m, "fused_projections", False) for m in transformer.modules())
    warm_up(lambda width, height, images: run(width, height, images), [(64, 64)])
    before = graphs_compiled()
    with torch.compiler.set_stance("default"):
        assert_close(run(), eager)
    assert graphs_compiled() == before


# --- a compiled worker ------------------------------------------------------------------------------


def test_a_compiled_worker_makes_the_eager_images_at_two_sizes_and_a_third_job_neither_stalls_nor_differs(
        sd_eager: dict[tuple[int, int, int], Image], redis_url: str, model_cache: Path,
        tmp_path: Path) -> None:
    url = redis_url.removesuffix("/0") + "/15"  # apart from the others' databases
    with Redis.from_url(url) as connection:
        connection.flushdb()
    settings = Settings(redis_url=url, queue_name="compile-tests", cache_dir=model_cache, drain_s=0,
                        device="cpu", dtype="float32", torch_threads=1, compile="full",
                        compile_sizes=["64x64"])
    worker = start_worker(settings, tmp_path / "worker.log", wait=False)
    try:
        wait_workers([worker], url, timeout=540)  # it compiles before it says it is ready
        assert "compiled" in worker.output()
        for client in app_client(settings):
            views = []
            for width, height in ((64, 64), (128, 64), (64, 64)):
                answer = post_job(client, prompt="a lighthouse at dusk", width=width, height=height, steps=2,
                                  seed=0, guidance_scale=7.5)
                views.append(wait_for_status(client, answer.get_json()["id"], "succeeded", "failed"))
            assert [view["status"] for view in views] == ["succeeded"] * 3, views
            workers = client.get("/v1/workers").get_json()["workers"]
            assert [each["compile"] for each in workers] == ["full"]
            for view, (width, height) in zip(views, ((64, 64), (128, 64), (64, 64)), strict=True):
                made = np.asarray(Picture.open(io.BytesIO(client.get(view["images"][0]).data)), dtype=float)
                eager = np.round(sd_eager[width, height, 0][0] * 255)  # as the PNG rounds it
                assert np.abs(made - eager).max() <= 1, (width, height)  # the eager image, to the last bit
            # No job compiled: the third, at the first size again, ran about as long as the first did.
            first, third = (ran(view) for view in (views[0], views[2]))
            assert third <= 3 * first + 1.0, (first, third)
    finally:
        assert worker.stop() == 0, worker.output()


def ran(view: dict[str, Any]) -> float:
    """Seconds from a job's start to its end."""
    ended, began = (datetime.fromisoformat(view[moment]) for moment in ("finished_at", "started_at"))
    return (ended - began).total_seconds()
