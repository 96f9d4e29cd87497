"""The job contract: what a client may ask for, and what it sees back."""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, get_args
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from shared.contract.adapters import MAX_LORAS, NAME_PATTERN, LoraRef, adapters_key
from shared.contract.errors import (
    InvalidImageError,
    InvalidRequestError,
    TooLargeForWorkersError,
    UnknownControlNetError,
    UnknownIpAdapterError,
    UnknownLoraError,
    UnknownModelError,
)
from shared.contract.images import INPUT_NAMES, ImageRef, InputName, read_data_url
from shared.contract.models import MODEL_NAME_PATTERN, Ability, ModelInfo, Scheduler, check_takes, model_info

MAX_SEED = 2**32 - 1
MAX_IMAGES = 4  # per job
MAX_IDEMPOTENCY_KEY = 255  # characters of an Idempotency-Key
DEFAULT_LIMIT, MAX_LIMIT = 20, 100  # jobs a page of GET /v1/jobs lists
MAX_CONTROLNETS = 2  # per job
MAX_FPS = 60

Priority = Literal["high", "normal", "low"]
Speed = Literal["normal", "fast", "auto"]  # as a job asks
Tier = Literal["normal", "fast"]  # as it runs
PRIORITIES: tuple[Priority, ...] = get_args(Priority)  # the order a worker serves them in
WebhookEvent = Literal["started", "completed"]  # completed: succeeded, failed, canceled or expired
MAX_URL = 2048
MIN_SIDE = 64
JobKind = Literal["text", "image", "inpaint"]  # text-to-image, image-to-image, inpainting
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



# A client sends an input image as a data: URL; the stored request and the job's view hold its
# reference instead (validate_submission makes the swap). The schema shows what a client sends.
DATA_URL_SCHEMA = {"type": "string", "format": "data-url", "pattern": "^data:image/(png|jpeg|webp);base64,"}
InputField = Annotated[str | ImageRef | None,
                       WithJsonSchema({"anyOf": [DATA_URL_SCHEMA, {"type": "null"}]}, mode="validation")]


ControlImageField = Annotated[str | ImageRef, WithJsonSchema(DATA_URL_SCHEMA, mode="validation")]


class ControlRequest(BaseModel):
    """One ControlNet a job runs with: its control image, and how strongly and over which steps it acts."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(pattern=NAME_PATTERN, description="a ControlNet of the model's in SLOTQ_CONTROLNET_DIR "
                                                        "(GET /v1/models lists them)")
    image: ControlImageField = Field(description="the control image (edges, depth, pose...), a base64 data: "
                                     "URL of a PNG, JPEG or WebP; resized to the job's size. In a job's "
                                     "view: its size and sha256")
    scale: float = Field(1.0, ge=0, le=2, allow_inf_nan=False, description="its residuals' factor; 0: "
                         "as if absent")
    start: float = Field(0.0, ge=0, le=1, allow_inf_nan=False, description="the fraction of the steps "
                         "before it acts")
    end: float = Field(1.0, ge=0, le=1, allow_inf_nan=False, description="the fraction of the steps after "
                       "which it stops")
    preprocess: Literal["none", "canny"] = Field("none", description="`canny`: the image is a picture, "
                                                 "and its edges (OpenCV's Canny) are the control image")
    low: int = Field(100, ge=0, le=255, description="with `canny`: the lower threshold of its hysteresis")
    high: int = Field(200, ge=0, le=255, description="with `canny`: the upper one (edges start above it)")

    @model_validator(mode="after")
    def _acts(self) -> ControlRequest:
        if self.start >= self.end:
            raise ValueError(f"`start` ({self.start}) must be below `end` ({self.end})")
        if self.low > self.high:
            raise ValueError(f"`low` ({self.low}) must not be above `high` ({self.high})")
        return self

    @property
    def key(self) -> str:
        """Its settings as a batch key's part: jobs batch only with jobs of the same controls."""
        canny = f":{self.low}-{self.high}" if self.preprocess == "canny" else ""
        return f"{self.name}:{self.scale!r}:{self.start!r}:{self.end!r}:{self.preprocess}{canny}"


