"""What crosses between the worker and its finishing process (worker/finisher.py), by direction."""

from __future__ import annotations

import io
import json
import zlib
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import numpy as np
from PIL import Image
from PIL.PngImagePlugin import PngInfo
from redis.connection import Encoder
from rq.executions import Execution
from rq.job import Job

from shared.contract.jobs import JobRequest, Outcome
from shared.store.fencing import Fence


@dataclass(frozen=True)
class Clip:
    """A video job's frames, (count, height, width, 3) uint8 RGB, and their rate."""

    frames: np.ndarray
    fps: int


Rendered = tuple[JobRequest, list[Image.Image] | Clip]
REDIS_ENCODING = Encoder("utf-8", "strict", decode_responses=False)  # values as HSET would store them


def encode_png(image: Image.Image, request: JobRequest, level: int) -> bytes:
    """PNG bytes with the request in a text chunk, so a saved file says how it was made; ``level``
    is zlib's (SLOTQ_PNG_COMPRESS_LEVEL). At 1 zlib matches runs only (``Z_RLE``) on the rows
    Pillow has filtered: for a photograph, faster and smaller than level 1's usual matching."""
    info = PngInfo()
    info.add_text("parameters", json.dumps(request.model_dump(mode="json"), sort_keys=True))
    buffer = io.BytesIO()
    strategy = zlib.Z_RLE if level == 1 else -1  # -1: Pillow's own choice for PNG rows (Z_FILTERED)
    image.save(buffer, format="PNG", pnginfo=info, compress_level=level, compress_type=strategy)
    return buffer.getvalue()


# --- worker -> finishing process -----------------------------------------------------------------

@dataclass(frozen=True)
class Work:
    """One job whose GPU section is done: its record as the worker holds it, this run of it, its
    attempt's fence and its images."""

    job_id: str
    record: dict[bytes, bytes]  # as in Redis (HGETALL), so that RQ's own restore() reads it
    execution_id: str
    execution_started: datetime
    fence: Fence
    rendered: Rendered

    @classmethod
    def of(cls, job: Job, execution: Execution, fence: Fence, rendered: Rendered) -> Work:
        record = {name.encode(): REDIS_ENCODING.encode(value) for name, value in job.to_dict().items()}
        return cls(job.id, record, execution.id, execution.created_at, fence, rendered)


@dataclass(frozen=True)
class Batch:
    """The jobs of one GPU execution, and what the drain-rate estimate needs once they are done."""

    works: list[Work]
    running: str  # the worker's running entry for this execution
    cost: float
    seconds: float  # how long the execution held the slot
    line: str  # the line its jobs came from, whose job-time model the execution feeds


@dataclass(frozen=True)
class Stop:
    """Finish nothing more and exit."""


ToFinisher = Batch | Stop


# --- finishing process -> worker -----------------------------------------------------------------

@dataclass(frozen=True)
class Ready:
    """The finishing process's first message, once it can take work."""

    kind: Literal["ready"] = "ready"


@dataclass(frozen=True)
class Ended:
    """How finishing one job went: its final status once recorded (``succeeded``), or
    ``superseded``, ``unrecorded`` or ``unfinished`` (see :class:`Outcome`)."""

    job_id: str
    outcome: Outcome
    seconds: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class Finished:
    """The answer for one batch: each job's end, in the batch's order."""

    ended: list[Ended]


FromFinisher = Ready | Finished
