"""torch.compile of a loaded pipeline (SLOTQ_COMPILE), its warm-up, and LoRA adapter slots that
let one compiled graph serve every job; the figures behind each choice are in docs/compile.md.

``prepare`` applies a mode to a pipeline already on its device: ``regional`` compiles the denoiser's
repeated blocks (diffusers' ``compile_repeated_blocks``), ``full`` the whole denoiser and the VAE's
decoder; both first put the UNet and the VAE in channels_last and fuse the attention's QKV
projections (diffusers' ``fuse_qkv_projections``). Attention is torch's SDPA, diffusers' default.

Shapes: dynamic, not buckets. Every module is compiled with ``dynamic=True`` and duck sizing off, so
one graph serves every width and height. Measured on the tiny SD (``full``, CPU, one thread):
compiled static, each new size or batch cost a compilation of 40-52 s; dynamic, the first cost more
(143 s) and a new size nothing, at the same speed once compiled (0.020-0.024 s a call against
0.018-0.024 s). Buckets would also change the image (a padded or cropped latent is another one) and
stall or run eagerly any size outside them. With duck sizing on, a square first size tied width to
height and the first oblong size compiled again. Still needing graphs of their own: a batch of one
(torch specializes sizes 0 and 1) and, on the CPU, the VAE decoder past a size threshold of its
convolutions; ``warm_up`` compiles them, running each warm size with one image and with two. Then
the process's stance is ``eager_on_recompile``: a shape no graph covers runs eagerly, and the worker
never compiles after its start.

Failures: torch.compile compiles at a module's first call, so its errors surface in ``warm_up``,
which raises ``CompileError``: fatal at the worker's start (it exits non-zero, naming
SLOTQ_COMPILE=off), never a failure of jobs later.

LoRA: loading an adapter by name, or changing which are active, changes the modules a graph was
traced through, and each such change compiled again (2-8 s each on the tiny SD, ``regional``).
``AdapterSlots`` holds MAX_LORAS slots instead, all active and filled before compiling; a job's
adapters are hot-swapped into them in place (diffusers' LoRA hot-swap) and their scales written into
the slots' scaling tensors, an empty slot at 0: no change compiles. The price: every job runs the
slots' LoRA layers, padded to the folder's largest rank; the QKV projections stay apart (a fused
projection bypasses the LoRA layers on to_q, to_k and to_v); and an adapter may target no layer the
folder's widest adapter leaves out.

Private names used here: torch's ``fx.experimental._config.use_duck_shape`` and
``_dynamo.utils.counters`` and peft's ``LoraLayer.scaling`` (tensors once hot-swap is enabled); an
import fails, ``AdapterSlots`` says so, or tests/worker/test_compile.py fails where one changes.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch._dynamo
import torch._dynamo.utils
from diffusers import DiffusionPipeline, ModelMixin
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from torch.fx.experimental import _config as fx_config

from shared.contract.adapters import MAX_LORAS, LoraRef, adapter_path, available_adapters

log = logging.getLogger(__name__)

Mode = Literal["off", "regional", "full"]
MODES: tuple[Mode, ...] = ("off", "regional", "full")
DENOISERS = ("unet", "transformer")  # the attribute of a pipeline's denoiser, by family
SLOTS = tuple(f"slot{index}" for index in range(MAX_LORAS))  # adapter names on a compiled pipeline
# The warm-up runs each size with one image and with a batch of this many: torch specializes a batch
# of one, so the general graph needs two.
WARM_BATCH = 2
# How a LoRA file names its down (A) projection, whose first dimension is the rank: peft's, diffusers'
# older format and kohya's.
DOWN_WEIGHTS = (".lora_A.", ".lora.down.", ".lora_down.")
# Graphs one code object may hold (torch's recompile_limit, 8 by default): the warm-up of a few sizes
# needs 3 for the VAE decoder; past the limit torch runs that code eagerly.
RECOMPILE_LIMIT = 8


class CompileError(RuntimeError):
    """torch.compile failed while the warm-up compiled a pipeline; fatal at the worker's start."""


