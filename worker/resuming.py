"""Step checkpoints: a job's denoising state, saved while it runs, so that the attempt after a crash, a
drain or a restart resumes at the step it had reached rather than at step 0.

A step-level job's (worker/joining.py), and a job run alone as a whole-pipeline call that can resume
(worker/whole_calls.py: a clip, an image job of the normal tier): the latter's state is the call's latents
after a step, its generators' states and its sampler's, and its next attempt calls the pipeline with
those latents, its first steps skipped and its sampler's state put back (:func:`resumed_call`),
which makes the same bytes.

Every SLOTQ_CHECKPOINT_EVERY_S at most, and only once a step has passed since the last save, the
worker reads each running job's flights out of the loop (their step, latents, sampler state and
generator state: ``SteppingLoop.state_of``) and keeps them in the result store under the attempt's
fence (``Results.save_checkpoint``); a drain saves them once more before it hands the jobs back.
The next attempt at the job encodes its prompt again and puts its flights where the checkpoint
says, so it makes the bytes an uninterrupted run makes. A checkpoint is tied to the job's request
and model by a fingerprint: one that does not fit (another model or request, another format, bytes
that do not load) is logged and ignored, and the job starts at step 0. The job's end deletes it.

Checkpoints load with ``torch.load(weights_only=True)``: tensors, numbers and containers, never code.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from rq.job import Job

from shared.contract.jobs import JobRequest
from shared.store import waiting
from worker.stepping import Flight, SteppingLoop, checked_sampler_state, put_sampler_state, sampler_state

log = logging.getLogger(__name__)
FORMAT = 1  # of the saved dict; a checkpoint of another format is ignored
PIPELINE_FORMAT = 101  # of a whole-pipeline call's: the two never resume each other


class CheckpointError(ValueError):
    """A checkpoint that this job cannot resume from: why, for the log."""


def fingerprint(job: Job, pipeline_class: str) -> str:
    """What ties a checkpoint to its job: the stored request, the model it runs on and its pipeline."""
    identity = {"request": job.kwargs.get("request"), "model": waiting.job_model(job),
                "pipeline": pipeline_class}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def dump(print_of: str, flights: list[dict[str, Any]]) -> bytes:
    """A checkpoint's bytes: the flights' states (``SteppingLoop.state_of``) under the job's fingerprint."""
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, "fingerprint": print_of, "flights": flights}, buffer)
    return buffer.getvalue()


def load(data: bytes, print_of: str) -> dict[int, dict[str, Any]]:
    """The flights' states of a checkpoint by image, or ``CheckpointError`` where it is not this job's."""
    flights = _opened(data, print_of, FORMAT, "a checkpoint of this format").get("flights")
    if not isinstance(flights, list) or not all(isinstance(each, dict) for each in flights):
        raise CheckpointError("it holds no flights")
    return {each.get("image"): each for each in flights}


def _opened(data: bytes, print_of: str, kind: int, what: str) -> dict[str, Any]:
    """A checkpoint's saved dict, where it loads, is of this kind and was saved for this job."""
    try:
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # what a corrupt file raises varies: pickle, zip, torch errors
        raise CheckpointError(f"it does not load ({type(exc).__name__}: {exc})") from exc
    if not isinstance(saved, dict) or saved.get("format") != kind:
        raise CheckpointError(f"it is not {what}")
    if saved.get("fingerprint") != print_of:
        raise CheckpointError("it was saved for another request or model")
    return saved


def resume(loop: SteppingLoop, job: Job, request: JobRequest, flights: list[Flight],
           checkpoint: tuple[int, bytes]) -> list[Flight]:
    """A job's flights just admitted, put where its checkpoint (the step it was saved at, its bytes)
    says where it fits them all; else, the reason logged, its flights afresh at step 0."""
    step, data = checkpoint
    try:
        states = load(data, fingerprint(job, type(loop.pipe).__name__))
        for flight in flights:
            loop.restore(flight, states.get(flight.image, {}))
    except ValueError as exc:  # CheckpointError, or a state that does not fit a flight
        log.warning("job %s: its step checkpoint of step %d is not one it can resume from (%s): it starts "
                    "at step 0", job.id, step, exc)
        for flight in flights:  # some may have taken their state already
            loop.cancel(flight)
        return loop.admit_all(request)
    log.info("job %s resumes at step %d of %d, from its step checkpoint", job.id, flights[0].step,
             flights[0].total)
    return flights


