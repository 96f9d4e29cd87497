"""What ended a job: a stable code for the client, and whether the device can still be trusted."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

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


def classify(error: object, folders: Iterable[Path] = ()) -> tuple[str, str]:
    """A stable code and a short message for what ended a job, naming files within ``folders`` (the
    worker's folders of weights) relative to them: the server's paths are not the client's to know."""
    if isinstance(error, JobFailedError):
        return error.code, relative(str(error), folders)
    if isinstance(error, torch.OutOfMemoryError):
        return "out_of_memory", "The device ran out of memory; try fewer pixels, steps or images."
    if isinstance(error, JobTimeoutException):
        return "timeout", "The job ran past SLOTQ_JOB_TIMEOUT_S."
    message = relative(f"{type(error).__name__}: {error}", folders)
    return "job_failed", message[:MAX_ERROR_MESSAGE]


def relative(message: str, folders: Iterable[Path]) -> str:
    """The message with each folder's path (as configured and as resolved) cut from the paths in it."""
    prefixes = {f"{path}/" for folder in folders for path in (folder, folder.resolve())}
    for prefix in sorted(prefixes, key=len, reverse=True):  # a folder inside another: the inner first
        message = message.replace(prefix, "")
    return message
