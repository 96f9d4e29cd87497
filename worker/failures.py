"""What ended a job: a stable code for the client, and whether the device can still be trusted."""

from __future__ import annotations

import torch
from rq.timeouts import JobTimeoutException

from shared.contract.errors import JobFailedError

MAX_ERROR_MESSAGE = 500


def is_device_fatal(error: object) -> bool:
    """Errors after which the device cannot be trusted: only a new process helps."""
    if isinstance(error, torch.OutOfMemoryError):
        return False  # the job asked for too much; the device is fine
    return isinstance(error, torch.AcceleratorError) or (
        isinstance(error, RuntimeError) and "CUDA error" in str(error))


def classify(error: object) -> tuple[str, str]:
    """A stable code and a short message for what ended a job."""
    if isinstance(error, JobFailedError):
        return error.code, str(error)
    if isinstance(error, torch.OutOfMemoryError):
        return "out_of_memory", "The device ran out of memory; try fewer pixels, steps or images."
    if isinstance(error, JobTimeoutException):
        return "timeout", "The job ran past SLOTQ_JOB_TIMEOUT_S."
    message = f"{type(error).__name__}: {error}"
    return "job_failed", message[:MAX_ERROR_MESSAGE]