def inductor_cache(cache_dir: Path) -> Path:
    """The folder inductor keeps compiled artefacts in across restarts: TORCHINDUCTOR_CACHE_DIR where
    it is set, else ``<cache_dir>/inductor`` (set in the environment, where inductor reads it)."""
    # Inductor reads the variable itself, at each compilation; setting it is the only way to move
    # its cache, so this is the one place besides Settings that touches the environment.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir / "inductor"))
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def denoiser_of(pipe: DiffusionPipeline) -> ModelMixin:
    """The pipeline's UNet or transformer."""
    for name in DENOISERS:
        module = getattr(pipe, name, None)
        if module is not None:
            return module
    raise ValueError(f"{type(pipe).__name__} has no denoiser ({' or '.join(DENOISERS)}) to compile")


def prepare(pipe: DiffusionPipeline, mode: Mode, *, adapters: bool = False) -> None:
    """Apply SLOTQ_COMPILE to a pipeline on its device, in place; nothing compiles before its first
    call (``warm_up``). ``adapters``: the pipeline holds ``AdapterSlots`` (filled before this), and
    its QKV projections stay apart, where peft's layers sit. Raises ``ValueError`` where the mode
    cannot apply to this pipeline."""
    if mode not in MODES:
        raise ValueError(f"SLOTQ_COMPILE={mode!r} is not one of {', '.join(MODES)}")
    if mode == "off":
        return
    denoiser = denoiser_of(pipe)
    if mode == "regional" and not _repeated_blocks(denoiser):
        raise ValueError(f"SLOTQ_COMPILE=regional: {type(denoiser).__name__} declares no repeated blocks "
                         "(_repeated_blocks) to compile; use full or off")
    if mode == "full" and getattr(pipe.vae, "decoder", None) is None:
        raise ValueError(f"SLOTQ_COMPILE=full: {type(pipe.vae).__name__} has no decoder to compile")
    has_slots = _holds_slots(denoiser)
    if adapters != has_slots:
        raise ValueError("adapters=True needs AdapterSlots filled before prepare()" if adapters else
                         "the pipeline holds LoRA adapters: load them as AdapterSlots and pass adapters=True")
    _layout(pipe, denoiser)
    if not adapters:
        # A fused processor calls to_qkv, bypassing the LoRA layers peft puts on to_q, to_k and to_v:
        # an adapter would silently lose most of its effect (measured on the tiny SD and Flux).
        _fuse_qkv(pipe, denoiser)
    _compile(pipe, denoiser, mode)
    log.info("compile %s prepared for %s (QKV %s)", mode, type(pipe).__name__,
             "apart, for adapters" if adapters else "fused")


def _repeated_blocks(denoiser: ModelMixin) -> bool:
    """Whether the denoiser declares repeated blocks and holds at least one of them."""
    names = set(getattr(denoiser, "_repeated_blocks", None) or ())
    return any(type(module).__name__ in names for module in denoiser.modules())


def _layout(pipe: DiffusionPipeline, denoiser: ModelMixin) -> None:
    """channels_last for the convolutional modules: the UNet and the VAE (a transformer has none)."""
    if getattr(pipe, "unet", None) is not None:
        denoiser.to(memory_format=torch.channels_last)
    pipe.vae.to(memory_format=torch.channels_last)


def _fuse_qkv(pipe: DiffusionPipeline, denoiser: ModelMixin) -> None:
    """Fused QKV projections where diffusers offers them: the SD pipelines' own method (UNet and VAE),
    else the denoiser's (Flux's transformer)."""
    if hasattr(pipe, "fuse_qkv_projections"):
        pipe.fuse_qkv_projections()
    elif hasattr(denoiser, "fuse_qkv_projections"):
        denoiser.fuse_qkv_projections()


def _compile(pipe: DiffusionPipeline, denoiser: ModelMixin, mode: Mode) -> None:
    """Compile the mode's modules in place, for any size (module docstring: why dynamic)."""
    # Duck sizing gives equal sizes one symbol: a square first size would tie width to height, and
    # the first oblong size would compile again. Process-wide: the worker compiles only here.
    fx_config.use_duck_shape = False
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    options = {"fullgraph": True, "dynamic": True}
    if mode == "regional":
        denoiser.compile_repeated_blocks(**options)
    else:
        denoiser.compile(**options)
        pipe.vae.decoder.compile(**options)


