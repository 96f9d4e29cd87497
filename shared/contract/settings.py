"""Service settings, read once from ``SLOTQ_*`` environment variables."""

from __future__ import annotations

import base64
import json
import math
import re
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from shared.contract import keys
from shared.contract.checkpoints import FolderModel, folder_models
from shared.contract.controlnets import available_controlnets
from shared.contract.errors import validation_message
from shared.contract.ip_adapters import available_ip_adapters
from shared.contract.jobs import MAX_IMAGES, Priority
from shared.contract.memory import MemoryOptions, Offload, Quantize
from shared.contract.models import (
    DEFAULT_MODEL_NAME,
    FAMILIES,
    FAMILY_SPECS,
    MODEL_NAME_PATTERN,
    TINY_MODELS,
    Family,
)

# The configuration source of each family's single-file checkpoints by default (its record's).
CHECKPOINT_CONFIGS: dict[Family, str] = {family: spec.checkpoint_config
                                         for family, spec in FAMILY_SPECS.items()}
DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")
# host:port, the host a name, an IPv4 address or a bracketed IPv6 address.
ADDRESS_PATTERN = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")


class KeyPolicy(BaseModel):
    """One API key's tenant and its own limits (unset: the service-wide ones)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.@-]+$")
    rate: float | None = Field(None, gt=0)
    burst: float | None = Field(None, gt=0)
    max_queued: int | None = Field(None, ge=1)
    priorities: list[Priority] | None = Field(None, min_length=1)


KeyTable = dict[str, str | KeyPolicy]


class Settings(BaseSettings):
    """Every knob of the service; see ``.env.example`` for one line on each."""

    model_config = SettingsConfigDict(env_prefix="SLOTQ_", extra="ignore", frozen=True)

    redis_url: str = "redis://localhost:6379/0"
    redis_timeout_s: float = Field(1.0, gt=0, le=30)
    redis_max_connections: int = Field(100, ge=2, le=10_000)
    # With sentinels, they name the master; redis_url then gives only the db, user, password and TLS.
    # NoDecode: the validator reads the variable itself, as JSON or as a comma-separated list.
    redis_sentinels: Annotated[list[str], NoDecode] = []
    redis_master: str = Field("mymaster", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    redis_sentinel_password: str | None = None
    min_replicas_ack: int = Field(0, ge=0, le=5)
    replicas_ack_timeout_ms: int = Field(500, ge=1, le=10_000)
    queue_name: str = Field("slotq", pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    queue_capacity: int = Field(100, ge=1, le=1_000_000)
    low_share: float = Field(0.5, gt=0, le=1)
    high_reserve: float = Field(0.1, ge=0, le=10)

    model: str = Field("tiny", min_length=1)
    # The name this worker serves SLOTQ_MODEL under: it claims only jobs that name it.
    model_name: str = Field(DEFAULT_MODEL_NAME, pattern=MODEL_NAME_PATTERN)
    # The names the API accepts, the first the default: "default,xl=sdxl" (a family after "=" is
    # what the API assumes of that model while no worker of it says). NoDecode: read as text.
    model_names: Annotated[list[str], NoDecode] = [DEFAULT_MODEL_NAME]
    # What the API assumes of SLOTQ_MODEL while no worker says (a tiny model's family is known).
    model_family: Family | None = None
    # A folder of models: each *.safetensors or *.gguf single file and diffusers folder in it is a model
    # named after its stem, offered beside SLOTQ_MODEL_NAMES; a sidecar <stem>.json may force its family
    # and name a VAE file and memory settings (shared/contract/checkpoints.py).
    models_dir: Path | None = None
    # Where a single-file checkpoint's layout (configs, tokenizers) comes from, by family: a diffusers
    # folder or a hub id, read from the local hub cache only. "sd=/configs/sd15,sdxl=..."; a family
    # left out keeps the hub id diffusers itself uses. NoDecode: read as text.
    checkpoint_configs: Annotated[dict[Family, str], NoDecode] = dict(CHECKPOINT_CONFIGS)
    # The models this worker serves, by name: SLOTQ_MODEL_NAME (loaded from SLOTQ_MODEL) and models of
    # SLOTQ_MODELS_DIR, comma-separated, or "*" for every model of the folder; empty: SLOTQ_MODEL_NAME
    # alone. NoDecode: read as text.
    worker_models: Annotated[list[str], NoDecode] = []
    # Of those, how many pipelines stay on the device, and how many more in host memory on a GPU
    # worker (moved back with .to(), not read from disk again), memory permitting; the least recently
    # used goes first.
    model_cache: int = Field(1, ge=1, le=16)
    host_model_cache: int = Field(2, ge=0, le=64)
    # The memory settings of every model (shared/contract/memory.py); a model's sidecar may set its own.
    offload: Offload = "none"
    vae_slicing: bool = False
    vae_tiling: bool = False
    quantize: Quantize = "none"
    # torch.compile of each model: off, regional (the denoiser's repeated blocks) or full (the denoiser
    # and the VAE's decoder); the sizes ("512x512,1024x1024") compiled at start, before the worker
    # says it is ready (docs/gpus.md).
    compile: Literal["off", "regional", "full"] = "off"
    compile_sizes: Annotated[list[str], NoDecode] = []
    # Jobs asking "speed": "auto" run in the fast tier while their line is deeper than this; unset: never.
    degrade_at: int | None = Field(None, ge=0, le=1_000_000)
    # The pixels x images one execution may make on this worker, as its heartbeat reports it; unset:
    # measured on a GPU (device memory against the peaks of its jobs), none on the CPU. The API refuses
    # a job no live worker of its model can run (422 too_large_for_workers).
    capacity_pixels: int | None = Field(None, ge=4096)
    device: str = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    # torch's CPU threads in the worker, every execution; 0: on the CPU 1 or torch's default by each
    # execution's work (pixels x steps x images), from a threshold timed at warm-up (docs/settings.md);
    # on a GPU torch's own count.
    torch_threads: int = Field(0, ge=0, le=1024)
    cache_dir: Path = Path.home() / ".cache" / "slotq"
    lora_dir: Path | None = None
    lora_cache: int = Field(4, ge=1, le=64)
    # A folder of ControlNets (shared/contract/controlnets.py), read by the API and the workers; the
    # worker keeps this many loaded, at least a job's two.
    controlnet_dir: Path | None = None
    controlnet_cache: int = Field(2, ge=2, le=16)
    # A folder of IP-Adapters and the image encoder they share (shared/contract/ip_adapters.py), read by
    # the API and the workers; the worker keeps this many adapters' weights in memory.
    ip_adapter_dir: Path | None = None
    ip_adapter_cache: int = Field(2, ge=1, le=16)
    affinity_max_skip: int = Field(8, ge=0, le=1000)

    max_side: int = Field(1024, ge=64, le=4096)
    max_steps: int = Field(100, ge=1, le=1000)
    max_frames: int = Field(257, ge=2, le=1025)  # a clip's, at most (LTX-Video's longest is 257)
    # Room for a start image and a mask of SLOTQ_MAX_IMAGE_BYTES each, base64-encoded (4/3).
    max_body_bytes: int = Field(12 * 2**20, ge=1024, le=64 * 2**20)
    max_image_bytes: int = Field(4 * 2**20, ge=1024, le=32 * 2**20)
    job_timeout_s: int = Field(900, ge=1)
    # Batching and step-level scheduling on: bench.peers decided it (docs/settings.md, "Why these
    # defaults"). Step-level scheduling (worker/joining.py): compatible jobs join a running batch at a
    # step boundary, and a higher class preempts it there after SLOTQ_PREEMPT_AFTER_S (negative: never).
    max_batch: int = Field(8, ge=1, le=64)
    batch_wait_ms: int = Field(0, ge=0, le=10_000)
    step_scheduling: bool = True
    preempt_after_s: float = Field(0.0, le=3600)
    progress_interval_ms: int = Field(100, ge=0, le=60_000)
    # Claim the next execution's jobs while the current one decodes; auto: on a GPU, not on the CPU,
    # where the claiming thread's Python slows the decode more than the round trip it saves.
    claim_ahead: bool | Literal["auto"] = "auto"
    preview_interval_ms: int = Field(500, ge=50, le=60_000)
    # A step-level job's denoising state saved this often (0: never), so that the attempt after a
    # crash, a drain or a restart resumes where it stopped (worker/resuming.py).
    checkpoint_every_s: float = Field(60.0, ge=0, le=86_400)
    preview_decoder: Path | None = None
    # zlib's level for the result PNGs: lossless at every level; at 1 zlib matches runs only, which
    # encodes a photograph much faster than Pillow's default 6, about as small (docs/settings.md).
    png_compress_level: int = Field(1, ge=0, le=9)
    max_attempts: int = Field(2, ge=1, le=10)
    heartbeat_ttl_s: float = Field(6.0, ge=1, le=300)
    # Sharing the device (worker/sharing.py). Idle release is off by default: a job after a lull would
    # wait for its model to come back, which is what a worker holding its model exists to spare; a
    # card shared with another program turns it on (docs/gpus.md). Yielding reads a GPU's free memory.
    idle_release_s: float = Field(0.0, ge=0, le=7 * 86_400)
    yield_below_mb: int = Field(0, ge=0, le=2**20)
    stop_timeout_s: float | None = Field(None, gt=0)
    drain_s: float = Field(3.0, ge=0, le=300)
    worker_name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    fault_injection: bool = False
    result_ttl_s: int = Field(3600, ge=1)
    record_ttl_s: int = Field(86_400, ge=1)
    failure_ttl_s: int = Field(7 * 86_400, ge=1)
    result_store: str = "redis"
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: SecretStr | None = None
    s3_presign: bool = False
    s3_presign_ttl_s: int = Field(300, ge=1, le=7 * 86_400)
    sweep_interval_s: float = Field(30.0, gt=0, le=60)
    sweep_grace_s: float = Field(60.0, ge=0, le=86_400)

    api_keys: KeyTable | None = None
    api_keys_file: Path | None = None
    # The operators' keys (/v1/admin/...), apart from the tenants': none set, the routes are off.
    admin_keys: list[SecretStr] = []
    tenant_rate: float | None = Field(None, gt=0)
    tenant_burst: float | None = Field(None, gt=0)
    tenant_max_queued: int | None = Field(None, ge=1)

    api_host: str = "127.0.0.1"
    api_port: int = Field(8000, ge=1, le=65535)
    api_workers: int = Field(2, ge=1, le=64)
    api_threads: int = Field(16, ge=1, le=256)
    # gthread: a thread per request in progress, open streams and long-polls included; gevent: a
    # greenlet each, so open streams hold no thread (bench/streams.py measures both).
    api_worker_class: Literal["gthread", "gevent"] = "gevent"
    max_streams: int = Field(200, ge=1, le=10_000)
    # With API keys, one tenant's most of an API process's waiting slots and of its event streams.
    tenant_wait_share: float = Field(0.5, gt=0, le=1)
    # The service's address as its clients reach it (https://images.example.org), for the URLs its answers
    # carry; unset: the request's own, whose Host a client chooses.
    public_url: str | None = None
    # How many proxies in front of the API set X-Forwarded-For, -Proto and -Host (each overwriting what a
    # client sent): those headers are believed from that many hops (werkzeug's ProxyFix), else ignored.
    trusted_proxies: int = Field(0, ge=0, le=10)
    # The compatibility surfaces (OpenAI Images, AUTOMATIC1111) answer when the job ends, up to this.
    sync_wait_s: float = Field(600.0, gt=0, le=86_400)
    # Model names a foreign client sends, each meaning one of SLOTQ_MODEL_NAMES (OpenAI's own names
    # mean the default model unless mapped here).
    model_aliases: dict[str, str] = {}
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"
    log_prompts: bool = False
    metrics_dir: Path | None = None
    worker_metrics_host: str = "127.0.0.1"
    worker_metrics_port: int = Field(9101, ge=0, le=65535)

    webhook_secret: str | None = Field(None, min_length=16)
    webhook_allow: list[str] = []
    webhook_timeout_s: float = Field(5.0, gt=0, le=60)
    webhook_retry_s: float = Field(3600.0, ge=0, le=7 * 86_400)

    @property
    def assumed_family(self) -> Family:
        """The family of SLOTQ_MODEL as the API takes it while no worker says: SLOTQ_MODEL_FAMILY,
        a tiny model's own, else SD's."""
        return self.model_family or TINY_MODELS.get(self.model, "sd")

    @property
    def offered_models(self) -> dict[str, Family]:
        """The models a job may name, the default first, each with the family assumed for it while
        none of its workers says: SLOTQ_MODEL_NAMES' (its own after "=", else that of its file in
        SLOTQ_MODELS_DIR, else :attr:`assumed_family`), then the rest of SLOTQ_MODELS_DIR's."""
        folder = folder_models(self.models_dir)
        entries = (entry.partition("=") for entry in self.model_names)
        named: dict[str, Family] = {
            name: family or (folder[name].family if name in folder else self.assumed_family)  # type: ignore[misc]
            for name, _, family in entries}
        return named | {name: model.family for name, model in folder.items() if name not in named}

    def folder_model(self, name: str) -> FolderModel | None:
        """The model of this name in SLOTQ_MODELS_DIR; None where it is not one of the folder's."""
        return folder_models(self.models_dir).get(name)

    @property
    def default_model(self) -> str:
        """The model of a job that names none: the first of SLOTQ_MODEL_NAMES."""
        return next(iter(self.offered_models))

    @property
    def served_models(self) -> list[str]:
        """The models this worker serves, by name: SLOTQ_WORKER_MODELS ("*": every model of the
        folder), else SLOTQ_MODEL_NAME alone."""
        if self.worker_models == ["*"]:
            return list(folder_models(self.models_dir))
        return list(self.worker_models) or [self.model_name]

    def source_of(self, model: str) -> str:
        """What the worker loads for a model it serves: its file or folder in SLOTQ_MODELS_DIR, else
        SLOTQ_MODEL (SLOTQ_MODEL_NAME's)."""
        folder = self.folder_model(model)
        return str(folder.path) if folder is not None else self.model

    def memory_of(self, model: str) -> MemoryOptions:
        """A model's memory settings: the service's, under its sidecar's own where it has one."""
        folder = self.folder_model(model)
        overrides = folder.memory if folder is not None else {}
        return self.memory.merged(overrides)

    @property
    def memory(self) -> MemoryOptions:
        """The memory settings of every model (SLOTQ_OFFLOAD, SLOTQ_VAE_*, SLOTQ_QUANTIZE)."""
        return MemoryOptions(offload=self.offload, vae_slicing=self.vae_slicing, vae_tiling=self.vae_tiling,
                             quantize=self.quantize)

    @property
    def line(self) -> str:
        """The line this worker claims from: that of SLOTQ_MODEL_NAME."""
        return keys.line_name(self.queue_name, self.model_name)

    def line_of(self, model: str) -> str:
        """The line of the model of this name."""
        return keys.line_name(self.queue_name, model)

    @property
    def weight_folders(self) -> list[Path]:
        """The folders weights are read from: models, adapters, ControlNets, IP-Adapters, the tiny models."""
        folders = (self.models_dir, self.lora_dir, self.controlnet_dir, self.ip_adapter_dir, self.cache_dir)
        return [folder for folder in folders if folder is not None]

    def job_timeout_of(self, model: str | None) -> int:
        """A job's timeout on this model: SLOTQ_JOB_TIMEOUT_S where it is set; else its default, or the
        model's family's where longer (a clip's)."""
        if "job_timeout_s" in self.model_fields_set:
            return self.job_timeout_s
        family = self.offered_models.get(model or self.default_model)
        longer = FAMILY_SPECS[family].job_timeout_s if family is not None else None
        return max(self.job_timeout_s, longer or 0)

    def controls_of(self, model: str, family: Family) -> dict[str, list[str]]:
        """The ControlNets and IP-Adapters a job on this model may name: none where its family takes
        none (its record says)."""
        spec = FAMILY_SPECS[family]
        controlnets = available_controlnets(self.controlnet_dir, model) if spec.takes_controlnet else []
        ip_adapters = available_ip_adapters(self.ip_adapter_dir, model) if spec.takes_ip_adapter else []
        return {"controlnets": controlnets, "ip_adapters": ip_adapters}

    def lora_dir_of(self, model: str) -> Path | None:
        """Where a model's adapters are: the subfolder of SLOTQ_LORA_DIR named after it where there is
        one (each model its own adapters), else SLOTQ_LORA_DIR itself."""
        if self.lora_dir is None:
            return None
        own = self.lora_dir / model
        return own if own.is_dir() else self.lora_dir

    @field_validator("result_store")
    @classmethod
    def _store_scheme(cls, value: str) -> str:
        if value == "redis":
            return value
        if value.startswith("file://") and value.removeprefix("file://").startswith("/"):
            return value
        if re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?", value):
            return value
        raise ValueError("must be redis, file:///an/absolute/folder or s3://bucket/prefix")

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"https?://[^\s/?#]+(/[^\s?#]*)?", value):
            raise ValueError("must be an http:// or https:// URL with no query")
        return value.rstrip("/") if value else None

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return value

    @field_validator("redis_sentinels", "model_names", "worker_models", "compile_sizes", mode="before")
    @classmethod
    def _text_list(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except ValueError:
                    raise ValueError("must be a JSON list or comma-separated entries") from None
            return [entry.strip() for entry in text.split(",") if entry.strip()]
        return value

    @field_validator("checkpoint_configs", mode="before")
    @classmethod
    def _family_table(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        if value.strip().startswith("{"):  # JSON, as the harness passes a dict setting
            try:
                return CHECKPOINT_CONFIGS | json.loads(value)
            except ValueError:
                raise ValueError("must be a JSON object or family=source entries") from None
        given: dict[str, str] = {}
        for entry in filter(None, (part.strip() for part in value.split(","))):
            family, equals, source = (part.strip() for part in entry.partition("="))
            if not equals or family not in FAMILIES or not source:
                raise ValueError(f"{entry!r} is not family=source (the family one of {', '.join(FAMILIES)})")
            given[family] = source
        return CHECKPOINT_CONFIGS | given  # a family left out keeps its default

    @field_validator("compile_sizes")
    @classmethod
    def _sizes(cls, value: list[str]) -> list[str]:
        for entry in value:
            if not re.fullmatch(r"[1-9][0-9]{1,4}x[1-9][0-9]{1,4}", entry):
                raise ValueError(f"{entry!r} is not WIDTHxHEIGHT (512x512)")
        return value

    @property
    def warm_sizes(self) -> list[tuple[int, int]]:
        """SLOTQ_COMPILE_SIZES as (width, height) pairs."""
        pairs = (entry.split("x") for entry in self.compile_sizes)
        return [(int(width), int(height)) for width, height in pairs]

    @field_validator("redis_sentinels")
    @classmethod
    def _sentinel_addresses(cls, value: list[str]) -> list[str]:
        for entry in value:
            match = ADDRESS_PATTERN.match(entry)
            if not match or not 1 <= int(match["port"]) <= 65535:
                raise ValueError(f"{entry!r} is not host:port")
        return value

    @field_validator("model_names")
    @classmethod
    def _known_names(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("must name at least one model")
        names = []
        for entry in value:
            name, _, family = entry.partition("=")
            if not re.fullmatch(MODEL_NAME_PATTERN, name):
                raise ValueError(f"{name!r} is not a model name (letters, digits, _ . -, at most 64)")
            if family and family not in FAMILIES:
                raise ValueError(f"{entry!r}: the family after = must be one of {', '.join(FAMILIES)}")
            names.append(name)
        if len(set(names)) != len(names):
            raise ValueError("must not name a model twice")
        return value

    @model_validator(mode="after")
    def _model_of_the_folder(self) -> Settings:
        # A worker whose SLOTQ_MODEL_NAME names a model of SLOTQ_MODELS_DIR serves that file or
        # folder, whatever SLOTQ_MODEL says (.env.example sets SLOTQ_MODEL=tiny for everyone).
        served = self.folder_model(self.model_name)
        if served is not None:
            object.__setattr__(self, "model", str(served.path))  # frozen model: set once, while validating
        return self

    @model_validator(mode="after")
    def _served_models_exist(self) -> Settings:
        if "*" in self.worker_models and self.worker_models != ["*"]:
            raise ValueError("SLOTQ_WORKER_MODELS: * stands alone (every model of SLOTQ_MODELS_DIR)")
        if self.worker_models == ["*"] and not folder_models(self.models_dir):
            raise ValueError("SLOTQ_WORKER_MODELS=*: SLOTQ_MODELS_DIR offers no model")
        unknown = [name for name in self.worker_models
                   if name not in ("*", self.model_name) and self.folder_model(name) is None]
        if unknown:
            raise ValueError(f"SLOTQ_WORKER_MODELS: {', '.join(unknown)[:100]} is neither SLOTQ_MODEL_NAME "
                             f"nor a model of SLOTQ_MODELS_DIR")
        if len(set(self.worker_models)) != len(self.worker_models):
            raise ValueError("SLOTQ_WORKER_MODELS must not name a model twice")
        return self

    @model_validator(mode="after")
    def _aliases_name_models(self) -> Settings:
        unknown = sorted(set(self.model_aliases.values()) - set(self.offered_models))
        if unknown:
            raise ValueError(f"SLOTQ_MODEL_ALIASES: {', '.join(unknown)[:100]} not in SLOTQ_MODEL_NAMES")
        return self

    @field_validator("webhook_secret")
    @classmethod
    def _secret_decodes(cls, value: str | None) -> str | None:
        if value is not None and value.startswith("whsec_"):
            try:
                key = base64.b64decode(value.removeprefix("whsec_") + "==", validate=True)
            except ValueError:
                raise ValueError("a whsec_ secret must be base64 after the prefix") from None
            if len(key) < 24:
                raise ValueError("a whsec_ secret must decode to at least 24 bytes")
        return value

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not DEVICE_PATTERN.match(value):
            raise ValueError("must be auto, cpu, mps, cuda or cuda:N")
        return value

    @model_validator(mode="after")
    def _record_outlives_result(self) -> Settings:
        # A job record that vanished before its images would turn "410 expired" into "404".
        if self.record_ttl_s < self.result_ttl_s:
            raise ValueError("SLOTQ_RECORD_TTL_S must be at least SLOTQ_RESULT_TTL_S")
        return self

    @model_validator(mode="after")
    def _replication_fits(self) -> Settings:
        if self.redis_sentinels and self.redis_url.startswith("unix://"):
            raise ValueError("SLOTQ_REDIS_URL: with SLOTQ_REDIS_SENTINELS it must be redis:// or rediss://")
        # WAIT runs within one command's timeout: past it the socket gives up first, and the
        # error would read "unavailable" instead of "not replicated".
        if self.min_replicas_ack and self.replicas_ack_timeout_ms >= self.redis_timeout_s * 1000:
            raise ValueError("SLOTQ_REPLICAS_ACK_TIMEOUT_MS must be below SLOTQ_REDIS_TIMEOUT_S")
        return self

    @model_validator(mode="after")
    def _keys_from_file(self) -> Settings:
        if self.api_keys is None and self.api_keys_file is not None:
            try:
                keys = TypeAdapter(KeyTable).validate_json(self.api_keys_file.read_bytes())
            except (OSError, ValueError) as exc:
                raise ValueError(f"SLOTQ_API_KEYS_FILE: not a valid table of keys: {exc}") from None
            object.__setattr__(self, "api_keys", keys)  # frozen model: set once, while validating
        if self.tenant_rate is not None and self.tenant_burst is None:
            raise ValueError("SLOTQ_TENANT_BURST must be set with SLOTQ_TENANT_RATE")
        if set(self.api_keys or {}) & {key.get_secret_value() for key in self.admin_keys}:
            raise ValueError("SLOTQ_ADMIN_KEYS: an admin key must not also be a tenant's key")
        if any(not key.get_secret_value() for key in self.admin_keys):
            raise ValueError("SLOTQ_ADMIN_KEYS: an empty key")
        return self

    def waiting_limit(self, priority: Priority) -> int:
        """A job of this priority is admitted while fewer than this many jobs wait, in all classes."""
        share = {"low": self.low_share, "normal": 1.0, "high": 1 + self.high_reserve}[priority]
        # Rounded first so that 100 * 1.1 (110.00000000000001 in floats) gives 110 places, not 111.
        return max(1, math.ceil(round(self.queue_capacity * share, 6)))

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """The sentinels as (host, port) pairs, IPv6 hosts without their brackets."""
        matches = [ADDRESS_PATTERN.match(entry) for entry in self.redis_sentinels]
        return [(m["host"].strip("[]"), int(m["port"])) for m in matches if m]

    @property
    def batch_pixels(self) -> int:
        """The most pixels one GPU execution may make: those of the largest single job allowed."""
        return self.max_side * self.max_side * MAX_IMAGES

    @property
    def issued_ttl_s(self) -> int:
        """How long an id is remembered, so that a job whose record expired answers 410, not 404."""
        return max(self.record_ttl_s, self.failure_ttl_s) + 7 * 86_400


class SettingsError(SystemExit):
    """A bad setting: stops start-up with one line naming the variable."""


def load_settings(env_file: Path | None = None) -> Settings:
    """Read the settings from the environment (and ``env_file``, below it), or exit with one clear
    line per bad variable."""
    try:
        return Settings(_env_file=env_file)
    except ValidationError as exc:
        # One line per variable, however many ways its value failed (a union reports each branch).
        problems: dict[str, list[str]] = {}
        for error in exc.errors():
            name = f"SLOTQ_{str(error['loc'][0]).upper()}: " if error["loc"] else ""
            problems.setdefault(name, []).append(validation_message(error["msg"]))
        lines = [f"slotq: bad setting {name}{'; '.join(messages)}" for name, messages in problems.items()]
        raise SettingsError("\n".join(lines)) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once."""
    return load_settings()
