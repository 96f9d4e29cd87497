"""The models one worker serves and which of them are loaded (SLOTQ_WORKER_MODELS).

Up to SLOTQ_MODEL_CACHE pipelines stay on the device. On a GPU worker, one pushed off the device is
kept in host memory (up to SLOTQ_HOST_MODEL_CACHE, while the host has room for it) and moved back
with ``.to()`` rather than read from disk again; on the CPU the device is host memory, so a pipeline
pushed off is dropped. The least recently used goes first. The claim prefers jobs of the models
held (shared/store/lua/lib/line.lua), so a mixed line does not switch on every job.

A worker may let go of its device altogether (:meth:`Models.release`: idle, held by an operator, or
yielding to another program): every pipeline goes the way of one pushed off, and the next job's
model is brought back as after a switch.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import torch

from shared.contract.settings import Settings
from shared.store.claims import Holding
from shared.store.workers import ModelPlace, Place
from worker import memory
from worker.pipeline import ImagePipeline, load_pipeline, set_current_pipeline
from worker.resident import Resident

log = logging.getLogger(__name__)
HOST_HEADROOM = 1.5  # a model kept in host memory leaves at least half its size free besides
Source = Literal["device", "host", "disk"]


@dataclass(frozen=True)
class Switch:
    """How a model became current: from where, and in how many seconds (0 when it already was)."""

    model: str
    source: Source
    seconds: float


class Models:
    """The pipelines of the models this worker serves: the current one, those on the device and those
    in host memory, most recently used last."""

    def __init__(self, settings: Settings, first: ImagePipeline) -> None:
        self.settings = settings
        self.served = settings.served_models
        # The first served model's, as loaded at start (a benchmark's stand-in may name itself otherwise).
        # None once the worker let go of its device (release()), until a job brings its model back.
        self.current: ImagePipeline | None = first
        self.current_model = self.served[0]
        # What every pipeline of this worker shares: its device, its device's time, torch's threads.
        self.device, self.device_time, self.threads = first.device, first.device_time, first.threads
        # By count: the settings size the caches; whether host memory has room is asked per pipeline.
        self.on_device: Resident[str, ImagePipeline] = Resident(settings.model_cache, self._off_device)
        self.in_host: Resident[str, ImagePipeline] = Resident(settings.host_model_cache, self._dropped)
        started = datetime.now(UTC)
        self._since: dict[str, tuple[Place, datetime]] = dict.fromkeys(self.served, ("released", started))
        self._places: list[ModelPlace] | None = None  # built again after a move only (hot path)
        self.on_device.put(self.current_model, first)
        self._moved(self.current_model, "on_device")
        set_current_pipeline(first)

    @property
    def holding(self) -> Holding:
        """What the next claim prefers: the current model and its adapters, and the models on the device
        (nothing once released)."""
        if self.current is None:
            return Holding()
        adapters, resident = self.current.holding
        on_device = (self.current_model, *(name for name in reversed(self.on_device)
                                           if name != self.current_model))
        return Holding(self.current_model, adapters, resident, on_device)

    @property
    def places(self) -> list[ModelPlace]:
        """Where each served model is, and since when (the same list until a model moves)."""
        if self._places is None:
            self._places = [ModelPlace(model=model, place=place, since=since)
                            for model, (place, since) in self._since.items()]
        return self._places

    def use(self, model: str) -> Switch:
        """Make the model's pipeline the current one: it is on the device already, or it comes back
        from host memory, or it is loaded from disk (pushing the least recently used off the device)."""
        if model not in self.served:
            raise KeyError(f"this worker does not serve {model}")  # its lines are the only ones it claims
        began, source = time.perf_counter(), self._source(model)
        held = self.on_device.get(model)
        pipeline = held if held is not None else self._bring(model)
        if pipeline is not self.current:
            self.current_model, self.current = model, pipeline
            set_current_pipeline(pipeline)
        switch = Switch(model, source, 0.0 if source == "device" else time.perf_counter() - began)
        if source != "device":
            self._moved(model, "on_device")
            log.info("model %s now on %s: from %s in %.2f s", model, pipeline.device, source, switch.seconds)
        return switch

    def release(self) -> bool:
        """Let go of the device: every pipeline on it goes to host memory where there is room (a GPU
        worker's), else is dropped, and its memory is freed. False where nothing was on it."""
        if self.current is None:
            return False
        released = self.on_device.evict_all()
        self.current = None
        set_current_pipeline(None)  # the last references: the pipelines dropped can be freed
        self._free()
        log.info("let go of the device: %s", ", ".join(f"{name} {self._since[name][0]}" for name in released))
        return True

    def _source(self, model: str) -> Source:
        if model in self.on_device:
            return "device"
        return "host" if model in self.in_host else "disk"

    def _bring(self, model: str) -> ImagePipeline:
        """The model's pipeline onto the device, from host memory or from disk, room made for it first."""
        # Out of host memory's cache before room is made: the pipeline pushed there could evict this one.
        pipeline = self.in_host.pop(model)
        self._make_room()
        if pipeline is None:
            pipeline = self._load(model)
        else:
            memory.place(pipeline.pipe, pipeline.device, pipeline.memory)
        pipeline.device_time = self.device_time  # one device, one account whichever model runs
        self.on_device.put(model, pipeline)
        return pipeline

    def _load(self, model: str) -> ImagePipeline:
        return load_pipeline(self.settings, model, self.threads)

    def _make_room(self) -> None:
        """Push the least recently used pipelines off the device until one more fits the cache."""
        if self.on_device.make_room():
            self._free()

    def _free(self) -> None:
        """Free the memory of the pipelines just pushed off the device: only now are they unreferenced."""
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if str(self.device) == "cpu":
            trim_heap()

    def _off_device(self, name: str, pipeline: ImagePipeline) -> None:
        """Keep a pipeline pushed off the device in host memory where there is room (else it is dropped)."""
        if pipeline.device.type != "cpu" and self._host_has_room(pipeline):
            memory.unplace(pipeline.pipe, pipeline.memory)
            self.in_host.put(name, pipeline)
            self._moved(name, "in_host")
        else:
            self._moved(name, "released")

    def _dropped(self, name: str, pipeline: ImagePipeline) -> None:
        self._moved(name, "released")

    def _moved(self, name: str, place: Place) -> None:
        if self._since[name][0] != place:
            self._since[name], self._places = (place, datetime.now(UTC)), None

    def _host_has_room(self, pipeline: ImagePipeline) -> bool:
        """Whether host memory can keep this pipeline (SLOTQ_HOST_MODEL_CACHE, and the host's free memory)."""
        if not self.settings.host_model_cache:
            return False
        return available_memory() > HOST_HEADROOM * weight_bytes(pipeline)


def weight_bytes(pipeline: ImagePipeline) -> int:
    """The bytes of a pipeline's weights (every module's parameters and buffers)."""
    modules = [each for each in pipeline.pipe.components.values() if isinstance(each, torch.nn.Module)]
    return sum(tensor.numel() * tensor.element_size()
               for module in modules for tensor in (*module.parameters(), *module.buffers()))


def available_memory() -> int:
    """The memory this process may still take, in bytes: the host's available memory (Linux's
    MemAvailable), or less where the container's cgroup limit leaves less; 0 where unknown."""
    available = _meminfo_available()
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, int(limit) - used)


def _meminfo_available() -> int:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's ``malloc_trim``), so that the memory
    of dropped weights shows as the process's no longer; nothing where the C library is another."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass
