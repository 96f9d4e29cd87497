"""A job's steps in its whole-pipeline call: its step checkpoints and its resume from one, and its
preemption at a step by a job of a higher class. Every clip's call, and every image job's in the
normal tier that runs as one (what the step-level loop does not run: an input image, a hires pass,
ControlNets, an IP-Adapter, LoRAs, weighted prompts, a sampler it has not; any job, with the loop off).

Run alone, such a job saves its denoising state every SLOTQ_CHECKPOINT_EVERY_S at most, and at the
step a drain interrupts it (worker/resuming.py); the attempt after a crash, a drain or a preemption
resumes from the last one. A preemption is a checkpoint and a hand-back: once a job of a higher
class has waited SLOTQ_PREEMPT_AFTER_S in any of the worker's lines, the job saves its state at the
step it reached and goes back to the head of its class (an interruption: it uses none of its
attempts). The worker's next claim takes the higher class's job first, then this one again, which
resumes at that step and makes the images or the clip an uninterrupted run makes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from redis.exceptions import RedisError
from rq.job import Job

from shared.contract.errors import JobInterruptedError, StorageUnavailableError
from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings
from shared.store import results, waiting
from worker import lifecycle, resuming
from worker.pipeline import Keep, current_pipeline
from worker.resuming import Resumption

log = logging.getLogger(__name__)
LOOK_ABOVE_EVERY_S = 0.1  # how often a running job looks for a higher class's job (SLOTQ_PREEMPT_AFTER_S > 0)


class Preempted(JobInterruptedError):
    """A job handed back at a step for a job of a higher class, its state saved at that step."""


def resumable(request: JobRequest) -> bool:
    """Whether a job's whole-pipeline call can resume at a step: a clip's (one from a start image too:
    Wan's pipeline encodes the image again, the same way; LTX-Video's finds it in the saved latents),
    or an image job's in the normal tier, whatever else it asks (a hires job's in either pass). Not the
    fast tier's: its cache holds past steps' outputs, which a checkpoint does not keep."""
    return request.is_video or request.speed != "fast"


def steps_of(job: Job, request: JobRequest, settings: Settings) -> tuple[Resumption | None, Keep | None]:
    """For a job run alone whose call can resume (:func:`resumable`): where this attempt resumes, from
    an earlier attempt's step checkpoint that fits it (its meta then says ``resumed_from_step``), and
    what runs after each of its steps (its checkpoints and its preemption). Neither for any other
    job, nor with checkpoints off."""
    if not resumable(request) or settings.checkpoint_every_s <= 0:
        return None, None
    store = results.of(settings)
    loaded = current_pipeline()
    print_of = resuming.fingerprint(job, type(loaded.pipe).__name__)
    job.meta.pop("resumed_from_step", None)  # an earlier attempt's
    later = int(job.meta.get("attempt", 1)) > 1  # a first attempt has no checkpoint
    sampler = type(loaded.samplers.get(request.scheduler)).__name__
    resume = _resumption(job, store, print_of, request.num_images, sampler) if later else None
    if resume is not None:
        job.meta["resumed_from_step"] = resume.step  # written with the next step's progress
        log.info("job %s resumes at step %d of %d, from its step checkpoint", job.id, resume.step,
                 request.steps_run)
    cadence = resuming.Cadence(settings.checkpoint_every_s, saved_step=resume.step if resume else 0)
    above = Above(settings, job, request)

    def keep(step: int, latents: torch.Tensor, generators: list[torch.Generator], sampler: Any) -> None:
        if step >= request.steps_run:
            return  # after the last step, the result itself is a moment away
        saved = False
        if cadence.due(step):
            saved = _save(job, store, step, resuming.dump_call(print_of, step, latents, generators, sampler))
            cadence.saved(step)
        draining = lifecycle.interrupting.is_set()  # the step's report raises next: keep its state first
        if draining or above.waited():
            if not saved and not _save(job, store, step,
                                       resuming.dump_call(print_of, step, latents, generators, sampler)):
                return  # without its state saved, a hand-back would lose its steps: it goes on
            if draining:
                return
            log.info("job %s: handed back at step %d of %d for a job of a higher class; it resumes there",
                     job.id, step, request.steps_run)
            raise Preempted()

    return resume, keep


class Above:
    """Whether a job of a higher class than the running job's has waited SLOTQ_PREEMPT_AFTER_S in any
    line of the worker (negative: never; a high job is never preempted), looked at once a step at most,
    and with a positive wait at most every ``LOOK_ABOVE_EVERY_S``."""

    def __init__(self, settings: Settings, job: Job, request: JobRequest) -> None:
        self.after, self.priority = settings.preempt_after_s, request.priority
        self.connection = job.connection
        self.lines = [settings.line_of(model) for model in settings.served_models]
        self.looked = 0.0

    def waited(self) -> bool:
        if self.after < 0 or self.priority == "high" or lifecycle.stopping.is_set():
            return False
        now = time.monotonic()
        if self.after > 0 and now - self.looked < min(self.after / 4, LOOK_ABOVE_EVERY_S):
            return False
        self.looked = now
        try:
            waits = [waiting.waited_above(self.connection, line, self.priority) for line in self.lines]
        except RedisError as exc:
            log.warning("could not look for a higher class's job (%s): no preemption now", exc)
            return False
        return any(wait is not None and wait >= self.after for wait in waits)


def _save(job: Job, store: results.Results, step: int, data: bytes) -> bool:
    """Save a step checkpoint under the attempt's fence, which the execution holds; whether it was."""
    try:
        store.save_checkpoint(job, step, data)
    except (RedisError, StorageUnavailableError) as exc:  # best effort, as progress is
        log.warning("job %s: could not save its step checkpoint (%s)", job.id, exc)
        return False
    return True


def _resumption(job: Job, store: results.Results, print_of: str, generators: int,
                sampler: str) -> Resumption | None:
    """The job's step checkpoint where it has one this attempt can resume from; else None, logged."""
    try:
        found = store.checkpoint(job)
    except (RedisError, StorageUnavailableError) as exc:
        log.warning("job %s: could not read its step checkpoint (%s): it starts at step 0", job.id, exc)
        return None
    if found is None:
        return None
    try:
        return resuming.load_call(found[1], print_of, generators, sampler)
    except resuming.CheckpointError as exc:
        log.warning("job %s: its step checkpoint of step %d is not one it can resume from (%s): it starts "
                    "at step 0", job.id, found[0], exc)
        return None
