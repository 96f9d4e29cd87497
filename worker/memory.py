"""A model's memory settings (shared/contract/memory.py) applied to its loaded pipeline, through
diffusers' own offloading, VAE and quantization APIs; what each costs and saves is in docs/memory.md.

``check`` runs at the worker's start, before anything is loaded, and refuses what the device or the
installed packages cannot do. ``place`` puts a pipeline fresh from disk (on the CPU) where it runs;
``unplace`` moves it back to host memory, where the worker keeps it to place again without reading
the disk. Quantization happens once, at the first ``place``, and survives every move after it.

torchao and bitsandbytes are optional and heavy: they are imported by name when a model asks for
them (untyped, and absent from most workers), never at this module's import.
"""

from __future__ import annotations

import importlib
import logging
import tempfile

import torch
from diffusers import DiffusionPipeline

from shared.contract.memory import MemoryOptions, Quantize
from worker import startup

log = logging.getLogger(__name__)

DENOISERS = ("unet", "transformer")  # the attribute of a pipeline's denoiser, by family
# Where the options come from, for messages: the service's settings or the model's own sidecar.
SOURCE = "SLOTQ_{name} or the model's sidecar \"memory\""


class MemorySettingError(ValueError):
    """A memory setting this worker cannot apply (its device or its installed packages); fatal at start."""


def check(options: MemoryOptions, device: torch.device) -> None:
    """Refuse, with what to change, the options this device or the installed packages cannot do."""
    problems: list[str] = []
    if options.offload != "none":
        if device.type != "cuda":
            problems.append(f"offload={options.offload} ({SOURCE.format(name='OFFLOAD')}) moves weights "
                            f"between host memory and a CUDA device, but this worker runs on {device}: set "
                            f"offload to none, or run the worker on a GPU (SLOTQ_DEVICE=cuda)")
        problems += _missing("accelerate", f"offload={options.offload}")
    if options.quantize == "bnb-4bit":
        if device.type != "cuda":
            problems.append(f"quantize=bnb-4bit ({SOURCE.format(name='QUANTIZE')}) runs on CUDA only, but "
                            f"this worker runs on {device}: set quantize to none, or to torchao-int8, which "
                            f"runs on any device")
        problems += _missing("bitsandbytes", "quantize=bnb-4bit")
    if options.quantize == "torchao-int8":
        problems += _missing("torchao", "quantize=torchao-int8")
    if problems:
        raise MemorySettingError("; ".join(problems))


def _missing(package: str, setting: str) -> list[str]:
    """The problem of a package that is not installed, found without importing it."""
    if startup.is_installed(package):
        return []
    return [f"{setting} needs the {package} package, which is not installed: pip install {package} "
            f"(or set {setting.split('=')[0]} to none)"]


def place(pipe: DiffusionPipeline, device: torch.device, options: MemoryOptions) -> None:
    """Put a pipeline held in host memory where it runs: its denoiser quantized once where asked, then
    offloaded to the device or moved there whole, then its VAE's slicing and tiling as asked."""
    if options.quantize != "none":
        _quantize(pipe, options.quantize)
    if options.offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif options.offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        pipe.to(device)
    # Set both ways: the flags are the options', whatever the VAE held before. The pipelines of
    # diffusers 0.42 have no enable_vae_* methods of their own any more; the VAE's are the API.
    vae = pipe.vae
    (vae.enable_slicing if options.vae_slicing else vae.disable_slicing)()
    (vae.enable_tiling if options.vae_tiling else vae.disable_tiling)()


def unplace(pipe: DiffusionPipeline, options: MemoryOptions) -> None:
    """Move a placed pipeline to host memory, to be placed again later without reading the disk."""
    if options.offload != "none":
        # Removing sequential offload's hooks also puts each weight back from the hook's host copy
        # (the modules themselves hold meta tensors while offloaded).
        pipe.remove_all_hooks()
    pipe.to("cpu")


def _quantize(pipe: DiffusionPipeline, kind: Quantize) -> None:
    """Quantize the pipeline's denoiser (UNet or transformer) in place, unless it already is."""
    name = next((name for name in DENOISERS if getattr(pipe, name, None) is not None), None)
    if name is None:
        raise MemorySettingError(f"quantize={kind}: {type(pipe).__name__} has no denoiser "
                                 f"({' or '.join(DENOISERS)}) to quantize")
    denoiser = getattr(pipe, name)
    if _is_quantized(denoiser):
        return  # placed before: quantizing again would quantize the quantized weights
    if kind == "torchao-int8":
        _torchao_int8(denoiser)
    else:
        setattr(pipe, name, _bnb_4bit(denoiser))  # the pipeline's config follows its new module
    log.info("quantized %s's %s with %s", type(pipe).__name__, name, kind)


def _is_quantized(denoiser: torch.nn.Module) -> bool:
    """Whether diffusers loaded it quantized (bitsandbytes) or torchao's tensors hold its weights."""
    if getattr(denoiser, "hf_quantizer", None) is not None:
        return True
    return any(type(weight).__module__.startswith("torchao.") for weight in denoiser.parameters())


def _torchao_int8(denoiser: torch.nn.Module) -> None:
    """torchao's int8 weight-only quantization of every Linear layer, after load (``quantize_``)."""
    startup.release("torchao")  # deferred at the worker's start (worker/startup.py)
    quantization = importlib.import_module("torchao.quantization")
    # Int8WeightOnlyConfig since torchao 0.9; before it, the int8_weight_only() function.
    config = getattr(quantization, "Int8WeightOnlyConfig", None) or quantization.int8_weight_only
    quantization.quantize_(denoiser, config())


def _bnb_4bit(denoiser: torch.nn.Module) -> torch.nn.Module:
    """The denoiser made again with bitsandbytes' 4-bit (NF4) Linear layers, the way diffusers documents
    it (``from_pretrained`` with a ``BitsAndBytesConfig``), from a copy written to a temporary folder:
    that works whatever the pipeline was loaded from (a folder, the hub, a single file), for one write
    of its weights at the first place. bitsandbytes quantizes as it loads onto CUDA, so this is
    untested on the CPU machines of the test suite."""
    from diffusers import BitsAndBytesConfig

    dtype = denoiser.dtype
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="slotq-bnb-") as folder:
        denoiser.save_pretrained(folder)  # type: ignore[operator]
        made: torch.nn.Module = type(denoiser).from_pretrained(  # type: ignore[attr-defined]
            folder, quantization_config=config, dtype=dtype)
    return made
