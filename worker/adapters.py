"""LoRA adapters on the loaded pipeline: loaded on first use, kept resident up to SLOTQ_LORA_CACHE,
the least recently used unloaded first, and set per execution to exactly the job's adapters.

Loading and switching are diffusers' own (``load_lora_weights`` with an ``adapter_name``,
``set_adapters``, ``delete_adapters``; peft underneath). The adapters go into the pipeline's
modules, which its image-to-image and inpainting twins share, so one load serves every kind of job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.contract.adapters import LoraRef, adapter_path, adapters_key
from worker.resident import Resident

if TYPE_CHECKING:
    from worker.compile import AdapterSlots

log = logging.getLogger(__name__)


class Adapters:
    """The adapters resident on one pipeline, most recently used last."""

    def __init__(self, lora_dir: Path | None, capacity: int) -> None:
        self.lora_dir, self.capacity = lora_dir, capacity
        self.resident: Resident[str, None] = Resident(capacity)
        self.loads = 0  # adapters loaded from disk since start
        self._active: tuple[tuple[str, float], ...] = ()
        self._last = ""
        # A compiled pipeline's adapters are swapped into fixed slots instead (worker/compile.py):
        # loading one by name would recompile.
        self.slots: AdapterSlots | None = None

    @property
    def holding(self) -> tuple[str, tuple[str, ...]]:
        """The adapters key of the set that ran last ('' for the bare model) and the resident names:
        what the claim's affinity prefers (shared/store/lua/lib/line.lua)."""
        if self.slots is not None:
            return self._last, tuple(name for name in self.slots.held if name is not None)
        return self._last, tuple(self.resident)

    def use(self, pipe: Any, loras: list[LoraRef]) -> None:
        """Make ``pipe`` run with exactly these adapters at these scales (none: the bare model)."""
        wanted = tuple((lora.name, lora.scale) for lora in loras)
        self._last = adapters_key(loras)
        if self.slots is not None:
            self.slots.use(loras)
            return
        for lora in loras:
            self._resident(pipe, lora.name, keep={name for name, _ in wanted})
        if wanted == self._active:
            return
        if wanted:
            pipe.enable_lora()
            pipe.set_adapters([name for name, _ in wanted], adapter_weights=[scale for _, scale in wanted])
        elif self.resident:
            pipe.disable_lora()  # resident but unused: the bare model's own weights run
        self._active = wanted

    def _resident(self, pipe: Any, name: str, keep: set[str]) -> None:
        """Load the adapter unless it is resident, unloading the least recently used over capacity."""
        if name in self.resident:
            self.resident.touch(name)
            return
        if self.lora_dir is None:
            raise FileNotFoundError("SLOTQ_LORA_DIR is not set: this worker has no adapters")
        self._unload(pipe, self.resident.make_room(keep))  # a job's own adapters stay, even over capacity
        began = time.perf_counter()
        path = adapter_path(self.lora_dir, name)
        pipe.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=name)
        self._unload(pipe, self.resident.put(name, None, keep))  # none: room was made
        self.loads += 1
        self._active = ()  # loading activates the new adapter: set the job's set again
        log.info("loaded LoRA %s in %.2f s", name, time.perf_counter() - began)

    def _unload(self, pipe: Any, evicted: Iterable[str]) -> None:
        """Take the evicted adapters out of the pipeline."""
        for name in evicted:
            pipe.delete_adapters(name)
            self._active = ()  # the active set named it
            log.info("unloaded LoRA %s", name)