class IpAdapterRequest(BaseModel):
    """An IP-Adapter a job runs with: a reference image that acts as a prompt, at a scale."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: str = Field(pattern=NAME_PATTERN, description="an IP-Adapter of the model's in "
                                                        "SLOTQ_IP_ADAPTER_DIR (GET /v1/models lists them)")
    image: ControlImageField = Field(description="the reference image, a base64 data: URL of a PNG, JPEG or "
                                     "WebP, any size. In a job's view: its size and sha256")
    scale: float = Field(1.0, ge=0, le=2, allow_inf_nan=False, description="how strongly it acts; 0: as if "
                         "absent")


class HiresRequest(BaseModel):
    """A second, larger pass: the image made at the job's size is upscaled and run again as
    image-to-image at the larger size (AUTOMATIC1111's "hires fix")."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    scale: float = Field(2.0, gt=1, le=4, allow_inf_nan=False, description="the larger size's factor: each "
                         "side times this, rounded to the model's multiple")
    steps: int | None = Field(None, ge=1, description="the second pass's schedule; absent: the job's `steps`")
    denoise: float = Field(0.5, gt=0, le=1, allow_inf_nan=False, description="the share of that schedule "
                           "run again on the upscaled image")
    upscaler: Literal["latent", "lanczos"] = Field("latent", description="`latent`: the latents are "
                                                   "upscaled (bilinear); `lanczos`: the decoded image is")

    @field_validator("steps", mode="before")
    @classmethod
    def _integral(cls, value: Any) -> Any:
        return int(value) if isinstance(value, float) and value.is_integer() else value


