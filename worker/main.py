"""The single-slot worker process: load the pipeline once, then run one job at a time."""

from __future__ import annotations

import logging

import torch
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.timeouts import JobTimeoutException
from rq.worker import SimpleWorker

from shared import queue as jobs
from shared.errors import JobCanceledError, JobFailedError
from shared.settings import Settings, get_settings
from worker.pipeline import current_pipeline, load_pipeline, set_current_pipeline

log = logging.getLogger(__name__)
MAX_ERROR_MESSAGE = 500


class SlotWorker(SimpleWorker):
    """An RQ worker that runs jobs in its own process, so the model stays loaded on the device.

    No fork per job: CUDA does not survive fork, and reloading weights per job would waste the GPU.
    """

    def handle_exception(self, job: Job, *exc_info: object) -> None:
        """Record why a job ended; a canceled job is marked stopped (shown as canceled), not failed."""
        error = exc_info[1]
        if isinstance(error, JobCanceledError):
            # RQ's own stop-job command marks a job this way; it also keeps RQ from retrying it.
            self._stopped_job_id = job.id
            log.info("job %s canceled", job.id)
            return
        code, message = classify(error)
        if code == "out_of_memory":
            current_pipeline().release_memory()
        jobs.record_error(job, code, message)
        super().handle_exception(job, *exc_info)  # type: ignore[arg-type]


def classify(error: object) -> tuple[str, str]:
    """A stable code and a short message for what ended a job."""
    if isinstance(error, JobFailedError):
        return error.code, str(error)
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "out_of_memory", "The device ran out of memory; try fewer pixels, steps or images."
    if isinstance(error, JobTimeoutException):
        return "timeout", "The job ran past SLOTQ_JOB_TIMEOUT_S."
    message = f"{type(error).__name__}: {error}"
    return "job_failed", message[:MAX_ERROR_MESSAGE]


def run_worker(settings: Settings | None = None, *, burst: bool = False) -> int:
    """Load the model and serve jobs until told to stop; the exit code for the supervisor."""
    settings = settings or get_settings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        set_current_pipeline(load_pipeline(settings))
    except Exception:
        # Worker-fatal: exit non-zero so the supervisor restarts us rather than failing every job.
        log.exception("could not load model %s", settings.model)
        return 1
    connection = jobs.connect(settings, blocking=True)
    queue = jobs.job_queue(connection, settings)
    worker = SlotWorker([queue], connection=connection, serializer=JSONSerializer)
    log.info("worker %s ready on %s", worker.name, settings.queue_name)
    worker.work(burst=burst, logging_level=settings.log_level)
    return 0


