"""Samplers by name: each built once from the loaded pipeline's own scheduler config, swapped in per job.

Swapping a scheduler costs no reload: a diffusers scheduler is a small object made from the
model's scheduler config (its noise schedule), and the pipeline takes whichever it is given. The
names are the contract's (``shared/contract/models.py``, where each family's record says which it
takes); the table below says what each one is.
"""

from __future__ import annotations

from typing import Any

from diffusers import (
    DDIMScheduler,
    DPMSolverMultistepScheduler,
    EulerAncestralDiscreteScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    UniPCMultistepScheduler,
)

from shared.contract.models import Scheduler

# Each name as the A1111/ComfyUI names it: the scheduler class and its options.
BUILDERS: dict[Scheduler, tuple[Any, dict[str, Any]]] = {
    "ddim": (DDIMScheduler, {}),
    "euler": (EulerDiscreteScheduler, {}),
    "euler_a": (EulerAncestralDiscreteScheduler, {}),
    "dpmpp_2m": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++", "solver_order": 2}),
    "dpmpp_2m_karras": (DPMSolverMultistepScheduler,
                        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True}),
    "unipc": (UniPCMultistepScheduler, {}),
    "flow_euler": (FlowMatchEulerDiscreteScheduler, {}),  # flow matching (Flux): its own Euler
}


class Samplers:
    """The loaded model's own scheduler and the named ones, each made the first time it is asked for."""

    def __init__(self, default: Any) -> None:
        self.default = default
        self._built: dict[Scheduler, Any] = {}

    def get(self, name: Scheduler | None) -> Any:
        """The scheduler for a job's ``scheduler`` field (None: the model's own)."""
        if name is None:
            return self.default
        if name not in self._built:
            kind, options = BUILDERS[name]
            self._built[name] = kind.from_config(self.default.config, **options)
        return self._built[name]