class JobRequest(BaseModel):
    """A job's request: text-to-image, or with ``image`` (and ``mask``) image-to-image or inpainting.

    From a client, parse with ``validate_submission``; stored, with ``validate_request``.
    """

    # strict: "512" or true are not numbers; forbid: a misspelt field is an error, not a no-op.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str = Field(min_length=1, max_length=2000)
    model: str | None = Field(None, pattern=MODEL_NAME_PATTERN,
                              description="the model to run on, by name (GET /v1/models); absent: the first")
    negative_prompt: str | None = Field(None, max_length=2000)
    width: int = 512
    height: int = 512
    steps: int = Field(30, ge=1)
    guidance_scale: float = Field(7.5, ge=0, le=30, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    num_images: int = Field(1, ge=1, le=MAX_IMAGES)
    frames: int | None = Field(None, ge=1, description="a video model's: the clip's frames, a multiple of "
                               "the model's `frame_multiple` plus one (GET /v1/models); absent: its default")
    fps: int | None = Field(None, ge=1, le=MAX_FPS, description="a video model's: the clip's frames a "
                            "second; absent: its default")
    scheduler: Scheduler | None = Field(None, description="the sampler; absent: the model's own")
    image: InputField = Field(None, description="the start image, a base64 data: URL of a PNG, JPEG or "
                              "WebP; its size is the job's. In a job's view: its size and sha256")
    mask: InputField = Field(None, description="with `image`: white repaints, black keeps the image's own "
                             "pixels exactly, grey blends; the image's size")
    strength: float = Field(0.8, gt=0, le=1, allow_inf_nan=False,
                            description="with `image`: the share of the schedule that is run again")
    loras: list[LoraRef] = Field(default_factory=list, max_length=MAX_LORAS,
                                 description="LoRA adapters at their scales; none: the bare model")
    previews: bool = Field(False, description="send `preview` events (GET /v1/jobs/<id>/events) "
                           "and keep the latest at GET /v1/jobs/<id>/preview while it runs")
    controlnets: list[ControlRequest] = Field(default_factory=list, max_length=MAX_CONTROLNETS,
                                              description="ControlNets that steer the composition; none: "
                                              "the model alone")
    ip_adapter: IpAdapterRequest | None = Field(None, description="an image as a prompt, beside the words")
    hires: HiresRequest | None = Field(None, description="a second pass at a larger size (text-to-image "
                                       "only); the job's images have the larger size")
    prompt_syntax: Literal["plain", "weighted"] = Field(
        "plain", description="`weighted`: AUTOMATIC1111's emphasis in the prompts, `(word:1.2)`, `(word)`, "
        "`[word]`, `\\(` for a bracket; `plain`: brackets are text")
    speed: Speed = Field("normal", description="`fast`: with step caching, faster and a little different; "
                         "`auto`: fast while the model's line is deeper than the service's SLOTQ_DEGRADE_AT")
    deadline_s: float | None = Field(None, gt=0, le=86_400, allow_inf_nan=False)
    priority: Priority = "normal"
    # The pattern documents the URL's shape in the schema; the validator below checks the rest.
    webhook: str | None = Field(None, min_length=1, max_length=MAX_URL, pattern=WEBHOOK_PATTERN,
                                json_schema_extra={"format": "uri"})
    webhook_events: list[WebhookEvent] = Field(default_factory=lambda: ["completed"],  # type: ignore[arg-type]
                                               min_length=1, max_length=2,
                                               json_schema_extra={"uniqueItems": True})

    @field_validator("width", "height", "steps", "seed", "num_images", "frames", "fps", mode="before")
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
        max_side, multiple = _side_limits(info)
        if value % multiple or not MIN_SIDE <= value <= max_side:
            raise ValueError(f"must be a multiple of {multiple} between {MIN_SIDE} and {max_side}")
        return value

    @field_validator("steps")
    @classmethod
    def _steps_in_range(cls, value: int, info: ValidationInfo) -> int:
        max_steps = (info.context or {}).get("max_steps", 100)
        if value > max_steps:
            raise ValueError(f"must be at most {max_steps}")
        return value

    # The model's frame multiple where the caller knows it (0: an image model); absent, the request is
    # a stored one read back for its view, checked at its admission.
    @field_validator("frames")
    @classmethod
    def _frames_fit(cls, value: int | None, info: ValidationInfo) -> int | None:
        multiple, max_frames = _frame_limits(info)
        if value is None or multiple is None:
            return value
        if not multiple:
            raise ValueError("a video model's: this model makes images")
        if (value - 1) % multiple or not multiple < value <= max_frames:
            raise ValueError(f"must be a multiple of {multiple} plus one, from {multiple + 1} to "
                             f"{max_frames}")
        return value

    @field_validator("fps")
    @classmethod
    def _fps_for_video(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and _frame_limits(info)[0] == 0:
            raise ValueError("a video model's: this model makes images")
        return value

    @field_validator("num_images")
    @classmethod
    def _one_clip(cls, value: int, info: ValidationInfo) -> int:
        if value != 1 and _frame_limits(info)[0]:
            raise ValueError("a video job makes one clip: must be 1")
        return value

    @model_validator(mode="after")
    def _clip_complete(self, info: ValidationInfo) -> JobRequest:
        if _frame_limits(info)[0] and (self.frames is None or self.fps is None):
            raise ValueError("a video model's job needs `frames` and `fps`")
        return self

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

    @field_validator("loras")
    @classmethod
    def _adapters_once(cls, value: list[LoraRef]) -> list[LoraRef]:
        if len({lora.name for lora in value}) != len(value):
            raise ValueError("must not name an adapter twice")
        return value

    @model_validator(mode="after")
    def _inputs_fit(self) -> JobRequest:
        if self.mask is not None and self.image is None:
            raise ValueError("a `mask` needs an `image` to repaint")
        if self.image is not None and self.steps_run < 1:
            raise ValueError(f"{self.steps} steps at strength {self.strength} run none: raise either")
        return self

    @model_validator(mode="after")
    def _hires_fits(self, info: ValidationInfo) -> JobRequest:
        if self.hires is None:
            return self
        if self.image is not None:
            raise ValueError("a `hires` pass is for text-to-image: a job with an `image` has its size")
        if self.hires_steps_run < 1:
            raise ValueError(f"the hires pass's {self.hires.steps or self.steps} steps at denoise "
                             f"{self.hires.denoise} run none: raise either")
        if info.context is None:  # a parsed request passed on (into a job's view): its limits held then
            return self
        max_side, multiple = _side_limits(info)
        max_steps = info.context.get("max_steps", 100)
        if self.hires.steps is not None and self.hires.steps > max_steps:
            raise ValueError(f"`hires.steps` must be at most {max_steps}")
        width, height = self.output_size(multiple)
        if max(width, height) > max_side:
            raise ValueError(f"the hires pass makes {width}x{height}: over the service's {max_side}; "
                             "lower `hires.scale` or the size")
        return self

    @property
    def kind(self) -> JobKind:
        """What the job does with its inputs."""
        if self.image is None:
            return "text"
        return "image" if self.mask is None else "inpaint"

    @property
    def is_video(self) -> bool:
        """Whether it makes a clip (a video model's job) rather than images."""
        return self.frames is not None

    @property
    def steps_run(self) -> int:
        """The denoising steps that run, the hires pass's included (see :func:`steps_run`): its
        progress's total."""
        return self.first_steps_run + self.hires_steps_run

    @property
    def first_steps_run(self) -> int:
        """The denoising steps of the pass at the job's size."""
        # A clip's start image conditions every step: all of them run.
        return steps_run(self.steps, self.strength if self.image is not None and not self.is_video else None)

    @property
    def hires_steps_run(self) -> int:
        """The denoising steps of the hires pass (0 without one)."""
        if self.hires is None:
            return 0
        return steps_run(self.hires.steps or self.steps, self.hires.denoise)

    def output_size(self, multiple: int = 8) -> tuple[int, int]:
        """The size of the job's images: the hires pass's where it has one."""
        return output_size(self.width, self.height, self.hires.scale if self.hires else None, multiple)

    @property
    def cost(self) -> float:
        """Its GPU work in cost units, both passes counted."""
        width, height = self.output_size()
        return (job_cost(self.width, self.height, self.first_steps_run, self.pictures)
                + job_cost(width, height, self.hires_steps_run, self.pictures))

    @property
    def pictures(self) -> int:
        """The pictures it makes: its images, or its clip's frames."""
        return self.num_images * (self.frames or 1)

    @property
    def batch_key(self) -> str:
        """Jobs with equal keys can run as one batch: same kind, size, steps, strength, guidance,
        sampler, speed, adapters, controls, hires pass, images each and whether a negative prompt is
        given (and weighted prompts, the same prompts; clips from an image, the same image). The first
        part is the size, ``WxH`` (``WxH>W2xH2`` with a hires pass)."""
        strength = f"{self.strength!r}" if self.image is not None else ""
        size = f"{self.width}x{self.height}"
        if self.hires is not None:
            hires, (width, height) = self.hires, self.output_size()
            size += f">{width}x{height}:{hires.steps or self.steps}:{hires.denoise!r}:{hires.upscaler}"
        controls = ";".join(control.key for control in self.controlnets)
        if self.ip_adapter is not None:  # its reference images may differ (worker/ip_adapters.py)
            controls += f";ip:{self.ip_adapter.name}:{self.ip_adapter.scale!r}"
        # With and without a negative prompt apart: SDXL encodes a batch-mate's "" where it zeroes None.
        negative = "-" if self.negative_prompt else ""
        clip = f"/{self.fps}fps" if self.is_video else ""  # its last part is then the clip's frames
        if self.is_video and isinstance(self.image, ImageRef):  # Wan's image-to-video call takes one
            clip += f"@{self.image.sha256}"
        return (f"{size}/{self.steps}/{self.guidance_scale!r}/{self.scheduler or ''}/{self.kind}{strength}"
                f"/{self.speed}{self._syntax_key}{negative}/{self.adapters_key}/{controls}{clip}/{self.pictures}")

    @property
    def join_key(self) -> str:
        """Jobs with equal keys may share the step-level loop's batch (worker/joining.py), joining it
        at any step: same size and tier, whatever their steps, guidance, sampler, seed or image count.
        '' for a job the loop does not run (:attr:`not_steppable`): it keeps start-only batching."""
        return "" if self.not_steppable else f"{self.width}x{self.height}/join"

    @property
    def not_steppable(self) -> list[str]:
        """What in this job the step-level loop does not run, by name ([] where it runs it): each
        changes the model call for its rows alone, or holds state across a whole call."""
        features = {"an input image": self.image is not None, "a hires pass": self.hires is not None,
                    "ControlNets": bool(self.controlnets), "an IP-Adapter": self.ip_adapter is not None,
                    "LoRAs": bool(self.loras), "weighted prompts": self.prompt_syntax == "weighted",
                    "the fast tier": self.speed == "fast", "the auto tier": self.speed == "auto",
                    "a clip": self.is_video}
        return [name for name, asked in features.items() if asked]

    @property
    def _syntax_key(self) -> str:
        """'' for plain prompts; for weighted ones, the prompts themselves: their embeddings are padded
        to the batch's longest, which would change a shorter prompt's image, so only equal ones batch."""
        if self.prompt_syntax == "plain":
            return ""
        words = f"{self.prompt}\n{self.negative_prompt or ''}".encode()
        return ":w" + hashlib.sha256(words).hexdigest()[:16]

    @property
    def adapters_key(self) -> str:
        """The adapters and scales the job runs with, in a stable order ('' for the bare model)."""
        return adapters_key(self.loras)

    @property
    def affinity_key(self) -> str:
        """What the claim's affinity compares (shared/store/lua/lib/line.lua): its adapters key, then
        ``@name:scale`` for each ControlNet and ``&name:scale`` for its IP-Adapter ('' for the bare model)."""
        controls = [f"@{control.name}:{control.scale!r}" for control in self.controlnets]
        if self.ip_adapter is not None:
            controls.append(f"&{self.ip_adapter.name}:{self.ip_adapter.scale!r}")
        return ",".join(part for part in (self.adapters_key, *controls) if part)

    @staticmethod
    def pixels_of_batch_key(key: str) -> int:
        """The pixels one job with this batch key makes at its largest (all its images or frames)."""
        size, *_, images = key.split("/")
        width, height = size.rpartition(">")[2].partition(":")[0].split("x")
        return int(width) * int(height) * int(images)

    def with_seed(self) -> JobRequest:
        """This request with a seed drawn at random when the client gave none."""
        if self.seed is not None:
            return self
        return self.model_copy(update={"seed": secrets.randbelow(MAX_SEED + 1)})


def steps_run(steps: int, strength: float | None) -> int:
    """The denoising steps a job runs: all of them, or with a start image (``strength`` given) the
    last ``strength`` of the schedule, by diffusers' own rounding, so progress counts the steps taken."""
    return steps if strength is None else min(int(steps * strength), steps)


def job_cost(width: int, height: int, steps: int, num_images: int) -> float:
    """GPU work in cost units: one unit is one denoising step of one 512x512 image."""
    return steps * width * height * num_images / (512 * 512)


def output_size(width: int, height: int, scale: float | None, multiple: int = 8) -> tuple[int, int]:
    """A job's image size: its own, or with a hires pass at ``scale``, each side scaled and rounded to
    the nearest multiple of ``multiple``."""
    if scale is None:
        return width, height
    return (max(multiple, round(width * scale / multiple) * multiple),
            max(multiple, round(height * scale / multiple) * multiple))


def _frame_limits(info: ValidationInfo) -> tuple[int | None, int]:
    """The model's frame multiple (0: an image model; None: unknown) and the most frames a clip has."""
    context = info.context or {}
    return context.get("frame_multiple"), context.get("max_frames", 257)


def _side_limits(info: ValidationInfo) -> tuple[int, int]:
    context = info.context or {}
    return context.get("max_side", 1024), context.get("side_multiple", 8)


def validate_request(data: Any, *, max_side: int, max_steps: int, side_multiple: int = 8,
                     frame_multiple: int | None = None, max_frames: int = 257) -> JobRequest:
    """Parse a stored request (its inputs already references), with the service's limits; with
    ``frame_multiple``, for a model of that multiple (0: an image model)."""
    return JobRequest.model_validate(data, context={"max_side": max_side, "max_steps": max_steps,
                                                    "side_multiple": side_multiple, "max_frames": max_frames,
                                                    "frame_multiple": frame_multiple})


@dataclass(frozen=True)
class Submission:
    """A client's request, checked: its inputs replaced by references, and their bytes."""

    request: JobRequest
    inputs: dict[InputName, bytes] = field(default_factory=dict)


def validate_submission(data: Any, *, max_side: int, max_steps: int, max_image_bytes: int,
                        model: ModelInfo | None = None, adapters: Sequence[str] = (),
                        controlnets: Sequence[str] = (), ip_adapters: Sequence[str] = (),
                        max_frames: int = 257) -> Submission:
    """Parse a client's JSON body into a request for ``model`` (default: a tiny SD), decoding and
    checking its input images first (``InvalidImageError``). An image's size is the job's; what the
    body leaves out comes from the model's defaults; a sampler the model cannot use, or an adapter
    not among ``adapters``, or a ControlNet or IP-Adapter not among ``controlnets`` or ``ip_adapters``, is
    refused."""
    model = model or model_info("tiny", "sd")
    side_multiple = model.side_multiple
    inputs: dict[InputName, bytes] = {}
    if isinstance(data, dict):
        data = dict(data)
        refs = _read_inputs(data, inputs, max_bytes=max_image_bytes, max_pixels=max_side * max_side)
        if "image" in refs:
            _fit_size(data, refs, max_side, side_multiple)
        data = model.within(max_side, max_frames).defaults.fields | data  # a new dict: the body's keys win
        if data.get("model") is None:
            data["model"] = model.name
    request = validate_request(data, max_side=max_side, max_steps=max_steps, side_multiple=side_multiple,
                               frame_multiple=model.frame_multiple or 0, max_frames=max_frames)
    _check_media(request, model)
    if request.scheduler is not None and request.scheduler not in model.schedulers:
        message = f"a {model.family} model cannot use it; it takes {', '.join(model.schedulers)}"
        raise InvalidRequestError(details=[{"loc": ["scheduler"], "msg": message}])
    unknown = sorted({lora.name for lora in request.loras} - set(adapters))
    if unknown:
        offered = ", ".join(adapters) or "none"
        raise UnknownLoraError(f"No LoRA adapter named {', '.join(unknown)}; this service has {offered}.")
    _check_controls(request, model, controlnets, ip_adapters)
    _check_fits(request, model, max_side)
    return Submission(request, inputs)


def _read_inputs(data: dict[str, Any], inputs: dict[InputName, bytes], *, max_bytes: int, max_pixels: int
                 ) -> dict[InputName, ImageRef]:
    """Decode and check the body's input images (its start image and mask, its controls' images) into
    ``inputs``, putting each one's reference in its place in ``data``; their references by name."""
    found: list[tuple[InputName, list[str | int], Any, dict[str, Any], str]] = [
        (name, [name], data.get(name), data, name) for name in ("image", "mask")]
    controls = data.get("controlnets")
    # Past the bound the validation refuses the list: its images are never decoded.
    if isinstance(controls, list) and len(controls) <= MAX_CONTROLNETS:
        data["controlnets"] = controls = [dict(each) if isinstance(each, dict) else each for each in controls]
        found += [(INPUT_NAMES[2 + index], ["controlnets", index, "image"], each.get("image"), each, "image")
                  for index, each in enumerate(controls) if isinstance(each, dict)]
    if isinstance(data.get("ip_adapter"), dict):
        data["ip_adapter"] = reference = dict(data["ip_adapter"])
        found.append(("ip_adapter", ["ip_adapter", "image"], reference.get("image"), reference, "image"))
    refs: dict[InputName, ImageRef] = {}
    for name, loc, value, holder, key in found:
        if value is None:
            continue
        if not isinstance(value, str):  # a reference as a view shows it cannot stand in for the bytes
            raise InvalidRequestError(details=[{"loc": loc, "msg": "must be a data: URL such as "
                                                "data:image/png;base64,..."}])
        label = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)[1:]
        checked = read_data_url(label, value, max_bytes=max_bytes, max_pixels=max_pixels)
        inputs[name], refs[name] = checked.data, checked.ref
        holder[key] = checked.ref.model_dump()
    return refs


def _check_media(request: JobRequest, model: ModelInfo) -> None:
    """Refuse what the model's family cannot do with a job: a video family's masks, hires pass, weighted
    prompts, start image (where it has no image-to-video twin) or fast tier, and a clip without the
    start image its model needs."""
    asked: list[tuple[bool, Ability]] = [
        (request.mask is not None, "takes_inpainting"), (request.image is not None, "takes_image"),
        (request.hires is not None, "takes_hires"),
        (request.prompt_syntax == "weighted", "takes_weighted_prompts")]
    for wanted, ability in asked:
        if wanted:
            check_takes(model.family, ability)
    if model.spec.starts_from_image and request.image is None:
        message = f"a {model.family} model starts every clip from an image: give `image`"
        raise InvalidRequestError(details=[{"loc": ["image"], "msg": message}])
    if request.steps < model.spec.min_steps:
        message = f"a {model.family} model runs at least {model.spec.min_steps} steps"
        raise InvalidRequestError(details=[{"loc": ["steps"], "msg": message}])
    if request.speed == "fast" and not model.spec.takes_fast_tier:
        message = f"a {model.family} model has no fast tier here: send `normal` or `auto`"
        raise InvalidRequestError(details=[{"loc": ["speed"], "msg": message}])


def _check_controls(request: JobRequest, model: ModelInfo, controlnets: Sequence[str],
                    ip_adapters: Sequence[str]) -> None:
    """Refuse ControlNets and IP-Adapters the model does not have, and a hires pass a family cannot run."""
    if request.controlnets:
        check_takes(model.family, "takes_controlnet")
    unknown = sorted({control.name for control in request.controlnets} - set(controlnets))
    if unknown:
        offered = ", ".join(controlnets) or "none"
        raise UnknownControlNetError(f"No ControlNet named {', '.join(unknown)} for {model.name}; it has "
                                     f"{offered}.")
    if request.ip_adapter is not None:
        check_takes(model.family, "takes_ip_adapter")
        if request.ip_adapter.name not in ip_adapters:
            offered = ", ".join(ip_adapters) or "none"
            raise UnknownIpAdapterError(f"No IP-Adapter named {request.ip_adapter.name} for {model.name}; "
                                        f"it has {offered}.")
    if request.hires is not None and request.hires.upscaler == "latent":
        check_takes(model.family, "takes_latent_upscale")


def _check_fits(request: JobRequest, model: ModelInfo, max_side: int) -> None:
    """Refuse a job larger than every live worker of its model said it can run: rather than wait in
    line and fail ``out_of_memory``; the message names the largest square that fits."""
    width, height = request.output_size(model.side_multiple)
    capacity, pixels = model.capacity_pixels, width * height * request.pictures
    if capacity is None or pixels <= capacity:
        return
    if request.is_video:
        most = capacity // (width * height)
        raise TooLargeForWorkersError(f"A {width}x{height} clip of {request.frames} frames is {pixels} "
                                      f"pixels; the live workers of {model.name} run at most {capacity} "
                                      f"pixels a job: {most} frames at this size, or a smaller size.")
    images = request.num_images
    side = min(math.isqrt(capacity // images), max_side)
    side -= side % model.side_multiple
    fits = f"{side}x{side} for {images} image(s)" if side >= model.side_multiple else "none this many images"
    raise TooLargeForWorkersError(f"A {width}x{height} job of {images} image(s) is {pixels} "
                                  f"pixels; the live workers of {model.name} run at most {capacity} pixels a "
                                  f"job: {fits}, or fewer images.")


def requested_model(data: Any, offered: Sequence[str]) -> str:
    """The name of the model a client's body asks for: its ``model``, else the first offered; an
    unknown name is refused (``UnknownModelError``), a malformed one left to validation."""
    name = data.get("model") if isinstance(data, dict) else None
    if name is None or not isinstance(name, str):
        return offered[0]
    if name not in offered:
        raise UnknownModelError(f"No model named {name[:64]!r}; this service has {', '.join(offered)}.")
    return name


def _fit_size(data: dict[str, Any], refs: dict[InputName, ImageRef], max_side: int, multiple: int) -> None:
    """The job's size from its start image: sides the model can keep, a mask of the same size."""
    image = refs["image"]
    if image.width % multiple or image.height % multiple or not (
            MIN_SIDE <= min(image.width, image.height) and max(image.width, image.height) <= max_side):
        raise InvalidImageError(f"`image` is {image.width}x{image.height}: its sides must be multiples of "
                                f"{multiple} between {MIN_SIDE} and {max_side}; resize or crop it first")
    mask = refs.get("mask")
    if mask is not None and (mask.width, mask.height) != (image.width, image.height):
        raise InvalidImageError(f"`mask` is {mask.width}x{mask.height} and the image "
                                f"{image.width}x{image.height}: they must be the same size")
    for side, value in (("width", image.width), ("height", image.height)):
        if data.setdefault(side, value) != value:
            raise InvalidImageError(f"`{side}` is {data[side]} but the image's is {value}: leave it out, "
                                    "or resize the image")


class Progress(BaseModel):
    """Denoising progress of a running job."""

    step: int
    total: int


class ModelLoad(BaseModel):
    """How the worker made a job's model current before running it (a worker serving several models)."""

    source: Literal["device", "host", "disk"] = Field(
        description="`device`: it was there already; `host`: moved back from host memory; `disk`: loaded")
    seconds: float = Field(description="the time it took (0 from the device)")


class Eta(BaseModel):
    """Estimated seconds from now until a job starts and until it finishes."""

    start: float
    finish: float


class JobChange(BaseModel):
    """What ``PATCH /v1/jobs/<id>`` changes of a waiting job: its priority class, within those its
    tenant's key may use."""

    model_config = ConfigDict(extra="forbid")

    priority: Priority


class JobError(BaseModel):
    """Why a job failed, with a stable code."""

    code: str
    message: str


class JobView(BaseModel):
    """What ``GET /v1/jobs/<id>`` returns."""

    id: str
    status: JobStatus
    model: str = Field(description="the model it runs on, by name")
    worker: str | None = Field(None, description="the worker that runs or ran it; null until it starts")
    attempt: int = 0
    position: int | None = None
    eta_s: Eta | None = None
    progress: Progress | None = None
    created_at: datetime | None = None
    deadline_at: datetime | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    error: JobError | None = None
    images: list[str] = Field([], description="its images' URLs; a video job's poster (its first frame)")
    video: str | None = Field(None, description="a finished video job's MP4 (H.264), which serves ranged "
                                                "reads; null otherwise")
    preview: str | None = Field(None, description="while it runs with previews: its latest preview, a JPEG")
    model_load: ModelLoad | None = Field(None, description="how its worker made its model current before "
                                                           "it ran; null until then")
    tier: Tier | None = Field(None, description="the tier it runs or ran in (`fast`: with step caching); "
                                                "null until it starts")
    paused: bool = Field(False, description="while it runs: set aside at a step boundary for a job of a "
                                            "higher class (SLOTQ_PREEMPT_AFTER_S); it resumes where it "
                                            "stopped")
    line_paused: bool = Field(False, description="while it waits: its model's line is paused by an operator "
                                                 "(`POST /v1/admin/lines/<model>/pause`); it starts in its "
                                                 "turn once the line resumes, and `eta_s` counts from then")
    resumed_from_step: int | None = Field(None, description="the step its attempt resumed at, from a "
                                                            "step checkpoint of an earlier attempt; "
                                                            "null when it started at step 0")
    request: JobRequest