def compiled(module: torch.nn.Module) -> bool:
    """Whether the module, or a module inside it, is compiled in place."""
    return any(getattr(each, "_compiled_call_impl", None) is not None for each in module.modules())


def graphs_compiled() -> int:
    """Graphs torch has compiled in this process so far (each size, batch or module that needed one)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


WarmRun = Callable[[int, int, int], object]  # (width, height, images): one warm-up generation


@dataclass(frozen=True)
class WarmUp:
    """What a warm-up compiled: graphs and seconds."""

    graphs: int
    seconds: float


def warm_up(run: WarmRun, sizes: Sequence[tuple[int, int]]) -> WarmUp:
    """Compile a prepared pipeline by running it at each (width, height) with one image and with
    WARM_BATCH; afterwards the process runs eagerly any shape no graph covers, so no job waits for a
    compilation. Raises ``CompileError`` where torch.compile fails."""
    if not sizes:
        raise ValueError("warm_up needs at least one size")
    before, began = graphs_compiled(), time.perf_counter()
    runs = [(width, height, images) for width, height in sizes for images in (1, WARM_BATCH)]
    # Compiling is allowed here, whatever the stance a previous model's warm-up left.
    with torch.compiler.set_stance("default"):
        for width, height, images in runs:
            try:
                run(width, height, images)
            except torch._dynamo.exc.TorchDynamoException as exc:
                # Two lines say what failed ("backend='inductor' raised:", then the error); the
                # rest, hints and the traceback, stays in the cause.
                said = " ".join([line.strip() for line in str(exc).splitlines() if line.strip()][:2])
                raise CompileError(f"torch.compile failed at {width}x{height} ({images} images); "
                                   f"SLOTQ_COMPILE=off serves uncompiled. {type(exc).__name__}: {said}"
                                   ) from exc
    torch.compiler.set_stance("eager_on_recompile")
    done = WarmUp(graphs_compiled() - before, time.perf_counter() - began)
    log.info("compiled %d graphs in %.1f s (sizes %s)", done.graphs, done.seconds,
             ", ".join(f"{width}x{height}" for width, height in sizes))
    return done


def max_rank(lora_dir: Path) -> int:
    """The largest LoRA rank among the folder's adapters (from the files' headers), at least 1."""
    ranks = [1]
    for name in available_adapters(lora_dir):
        with safe_open(adapter_path(lora_dir, name), framework="pt") as weights:
            ranks += [weights.get_slice(key).get_shape()[0] for key in weights.keys()
                      if key.endswith("weight") and any(down in key for down in DOWN_WEIGHTS)]
    return max(ranks)


def widest_adapter(lora_dir: Path) -> str:
    """The folder's adapter with the most weights: the one that fills the slots, so that any other
    targets the same layers or fewer (hot-swapping cannot add a layer)."""
    names = available_adapters(lora_dir)
    if not names:
        raise ValueError(f"{lora_dir} holds no adapter (*.safetensors) to fill the compiled slots with")

    def width(name: str) -> int:
        with safe_open(adapter_path(lora_dir, name), framework="pt") as weights:
            return len(list(weights.keys()))

    return max(names, key=width)


def _holds_slots(denoiser: ModelMixin) -> bool:
    """Whether the denoiser holds LoRA layers (then they must be the slots)."""
    return any(isinstance(module, LoraLayer) for module in denoiser.modules())


@dataclass
class AdapterSlots:
    """MAX_LORAS adapter slots on a pipeline, filled and active before it compiles; a job's adapters
    are hot-swapped into them and scaled in place, so no change of adapters recompiles."""

    pipe: DiffusionPipeline
    lora_dir: Path
    widest: str  # the adapter the slots were filled with: their layers
    rank: int  # their rank
    held: list[str | None] = field(default_factory=lambda: [None] * len(SLOTS))  # the adapter in each
    swaps: int = 0  # adapters swapped in from disk since start
    # Per slot: each LoRA layer's scaling tensor with the adapter's own scaling (alpha / rank).
    _scalings: list[list[tuple[torch.Tensor, float]]] = field(default_factory=list)
    _applied: list[float | None] = field(default_factory=lambda: [None] * len(SLOTS))
    _used: list[int] = field(default_factory=lambda: [0] * len(SLOTS))  # each slot's last use
    _uses: int = 0

    @classmethod
    def ready(cls, pipe: DiffusionPipeline, lora_dir: Path) -> AdapterSlots:
        """Fill every slot of an uncompiled pipeline with the folder's widest adapter, padded to its
        largest rank (diffusers' ``enable_lora_hotswap``), all active at scale 0: the bare model."""
        rank, widest = max_rank(lora_dir), widest_adapter(lora_dir)
        path = adapter_path(lora_dir, widest)
        with warnings.catch_warnings():
            # peft warns at each adapter past the first that the model holds several: here it should.
            warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
            for slot in SLOTS:
                # A load pads the layers and makes their scalings tensors only where hot-swap was
                # enabled just before it; "ignore": the slots loaded before this one are meant.
                pipe.enable_lora_hotswap(target_rank=rank, check_compiled="ignore")
                pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=slot)
        denoiser_of(pipe).set_adapter(list(SLOTS))  # active, without rewriting the scalings
        slots = cls(pipe, lora_dir, widest, rank)
        slots._scalings = [slots._read_scalings(slot) for slot in SLOTS]
        for index in range(len(SLOTS)):
            slots._scale(index, 0.0)
        log.info("adapter slots ready: %d x %s, rank %d", len(SLOTS), widest, rank)
        return slots

    def use(self, loras: Sequence[LoraRef]) -> None:
        """Run the pipeline with exactly these adapters at these scales (none: the bare model)."""
        wanted = {lora.name: lora.scale for lora in loras}
        self._uses += 1
        # Into the slots the job leaves free: an empty one first, else the least recently used.
        free = sorted((index for index, held in enumerate(self.held) if held not in wanted),
                      key=lambda index: (self.held[index] is not None, self._used[index]))
        for name in (name for name in wanted if name not in self.held):
            self._swap(free.pop(0), name)
        for index, held in enumerate(self.held):
            if held in wanted:
                self._used[index] = self._uses
            self._scale(index, wanted[held] if held in wanted else 0.0)

    def _swap(self, index: int, name: str) -> None:
        """Hot-swap an adapter from disk into a slot, replacing its weights and scalings in place."""
        began, slot = time.perf_counter(), SLOTS[index]
        path = adapter_path(self.lora_dir, name)
        try:
            self.pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=slot,
                                        hotswap=True)
        except Exception as exc:
            # A refused adapter (a layer the slots lack, a larger rank) may leave the slot half
            # swapped: it holds nothing from now on, at scale 0, until another adapter fills it.
            self.held[index], self._applied[index] = None, None
            self._scale(index, 0.0)
            raise ValueError(f"LoRA {name} cannot be swapped into this compiled worker's adapter slots, "
                             f"which take the layers of {self.widest} (or fewer) up to rank {self.rank} "
                             f"and no text encoder: {exc}") from exc
        self.held[index] = name
        self._scalings[index] = self._read_scalings(slot)
        self._applied[index] = None
        self.swaps += 1
        log.info("swapped LoRA %s into %s in %.2f s", name, slot, time.perf_counter() - began)

    def _read_scalings(self, slot: str) -> list[tuple[torch.Tensor, float]]:
        """The slot's scaling tensors and the values its adapter gave them (one read per layer)."""
        layers = (module for module in denoiser_of(self.pipe).modules() if isinstance(module, LoraLayer))
        found = [(layer.scaling[slot], float(layer.scaling[slot]))
                 for layer in layers if slot in layer.scaling]
        if not found or not all(isinstance(tensor, torch.Tensor) for tensor, _ in found):
            raise RuntimeError(f"peft's LoRA scalings of {slot} are not tensors: hot-swap was not enabled "
                               "before the slot was loaded (or peft changed how it holds them)")
        return found

    def _scale(self, index: int, scale: float) -> None:
        """Write a slot's scale into its scaling tensors, in place (a Python float would recompile)."""
        if self._applied[index] == scale:
            return
        for tensor, own in self._scalings[index]:
            tensor.fill_(own * scale)
        self._applied[index] = scale
