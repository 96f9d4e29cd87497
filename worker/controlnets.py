"""ControlNets on the loaded pipeline: models loaded on first use and kept up to SLOTQ_CONTROLNET_CACHE,
the least recently used dropped first; the ControlNet pipeline of a job's kind over the loaded one's
modules; the call's arguments for a batch's controls; and the canny preprocessor.

Loading and running are diffusers' own: ``ControlNetModel.from_pretrained`` (diffusers' layout) and
``from_single_file`` (one file, its configuration that of the base UNet's ControlNet or a sidecar
``<name>.json``), and the ControlNet pipelines made with ``from_pipe``, which share the loaded
pipeline's UNet, VAE and text encoders: a job with controls adds its ControlNets' weights, no second
copy of the model's.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import cv2
import numpy as np
import torch
from accelerate import init_empty_weights
from diffusers import (
    AutoPipelineForImage2Image,
    AutoPipelineForInpainting,
    AutoPipelineForText2Image,
    ControlNetModel,
    DiffusionPipeline,
    MultiControlNetModel,
)
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from shared.contract.controlnets import CONFIG, SIDECAR_SUFFIX, controlnet_paths
from shared.contract.jobs import JobKind
from worker.resident import Resident

log = logging.getLogger(__name__)

# The AutoPipeline of each kind picks the ControlNet pipeline of the loaded one's family.
AUTO_PIPELINES = {"text": AutoPipelineForText2Image, "image": AutoPipelineForImage2Image,
                  "inpaint": AutoPipelineForInpainting}
CPU = torch.device("cpu")
# What the ControlNet pipelines make of a control image (their control_image_processor): RGB in [0, 1].
CONTROL_IMAGES = VaeImageProcessor(do_convert_rgb=True, do_normalize=False)


class ControlNets:
    """The ControlNet models a worker holds for one of its models, most recently used last."""

    def __init__(self, folder: Path | None = None, model: str = "", capacity: int = 2,
                 device: torch.device = CPU, dtype: torch.dtype = torch.float32, unet: Any = None) -> None:
        self.folder, self.model, self.capacity = folder, model, capacity
        self.device, self.dtype, self.unet = device, dtype, unet  # the base's: a single file's default layout
        self.resident: Resident[str, ControlNetModel] = Resident(capacity)
        self.loads = 0  # ControlNets loaded from disk since start

    @property
    def holding(self) -> tuple[str, ...]:
        """The resident ControlNets' names: what the claim's affinity prefers."""
        return tuple(self.resident)

    def get(self, name: str) -> ControlNetModel:
        """The ControlNet of this name, loaded unless resident, on the device in the dtype. One dropped
        for it stays in memory while a pipeline made with it does."""
        held = self.resident.get(name)
        if held is not None:
            return held
        path = controlnet_paths(self.folder, self.model).get(name)
        if path is None:
            raise FileNotFoundError(f"no ControlNet {name!r} for {self.model} in SLOTQ_CONTROLNET_DIR "
                                    f"({self.folder})")
        for evicted in self.resident.make_room():
            log.info("dropped ControlNet %s", evicted)
        began = time.perf_counter()
        controlnet = self._load(path).to(self.device).eval()
        self.resident.put(name, controlnet)  # evicts none: room was made
        self.loads += 1
        log.info("loaded ControlNet %s in %.2f s", name, time.perf_counter() - began)
        return controlnet

    def _load(self, path: Path) -> ControlNetModel:
        """A ControlNet from its diffusers folder or its single file, from disk only."""
        if path.is_dir():
            return ControlNetModel.from_pretrained(path, dtype=self.dtype, use_safetensors=True,
                                                   local_files_only=True)
        sidecar = path.with_suffix(SIDECAR_SUFFIX)
        if sidecar.is_file():
            return ControlNetModel.from_single_file(path, config=str(sidecar), dtype=self.dtype,
                                                    local_files_only=True)
        with tempfile.TemporaryDirectory() as folder:  # from_single_file reads a configuration from disk
            self._base_layout().save_config(folder)
            return ControlNetModel.from_single_file(path, config=str(Path(folder) / CONFIG), dtype=self.dtype,
                                                    local_files_only=True)

    def _base_layout(self) -> ControlNetModel:
        """A ControlNet of the base UNet's layout with no weights (meta tensors): its configuration."""
        with init_empty_weights():
            return ControlNetModel.from_unet(self.unet, load_weights_from_unet=False)


def controlled(base: DiffusionPipeline, kind: JobKind, nets: Sequence[ControlNetModel]) -> DiffusionPipeline:
    """The ControlNet pipeline of this kind over the base pipeline's modules, with these ControlNets (two
    or more: diffusers' MultiControlNetModel). Cheap to make (it wraps modules), so it is made per call
    and holds no ControlNet longer."""
    if not nets:
        raise ValueError("a ControlNet pipeline needs a ControlNet")
    controlnet = nets[0] if len(nets) == 1 else MultiControlNetModel(list(nets))
    pipe = AUTO_PIPELINES[kind].from_pipe(base, controlnet=controlnet)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class ControlSetting(Protocol):
    """How one ControlNet acts: the job contract's control, or anything with these."""

    @property
    def scale(self) -> float: ...  # its residuals' factor: 0 as if absent

    @property
    def start(self) -> float: ...  # the fraction of the steps before it acts

    @property
    def end(self) -> float: ...  # the fraction of the steps after which it stops


def control_arguments(kind: JobKind, controls: Sequence[ControlSetting],
                      images: Sequence[Sequence[Image.Image]], width: int, height: int) -> dict[str, object]:
    """The call's arguments for a batch's controls: the same controls for every request (its batch key),
    ``images[request][control]`` the control images of each, in order."""
    if not controls or any(len(each) != len(controls) for each in images):
        raise ValueError(f"{len(controls)} controls, control images {[len(each) for each in images]}")
    # Each ControlNet's images as one tensor, a row per request: several ControlNets' pipelines other
    # than SD's text-to-image refuse a list per prompt ("A single batch of multiple conditionings"),
    # and this is the tensor the pipeline would make of the images itself.
    tensors = [CONTROL_IMAGES.preprocess([each[index] for each in images], height=height, width=width)
               for index in range(len(controls))]
    several = len(controls) > 1  # a number where one ControlNet, a list per ControlNet where several

    def values(name: str) -> float | list[float]:
        return [getattr(control, name) for control in controls] if several else getattr(controls[0], name)

    # image-to-image and inpainting take the start image as ``image``
    return {"image" if kind == "text" else "control_image": tensors if several else tensors[0],
            "controlnet_conditioning_scale": values("scale"), "control_guidance_start": values("start"),
            "control_guidance_end": values("end")}


def canny(image: Image.Image, low: int = 100, high: int = 200) -> Image.Image:
    """The image's edges, white on black, in RGB as a ControlNet takes its image: OpenCV's Canny on the RGB
    pixels (a strong gradient in any channel is an edge), as the canny ControlNets' own annotator ran it."""
    edges = cv2.Canny(np.asarray(image.convert("RGB")), low, high)
    return Image.fromarray(edges).convert("RGB")
