"""The memory settings of a model, for big models on small cards: where its weights live while it runs
(CPU offload), how its VAE decodes (slicing, tiling) and whether its denoiser is quantized.

Set for every model by SLOTQ_OFFLOAD, SLOTQ_VAE_SLICING, SLOTQ_VAE_TILING and SLOTQ_QUANTIZE, and per
model by the ``"memory"`` object of its sidecar in SLOTQ_MODELS_DIR (shared/contract/checkpoints.py);
the worker applies them (worker/memory.py) and refuses at start what the device or the installed
packages cannot do.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Offload = Literal["none", "model", "sequential"]
Quantize = Literal["none", "bnb-4bit", "torchao-int8"]


class MemoryOptions(BaseModel):
    """How one model is held in memory; the defaults hold it whole on its device, unquantized."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # model: each component moves to the device while it runs (accelerate's hooks); sequential: each
    # layer does, the least memory and the slowest.
    offload: Offload = "none"
    vae_slicing: bool = False  # a batch's images decoded one at a time
    vae_tiling: bool = False  # a large image decoded in overlapping tiles
    quantize: Quantize = "none"  # the denoiser's weights (UNet or transformer) at load

    def merged(self, overrides: dict[str, object]) -> MemoryOptions:
        """These options with a sidecar's own values over them (validated as a whole)."""
        return MemoryOptions.model_validate(self.model_dump() | overrides)