@dataclass(frozen=True)
class Resumption:
    """Where a whole-pipeline call resumes: after ``step`` steps, from these latents (as the pipeline's
    loop holds them), its generators in these states, its sampler in this one (``stepping.sampler_state``:
    a multistep sampler's past predictions among it)."""

    step: int
    latents: torch.Tensor
    generators: list[torch.Tensor]
    sampler: dict[str, Any] = field(default_factory=dict)


def dump_call(print_of: str, step: int, latents: torch.Tensor, generators: list[torch.Generator],
              sampler: Any) -> bytes:
    """A whole-pipeline call's checkpoint after ``step`` steps, ``sampler`` the scheduler it runs."""
    buffer = io.BytesIO()
    torch.save({"format": PIPELINE_FORMAT, "fingerprint": print_of, "step": step,
                "latents": latents.detach().to("cpu", copy=True),
                "generators": [generator.get_state() for generator in generators],
                "sampler": type(sampler).__name__, "state": sampler_state(sampler)}, buffer)
    return buffer.getvalue()


def load_call(data: bytes, print_of: str, generators: int, sampler: str) -> Resumption:
    """A whole-pipeline call's checkpoint, or ``CheckpointError`` where it is not this job's (``sampler``:
    the class of the scheduler the job runs)."""
    saved = _opened(data, print_of, PIPELINE_FORMAT, "a checkpoint of a whole-pipeline call")
    step, latents, states = saved.get("step"), saved.get("latents"), saved.get("generators")
    if not (isinstance(step, int) and step >= 1 and isinstance(latents, torch.Tensor)
            and isinstance(states, list) and len(states) == generators
            and all(isinstance(state, torch.Tensor) for state in states)):
        raise CheckpointError("its step, latents or generator states are missing or malformed")
    state = saved.get("state")
    if saved.get("sampler") != sampler or not isinstance(state, dict):
        raise CheckpointError(f"its sampler state is another sampler's than the job's {sampler}")
    return Resumption(step, latents, states, state)


@contextmanager
def resumed_call(pipe: Any, scheduler: Any, resume: Resumption, generators: list[torch.Generator],
                 device: torch.device) -> Iterator[None]:
    """Inside the block, the pipeline's next call resumes after ``resume.step`` iterations of its loop.

    It prepares what it prepares as the uninterrupted call did (its generators as they were made: an
    inpainting pipeline keeps the noise it draws), then takes the saved latents for the ones it made,
    skips its first ``resume.step`` iterations and steps on from there: its sampler with the saved state
    put back after its timesteps were set (a multistep sampler's past predictions; tensors on ``device``
    where its own are on none), the generators in their saved states from its first step (or from the
    block's end, where no step was left). The pipeline sees its whole schedule, so what it derives from
    it (an image-to-image call's start, a ControlNet's window) is the uninterrupted call's."""
    pending = [resume.generators]

    def generators_as_saved() -> None:
        if pending:
            for generator, state in zip(generators, pending.pop(), strict=True):
                generator.set_state(state)

    with (_sampler_from(scheduler, resume.step, resume.sampler, device, generators_as_saved),
          _prepared_as(pipe, resume.latents.to(device)), _skipping(pipe, resume.step)):
        yield
    generators_as_saved()  # where no step was left to run


