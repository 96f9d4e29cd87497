"""The RQ task the API enqueues by name: one text-to-image job."""

from __future__ import annotations

import time
from typing import Any

from pydantic import ValidationError
from rq import get_current_job
from rq.job import Job

from shared import queue as jobs
from shared.errors import JobCanceledError, JobFailedError
from shared.jobs import validate_request
from shared.settings import get_settings
from worker.pipeline import current_pipeline, encode_png


def generate(request: dict[str, Any]) -> dict[str, Any]:
    """Generate the images of one request and store them for the result TTL."""
    job = get_current_job()
    assert job is not None, "generate runs inside an RQ worker"
    settings = get_settings()
    try:
        # The queue is a trust boundary too: re-validate what came out of Redis.
        job_request = validate_request(request, max_side=settings.max_side, max_steps=settings.max_steps)
    except ValidationError as exc:
        raise JobFailedError("invalid_request", f"the stored request is invalid: {exc}") from None
    if jobs.cancel_requested(job.connection, job.id):
        raise JobCanceledError()
    started = time.perf_counter()
    check_in(job, 0, job_request.steps)
    images = current_pipeline().generate(job_request, on_step=lambda step, total: check_in(job, step, total))
    pngs = [encode_png(image, job_request) for image in images]
    jobs.store_images(job, settings, pngs, time.perf_counter() - started)
    return {"images": len(pngs), "seed": job_request.seed}


def check_in(job: Job, step: int, total: int) -> None:
    """Report progress and stop here if the client canceled the job."""
    if jobs.report_progress(job, step, total):
        raise JobCanceledError()
