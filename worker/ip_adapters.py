"""IP-Adapters on the loaded pipeline: one in its UNet at a time, the weights of those used last kept in
memory up to a capacity, the image encoder they share loaded once; and the call's arguments for a batch's
reference images.

Loading, scaling and unloading are diffusers' own (``load_ip_adapter``, ``set_ip_adapter_scale``,
``unload_ip_adapter``). An adapter goes into the pipeline's UNet, which its image-to-image and inpainting
twins share; the image encoder is a pipeline component, which a twin made with ``from_pipe`` before it was
set lacks: ``share_image_encoder`` gives it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from safetensors import safe_open
from transformers import CLIPVisionModelWithProjection

from shared.contract.ip_adapters import image_encoder_path, ip_adapter_paths
from worker.resident import Resident

log = logging.getLogger(__name__)

# An IP-Adapter's weights as diffusers' load_ip_adapter takes them: its file's keys without their prefix.
Weights = dict[str, dict[str, torch.Tensor]]
PARTS = ("image_proj", "ip_adapter")
LATENT_SCALE = 8  # SD's and SDXL's VAEs: a latent pixel per 8x8 pixels


class IpAdapters:
    """The IP-Adapters one pipeline uses for one model, the most recently used last."""

    def __init__(self, folder: Path | None, model: str, capacity: int) -> None:
        self.folder, self.model, self.capacity = folder, model, capacity
        self.resident: Resident[str, Weights] = Resident(capacity)  # on the CPU: a switch copies them over
        self.loads = 0  # IP-Adapters read from disk since start
        self.active: str | None = None  # the one in the pipeline's UNet
        self.encoder: Any = None  # loaded on first use and kept: diffusers' unload drops the pipeline's

    @property
    def holding(self) -> tuple[str, ...]:
        """The resident IP-Adapters' names: what the claim's affinity prefers."""
        return tuple(self.resident)

    def use(self, pipe: Any, name: str | None, scale: float) -> None:
        """Make ``pipe`` run with this IP-Adapter at this scale (0: as if absent, but the call still takes a
        reference image); None: with none, as the bare model."""
        if name is None:
            if self.active is not None:
                # Not scale 0: an UNet with an IP-Adapter refuses a call without a reference image.
                # Cheap: the attention processors are reset; the weights and encoder stay resident.
                pipe.unload_ip_adapter()
                self.active = None
            return
        weights = self._weights(name)
        if name != self.active:
            self._attach_encoder(pipe)
            began = time.perf_counter()
            # A state dict: diffusers reads nothing; subfolder and weight_name name no file.
            pipe.load_ip_adapter(weights, subfolder="", weight_name=name, image_encoder_folder=None)
            self.active = name
            log.info("put IP-Adapter %s in the UNet in %.3f s", name, time.perf_counter() - began)
        pipe.set_ip_adapter_scale(scale)

    def _weights(self, name: str) -> Weights:
        """The IP-Adapter's weights, read unless resident, the least recently used dropped over capacity."""
        held = self.resident.get(name)
        if held is not None:
            return held
        path = ip_adapter_paths(self.folder, self.model).get(name)
        if path is None:
            raise FileNotFoundError(f"no IP-Adapter {name!r} for {self.model} in SLOTQ_IP_ADAPTER_DIR "
                                    f"({self.folder})")
        for evicted in self.resident.make_room():  # the UNet keeps its own copy of the active one
            log.info("dropped IP-Adapter %s", evicted)
        weights: Weights = {part: {} for part in PARTS}
        with safe_open(path, framework="pt", device="cpu") as file:
            for key in file.keys():
                part, _, rest = key.partition(".")
                if part in weights:
                    weights[part][rest] = file.get_tensor(key)
        self.resident.put(name, weights)  # evicts none: room was made
        self.loads += 1
        return weights

    def _attach_encoder(self, pipe: Any) -> None:
        """Set the image encoder on the pipeline, loaded from disk the first time."""
        if self.encoder is None:
            path = image_encoder_path(self.folder, self.model)
            if path is None:
                raise FileNotFoundError(f"no image encoder for {self.model} in SLOTQ_IP_ADAPTER_DIR "
                                        f"({self.folder})")
            began = time.perf_counter()
            self.encoder = CLIPVisionModelWithProjection.from_pretrained(
                path, dtype=pipe.dtype, use_safetensors=True, local_files_only=True).to(pipe.device).eval()
            log.info("loaded the image encoder %s in %.2f s", path, time.perf_counter() - began)
        if pipe.image_encoder is not self.encoder:
            # load_ip_adapter makes the feature extractor (of the encoder's image size) where none is.
            pipe.register_modules(image_encoder=self.encoder)


def share_image_encoder(pipe: Any, twin: Any) -> None:
    """Give a twin made with ``from_pipe`` the pipeline's image encoder and feature extractor as they are
    now: ``from_pipe`` copied the components of its moment, and loading an IP-Adapter sets these anew."""
    for component in ("image_encoder", "feature_extractor"):
        module = getattr(pipe, component, None)
        if getattr(twin, component, None) is not module:
            twin.register_modules(**{component: module})


def ip_adapter_arguments(images: Sequence[Image.Image], *, width: int, height: int, per_request: int = 1,
                         guided: bool = True, device: torch.device | str = "cpu") -> dict[str, object]:
    """The call's arguments for a batch's reference images, one per request in order: each request's
    images are those it makes alone. ``per_request``: images per prompt; ``guided``: classifier-free
    guidance on (the UNet's batch holds the unconditional rows first)."""
    if not images:
        raise ValueError("an IP-Adapter call needs a reference image")
    distinct: dict[bytes, Image.Image] = {}  # by pixels: requests may bring the same picture
    for image in images:
        distinct.setdefault(_pixels(image), image)
    # diffusers gives every prompt of a call all of an adapter's reference images at once (each is four
    # more tokens). Several distinct ones are told apart by diffusers' IP-Adapter masks, one row per row
    # of the UNet's batch: 1 over the whole image for the request's own, 0 for the others'.
    arguments: dict[str, object] = {"ip_adapter_image": [list(distinct.values())]}
    if len(distinct) == 1:
        return arguments
    slots = {pixels: slot for slot, pixels in enumerate(distinct)}
    rows = [slots[_pixels(image)] for image in images for _ in range(per_request)] * (2 if guided else 1)
    # At the latents' size: each attention layer's is that divided by a power of 2, which diffusers'
    # bicubic downsampling turns into exact 0s and 1s.
    mask = torch.zeros(len(rows), len(distinct), height // LATENT_SCALE, width // LATENT_SCALE, device=device)
    for row, slot in enumerate(rows):
        mask[row, slot] = 1.0
    arguments["cross_attention_kwargs"] = {"ip_adapter_masks": [mask]}
    return arguments


def _pixels(image: Image.Image) -> bytes:
    return f"{image.mode}:{image.size}:".encode() + image.tobytes()