@contextmanager
def _sampler_from(scheduler: Any, step: int, state: dict[str, Any], device: torch.device,
                  first_step: Callable[[], None]) -> Iterator[None]:
    """Inside the block, the scheduler takes its saved ``state`` back each time its timesteps are set:
    its step index among it, so it steps on from ``step`` of the schedule; ``first_step`` runs before
    each of its steps."""
    own_timesteps, own_step = scheduler.set_timesteps, scheduler.step

    @functools.wraps(own_timesteps)  # its signature: diffusers' retrieve_timesteps reads its parameters
    def set_timesteps(*args: Any, **kwargs: Any) -> None:
        own_timesteps(*args, **kwargs)
        if step > len(scheduler.timesteps):  # equal: a hires job's first pass, all of it run already
            raise CheckpointError(f"step {step} is past the schedule's {len(scheduler.timesteps)}")
        _put_state(scheduler, state, device)

    @functools.wraps(own_step)  # its signature: pipelines read which keywords it takes
    def step_once(*args: Any, **kwargs: Any) -> Any:
        first_step()
        return own_step(*args, **kwargs)

    scheduler.set_timesteps, scheduler.step = set_timesteps, step_once
    try:
        yield
    finally:
        del scheduler.set_timesteps, scheduler.step  # the class's own again


@contextmanager
def _prepared_as(pipe: Any, latents: torch.Tensor) -> Iterator[None]:
    """Inside the block, the pipeline's ``prepare_latents`` hands back ``latents`` for the ones it made;
    what else it prepares (Flux's latent ids, an inpainting call's noise and image latents, a start
    image's condition) stays as made."""
    own = pipe.prepare_latents

    def prepare(*args: Any, **kwargs: Any) -> Any:
        prepared = own(*args, **kwargs)
        return latents if isinstance(prepared, torch.Tensor) else (latents, *prepared[1:])

    pipe.prepare_latents = prepare
    try:
        yield
    finally:
        del pipe.prepare_latents  # the class's own again


_skippers: dict[type, type] = {}


@contextmanager
def _skipping(pipe: Any, count: int) -> Iterator[None]:
    """Inside the block, the pipeline's loop skips its first ``count`` iterations: diffusers' loops begin
    each with ``if self.interrupt: continue`` (their one read of it), which the pipeline answers yes
    ``count`` times. Its class is a subclass of its own for the block (same name), since ``interrupt``
    is a property of the class."""
    own = type(pipe)
    if own not in _skippers:
        _skippers[own] = type(own.__name__, (own,), {"interrupt": property(_interrupt_or_skip),
                                                     "__module__": own.__module__})
    vars(pipe)["_skip_left"] = count
    pipe.__class__ = _skippers[own]
    try:
        yield
    finally:
        pipe.__class__ = own
        vars(pipe).pop("_skip_left", None)


def _interrupt_or_skip(pipe: Any) -> bool:
    left = vars(pipe).get("_skip_left", 0)
    if left > 0:
        vars(pipe)["_skip_left"] = left - 1
        return True
    return bool(pipe._interrupt)


def _put_state(scheduler: Any, state: dict[str, Any], device: torch.device) -> None:
    """A saved sampler state put into the scheduler whose timesteps were just set; ``CheckpointError``
    where it does not fit."""
    try:
        put_sampler_state(scheduler, checked_sampler_state(scheduler, state), device)
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None


@dataclass
class Cadence:
    """When a job's next checkpoint is due: ``every_s`` after its start or its last save, once a step has
    passed since (``every_s`` 0: never)."""

    every_s: float
    saved_at: float = field(default_factory=time.monotonic)
    saved_step: int = 0

    def due(self, step: int, now: float | None = None, at_once: bool = False) -> bool:
        if self.every_s <= 0 or step <= self.saved_step:
            return False
        return at_once or (time.monotonic() if now is None else now) - self.saved_at >= self.every_s

    def saved(self, step: int, now: float | None = None) -> None:
        self.saved_at, self.saved_step = time.monotonic() if now is None else now, step


__all__ = ["FORMAT", "PIPELINE_FORMAT", "Cadence", "CheckpointError", "Resumption", "dump", "dump_call",
           "fingerprint", "load", "load_call", "resume", "resumed_call"]
