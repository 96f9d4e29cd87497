"""The job contract: what a client may ask for, and what it sees back."""

from __future__ import annotations

import secrets
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_SEED = 2**32 - 1
MAX_IMAGES = 4  # per job

Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[Priority, ...] = get_args(Priority)  # the order a worker serves them in
WebhookEvent = Literal["started", "completed"]  # completed: succeeded, failed, canceled or expired
MAX_URL = 2048
WEBHOOK_PATTERN = r"^[Hh][Tt][Tt][Pp][Ss]?://[A-Za-z0-9._~%!$&'()*+,;=:\[\]-]+([/?#][!-~]*)?$"


class JobStatus(StrEnum):
    """Where a job is in its life; all but the first two are terminal."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"

    @property
    def is_terminal(self) -> bool:
        """Whether the job has ended for good."""
        return self not in (JobStatus.QUEUED, JobStatus.RUNNING)


class Outcome(StrEnum):
    """How one attempt at a job ended, as the worker counts it (``slotq_worker_jobs_total``).

    The first four are the job's final status; the others leave it to run again or to another.
    """

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"
    REQUEUED = "requeued"  # back at the head of its class: interrupted, or its worker was lost
    SUPERSEDED = "superseded"  # a newer attempt owns the job: this one writes nothing more
    UNRECORDED = "unrecorded"  # Redis failed while its end was written: recovery settles it
    UNFINISHED = "unfinished"  # its images could not be encoded or stored: it ends failed
    MISSING = "missing"  # its record expired while it waited: nothing to end

    @classmethod
    def of(cls, status: JobStatus) -> Outcome:
        """The outcome that a job's status after an attempt stands for."""
        return cls(status.value) if status.is_terminal else cls.REQUEUED


# The samplers a job may name, as diffusers' schedulers for UNet models (SD 1.x and 2.x); built from
# the loaded scheduler's config per job (worker/samplers.py). None: the model's own scheduler.
Scheduler = Literal["ddim", "euler", "euler_a", "dpmpp_2m", "dpmpp_2m_karras", "unipc"]
SCHEDULERS: tuple[str, ...] = get_args(Scheduler)


class JobRequest(BaseModel):
    """A text-to-image request. Validate with ``validate_request`` so the size limits apply."""

    # strict: "512" or true are not numbers; forbid: a misspelt field is an error, not a no-op.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str = Field(min_length=1, max_length=2000)
    negative_prompt: str | None = Field(None, max_length=2000)
    width: int = 512
    height: int = 512
    steps: int = Field(30, ge=1)
    guidance_scale: float = Field(7.5, ge=0, le=30, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    num_images: int = Field(1, ge=1, le=MAX_IMAGES)
    scheduler: Scheduler | None = Field(None, description="the sampler; absent: the model's own")
    deadline_s: float | None = Field(None, gt=0, le=86_400, allow_inf_nan=False)
    priority: Priority = "normal"
    # The pattern documents the URL's shape in the schema; the validator below checks the rest.
    webhook: str | None = Field(None, min_length=1, max_length=MAX_URL, pattern=WEBHOOK_PATTERN,
                                json_schema_extra={"format": "uri"})
    webhook_events: list[WebhookEvent] = Field(default_factory=lambda: ["completed"],  # type: ignore[arg-type]
                                               min_length=1, max_length=2,
                                               json_schema_extra={"uniqueItems": True})

    @field_validator("width", "height", "steps", "seed", "num_images", mode="before")
    @classmethod
    def _integral(cls, value: Any) -> Any:
        # JSON Schema's "integer" admits any integral number, 496.0 too, and so does the document;
        # strict validation after this still refuses "496", true and 496.5.
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    @field_validator("width", "height")
    @classmethod
    def _side_in_range(cls, value: int, info: ValidationInfo) -> int:
        max_side = (info.context or {}).get("max_side", 1024)
        if value % 8 or not 64 <= value <= max_side:
            raise ValueError(f"must be a multiple of 8 between 64 and {max_side}")
        return value

    @field_validator("steps")
    @classmethod
    def _steps_in_range(cls, value: int, info: ValidationInfo) -> int:
        max_steps = (info.context or {}).get("max_steps", 100)
        if value > max_steps:
            raise ValueError(f"must be at most {max_steps}")
        return value

    @field_validator("webhook")
    @classmethod
    def _webhook_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018 (raises on a bad port)
        except ValueError:
            raise ValueError("must be an http or https URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http or https URL")
        if parts.username is not None or parts.password is not None:
            raise ValueError("must not carry credentials")
        if not value.isascii() or any(char.isspace() or not char.isprintable() for char in value):
            raise ValueError("must be ASCII without spaces or control characters (percent-encode them)")
        return value

    @field_validator("webhook_events")
    @classmethod
    def _events_once(cls, value: list[WebhookEvent]) -> list[WebhookEvent]:
        if len(set(value)) != len(value):
            raise ValueError("must not repeat an event")
        return value

    @property
    def batch_key(self) -> str:
        """Jobs with equal keys can run as one batch: same size, steps, guidance, sampler and images each."""
        return (f"{self.width}x{self.height}/{self.steps}/{self.guidance_scale!r}/{self.scheduler or ''}"
                f"/{self.num_images}")

    @staticmethod
    def pixels_of_batch_key(key: str) -> int:
        """The pixels one job with this batch key makes (all its images)."""
        size, *_, images = key.split("/")
        width, height = size.split("x")
        return int(width) * int(height) * int(images)

    def with_seed(self) -> JobRequest:
        """This request with a seed drawn at random when the client gave none."""
        if self.seed is not None:
            return self
        return self.model_copy(update={"seed": secrets.randbelow(MAX_SEED + 1)})


def validate_request(data: Any, *, max_side: int, max_steps: int) -> JobRequest:
    """Parse untrusted JSON data into a request, with the service's limits."""
    return JobRequest.model_validate(data, context={"max_side": max_side, "max_steps": max_steps})


class Progress(BaseModel):
    """Denoising progress of a running job."""

    step: int
    total: int


class Eta(BaseModel):
    """Estimated seconds from now until a job starts and until it finishes."""

    start: float
    finish: float


class JobError(BaseModel):
    """Why a job failed, with a stable code."""

    code: str
    message: str


class JobView(BaseModel):
    """What ``GET /v1/jobs/<id>`` returns."""

    id: str
    status: JobStatus
    attempt: int = 0
    position: int | None = None
    eta_s: Eta | None = None
    progress: Progress | None = None
    created_at: datetime | None = None
    deadline_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: JobError | None = None
    images: list[str] = []
    request: JobRequest
