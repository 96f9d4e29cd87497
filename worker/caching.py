"""The fast tier (a job's ``"speed": "fast"``): step caching on the pipeline's denoiser for one call.

A denoiser's deep features change little from one step to the next, so a step may reuse them:

- **SD and SDXL (UNets): DeepCache** (Ma, Fang and Wang, 2023, arXiv:2312.00858), as a diffusers hook.
  Every ``interval``-th UNet call runs in full and keeps each deep module's output; the calls between
  run only the shallow branch (``conv_in``, the last layer of the last up block, ``conv_out``) on top
  of the kept features. The skips fall at fixed steps, so a fast image always differs a little.
- **Flux (a transformer): diffusers' First Block Cache.** Every step runs the first block; where its
  residual moved by less than ``threshold`` (relative) since the last full step, the other blocks are
  skipped and their cached residual is added instead.

The DeepCache package (0.1.1, December 2023) does what the hook below does, but by rebinding each
module's ``forward`` and finding the step by searching the scheduler's timesteps, a device read each
call; its own pipelines no longer import on diffusers 0.42. A hook on diffusers' registry composes with
its other hooks, follows the UNet into every ``from_pipe`` twin, and is removed by name.

This is the one module that uses diffusers' hook API (``diffusers.hooks``: ``HookRegistry``,
``ModelHook`` and its ``fn_ref``), as diffusers>=0.42 has it; tests/worker/test_caching.py fails with
a plain message where that changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import DiffusionPipeline, ModelMixin, UNet2DConditionModel
from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, ModelHook

from shared.contract.models import FAMILY_SPECS, Family, family_spec

# Each family's interval (a UNet) or threshold (a transformer) is its record's (shared/contract/models.py).
UNET_INTERVAL: dict[Family, int] = {family: spec.cache_interval for family, spec in FAMILY_SPECS.items()
                                    if spec.cache_interval is not None}
# A tiny random transformer's first block moves far more a step than a trained one's, so at a trained
# model's threshold it would never skip; at this one the tiny Flux skips the other block in about half
# the steps (docs/speed.md). diffusers' own tests raise the threshold for random models for the same reason.
TINY_THRESHOLD = 0.4
_STEP_HOOK = "slotq_deep_cache_step"
_REUSE_HOOK = "slotq_deep_cache_reuse"


@contextmanager
def fast_tier(pipe: DiffusionPipeline, family: Family, tiny: bool = False) -> Iterator[None]:
    """Run the pipeline's denoiser with step caching inside the block; the normal model after it,
    whatever happened inside. ``tiny``: the pipeline is one of worker/tiny/model.py's random ones.
    Not thread-safe, as the pipeline is not."""
    spec = family_spec(family)  # it has the one setting its denoiser's cache takes
    if spec.cache_threshold is not None:  # a transformer
        with first_block_cache(pipe.transformer, TINY_THRESHOLD if tiny else spec.cache_threshold):
            yield
    elif spec.cache_interval is not None:  # a UNet
        with deep_cache(pipe.unet, spec.cache_interval):
            yield


@contextmanager
def first_block_cache(transformer: ModelMixin, threshold: float) -> Iterator[None]:
    """diffusers' First Block Cache on a transformer while the block runs."""
    transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
    try:
        # FluxPipeline names each denoiser call's cache context itself; its image-to-image and
        # inpainting twins do not, and the cache's state is kept per context: this one covers them.
        with transformer.cache_context("cond"):
            yield
    finally:
        transformer.disable_cache()


@dataclass
class _Steps:
    """Which UNet call of the pipeline call this is, shared by one cache's hooks."""

    interval: int
    calls: int = 0

    @property
    def full(self) -> bool:
        """Whether this call computes the deep modules (the first, and every interval-th after it)."""
        return (self.calls - 1) % self.interval == 0


class _CountCall(ModelHook):
    """Counts the UNet's calls at its first layer: accelerate's model offloading rewraps the UNet's own
    ``forward`` at the end of each pipeline call, a hook there would be dropped."""

    def __init__(self, steps: _Steps) -> None:
        super().__init__()
        self.steps = steps

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.steps.calls += 1
        return args, kwargs


class _ReuseOutput(ModelHook):
    """A deep module: computed on a full call and kept; on the calls between, the kept output."""

    def __init__(self, steps: _Steps) -> None:
        super().__init__()
        self.steps = steps
        self.output: Any = None

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if self.output is None or self.steps.full:
            self.output = self.fn_ref.original_forward(*args, **kwargs)
        return self.output


@contextmanager
def deep_cache(unet: UNet2DConditionModel, interval: int) -> Iterator[None]:
    """DeepCache on a diffusers UNet while the block runs: the deep modules computed every
    ``interval``-th call, the shallow branch every call."""
    steps = _Steps(interval)
    registry = HookRegistry.check_if_exists_or_initialize(unet)
    try:
        HookRegistry.check_if_exists_or_initialize(unet.conv_in).register_hook(_CountCall(steps), _STEP_HOOK)
        for module in deep_modules(unet):
            HookRegistry.check_if_exists_or_initialize(module).register_hook(_ReuseOutput(steps), _REUSE_HOOK)
        registry.invalidate_child_registries_cache()
        yield
    finally:  # by name, through the whole UNet: also after a registration failed half-way
        registry.remove_hook(_STEP_HOOK, recurse=True)
        registry.remove_hook(_REUSE_HOOK, recurse=True)
        registry.invalidate_child_registries_cache()


def deep_modules(unet: UNet2DConditionModel) -> list[torch.nn.Module]:
    """The modules outside DeepCache's shallowest branch (its ``cache_branch_id=0``): every down block,
    the mid block, every up block but the last, and all of the last but its last layer, whose input
    is the kept features joined with ``conv_in``'s fresh output (the shallowest skip connection)."""
    last = unet.up_blocks[-1]
    attentions = [*(getattr(last, "attentions", None) or [])]  # an UpBlock2D has none
    deep = [*unet.down_blocks, unet.mid_block, *unet.up_blocks[:-1],
            *last.resnets[:-1], *attentions[:-1], *(last.upsamplers or [])]
    return [module for module in deep if module is not None]  # a UNet may have no mid block
