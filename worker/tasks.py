"""The RQ task the API enqueues by name: one text-to-image job, in two stages.

``render`` is the GPU section (denoise and decode); ``finish`` encodes and stores the PNGs. The
slotq worker runs them on two threads so that finishing one job overlaps the next one's GPU
section; ``generate`` runs both in turn, for any plain RQ worker.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from PIL import Image
from pydantic import ValidationError
from redis.exceptions import RedisError
from rq import get_current_job
from rq.job import Job

from shared import records
from shared.errors import JobCanceledError, JobFailedError, JobInterruptedError
from shared.jobs import JobRequest, validate_request
from shared.settings import get_settings
from worker import lifecycle
from worker.pipeline import current_pipeline, encode_png

log = logging.getLogger(__name__)


Rendered = tuple[JobRequest, list[Image.Image]]


def generate(request: dict[str, Any]) -> dict[str, Any]:
    """Generate the images of one request and store them for the result TTL."""
    job = get_current_job()
    assert job is not None, "generate runs inside an RQ worker"
    return finish(job, render(job, request))


def render(job: Job, request: dict[str, Any]) -> Rendered:
    """The GPU section: validate the stored request, then denoise and decode its images."""
    settings = get_settings()
    try:
        # The queue is a trust boundary too: re-validate what came out of Redis.
        job_request = validate_request(request, max_side=settings.max_side, max_steps=settings.max_steps)
    except ValidationError as exc:
        raise JobFailedError("invalid_request", f"the stored request is invalid: {exc}") from None
    faults = settings.fault_injection

    def on_step(step: int, total: int) -> None:
        check_in(job, step, total)
        if faults and step == 1:
            inject_fault(job_request)

    on_step(0, job_request.steps)
    return job_request, current_pipeline().generate(job_request, on_step=on_step)


def finish(job: Job, rendered: Rendered) -> dict[str, Any]:
    """Off the GPU: encode the images as PNG and store them for the result TTL; the job's result."""
    job_request, images = rendered
    pngs = [encode_png(image, job_request) for image in images]
    records.store_images(job, get_settings(), pngs)
    return {"images": len(pngs), "seed": job_request.seed}


def check_in(job: Job, step: int, total: int) -> None:
    """Report progress; stop here if the client canceled the job or the worker must stop now."""
    if lifecycle.interrupting.is_set():
        raise JobInterruptedError()
    try:
        canceled = records.report_progress(job, step, total)
    except RedisError as exc:
        # Progress is best effort: the image is still worth making while Redis restarts.
        log.warning("could not report progress of job %s: %s", job.id, exc)
        return
    if canceled:
        raise JobCanceledError()


def inject_fault(request: JobRequest) -> None:
    """Test hook (SLOTQ_FAULT_INJECTION=true): raise a device fault named by the prompt."""
    if request.prompt.startswith("__oom__"):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (injected)")
    if request.prompt.startswith("__device_lost__"):
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered (injected)")
