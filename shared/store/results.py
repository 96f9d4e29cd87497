"""A job's image bytes, its results and its inputs: in Redis, or in a folder or a bucket.

SLOTQ_RESULT_STORE=redis keeps them in Redis hashes beside the record (the admission script writes
the inputs, the finishing process the PNGs), for the result TTL. With ``file://`` or ``s3://``
(``shared/store/blobs.py``) Redis keeps only the records: the API writes a job's inputs to the
store before its admission script runs (and deletes them again when the job is refused or is a
replay), and the finishing process writes the PNGs of an attempt under a name of its own
(``images/<job>/<attempt>/<i>.png``, and a video job's ``video.mp4`` beside its poster) before the
fenced write of the record that names that attempt, so a reader only ever finds the images of the
attempt whose end was recorded, whole.

A running job's step checkpoint (worker/resuming.py) is one more such write: its bytes beside a
Redis hash (``keys.checkpoint_key``) that names them, written under the attempt's fence and deleted
with the job's end (``lua/lib/ending.lua``); in a folder or a bucket they are an object of their
own (``checkpoints/<job>/<write>.pt``), which the sweep deletes once the hash names another.

Nothing expires by itself there: :meth:`ExternalResults.sweep` (the workers run it at least once a
minute, one at a time) deletes what no live record points to: the images and inputs of jobs whose
result TTL has passed or whose record is gone, and the writes of attempts that never got recorded
(a worker killed between the two writes, a stale attempt), once they are older than the grace that
covers a write in progress.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq.job import Job

from shared.contract import keys
from shared.contract.errors import JobNotFoundError, NotReadyError, ResultExpiredError
from shared.contract.images import input_reference
from shared.contract.jobs import JobStatus
from shared.contract.settings import Settings
from shared.store.blobs import Blobs, Bucket, Folder
from shared.store.records import job_status, save_meta

log = logging.getLogger(__name__)

Hook = Callable[[], None]
TERMINAL_RQ = {"finished", "failed", "stopped", "canceled"}  # RQ's names of a job's final statuses
SWEEP_BATCH = 500  # records read per round trip
VIDEO = "video.mp4"  # a video job's MP4 beside its poster: its field in Redis, its name in a store


class Results:
    """Images and inputs in Redis, beside the record (the default)."""

    in_redis = True  # the admission script writes the inputs

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def save_inputs(self, job_id: str, inputs: dict[str, bytes]) -> None:
        """Before admission: nothing, since the admission script stores them with the job."""

    def drop_inputs(self, job_id: str, names: Iterable[str]) -> None:
        """After a refusal or a replay: nothing, since the script stored nothing."""

    def inputs(self, job: Job) -> dict[str, bytes]:
        """The bytes of a job's input images by name (``image``, ``mask``): those still kept."""
        stored = job.connection.hgetall(keys.inputs_key(job.id))
        return {_text(name): _bytes(data) for name, data in stored.items()}

    def input(self, job: Job, name: str) -> bytes:
        """One input image of a job as the client sent it, or the error that says why there is none."""
        if input_reference(job.kwargs.get("request", {}), name) is None:
            raise JobNotFoundError(f"The job has no input named {name!r}.")
        data = self._input(job, name)
        if data is None:
            raise ResultExpiredError("The job's input images have expired.")
        return data

    def _input(self, job: Job, name: str) -> bytes | None:
        data = job.connection.hget(keys.inputs_key(job.id), name)
        return None if data is None else _bytes(data)

    def save_images(self, job: Job, pngs: list[bytes], before_record: Hook | None = None,
                    video: bytes | None = None) -> None:
        """Keep a finished job's images (a video job's poster, with its MP4) for the result TTL, and
        record how many (under the fence). ``before_record`` runs between the two writes where there
        are two (a test's fault hook)."""
        self.put_images(job, pngs, before_record, video)
        with job.connection.pipeline() as pipe:
            self.record_images(job, pngs, pipe, video)
            pipe.execute()

    def put_images(self, job: Job, pngs: list[bytes], before_record: Hook | None = None,
                   video: bytes | None = None) -> None:
        """The first of the two writes of a job's images, where there are two (then ``before_record``
        runs): nothing in Redis, whose one write is the record's."""

    def record_images(self, job: Job, pngs: list[bytes], pipe: Pipeline, video: bytes | None = None) -> None:
        """Queue the record of a finished job's images (in Redis, with the bytes) on a fenced pipeline."""
        job.meta["images"] = len(pngs)
        key = keys.images_key(job.id)
        files = {str(index): png for index, png in enumerate(pngs)} | ({VIDEO: video} if video else {})
        pipe.delete(key)
        pipe.hset(key, mapping=files)  # type: ignore[arg-type]
        pipe.expire(key, self.settings.result_ttl_s)
        save_meta(job, pipe)

    def image(self, job: Job, index: int) -> bytes:
        """The index-th PNG of a job, or the error that explains why there is none."""
        self._check_image(job, index)
        png = job.connection.hget(keys.images_key(job.id), str(index))
        if png is None:
            raise ResultExpiredError()
        return _bytes(png)

    def image_url(self, job: Job, index: int) -> str | None:
        """A short-lived URL of the image in the store itself, where it has one and it is wanted."""
        return None

    def video(self, job: Job) -> bytes:
        """A video job's MP4, or the error that explains why there is none."""
        self._check_video(job)
        data = job.connection.hget(keys.images_key(job.id), VIDEO)
        if data is None:
            raise ResultExpiredError()
        return _bytes(data)

    def _check_image(self, job: Job, index: int) -> None:
        status = job_status(job)
        if status is not JobStatus.SUCCEEDED:
            raise NotReadyError(f"The job is {status.value}; it has no images.")
        if not 0 <= index < job.meta.get("images", 0):
            raise JobNotFoundError("No image with this index.")

    def _check_video(self, job: Job) -> None:
        if job.kwargs.get("request", {}).get("frames") is None:
            raise JobNotFoundError("The job makes images, not a video.")
        status = job_status(job)
        if status is not JobStatus.SUCCEEDED:
            raise NotReadyError(f"The job is {status.value}; it has no video yet.")

    def save_checkpoint(self, job: Job, step: int, data: bytes) -> None:
        """Keep a running job's step checkpoint in place of the one before: on the worker's fenced
        connection, under the attempt's fence, so a stale attempt writes nothing."""
        with job.connection.pipeline() as pipe:
            self._record_checkpoint(job, step, ("data", data), pipe)
            pipe.execute()

    def checkpoint(self, job: Job) -> tuple[int, bytes] | None:
        """A job's last step checkpoint (the step it was saved at, its bytes), or None where it has none."""
        record = job.connection.hgetall(keys.checkpoint_key(job.id))
        if b"step" not in record:
            return None
        data = self._checkpoint_bytes(record)
        return None if data is None else (int(record[b"step"]), data)

    def _checkpoint_bytes(self, record: dict[Any, Any]) -> bytes | None:
        return record.get(b"data")

    def _record_checkpoint(self, job: Job, step: int, where: tuple[str, bytes], pipe: Pipeline) -> None:
        key = keys.checkpoint_key(job.id)
        pipe.delete(key)
        field, value = where
        pipe.hset(key, mapping={"step": step, "attempt": int(job.meta.get("attempt", 0)), field: value})
        # Deleted with the job's end; the expiry covers a record that outlives its job.
        pipe.expire(key, self.settings.record_ttl_s)

    def sweep(self, connection: Redis) -> int:
        """Delete what has outlived its records: nothing to do, Redis expires it."""
        return 0

    def check(self) -> None:
        """Raise ``StorageUnavailableError`` when the store cannot be written: Redis is checked apart."""


class ExternalResults(Results):
    """Images and inputs in a folder or a bucket; Redis keeps only the records."""

    in_redis = False

    def __init__(self, settings: Settings, blobs: Blobs) -> None:
        super().__init__(settings)
        self.blobs = blobs

    def save_inputs(self, job_id: str, inputs: dict[str, bytes]) -> None:
        for name, data in inputs.items():
            self.blobs.put(_input_name(job_id, name), data)

    def drop_inputs(self, job_id: str, names: Iterable[str]) -> None:
        self.blobs.delete([_input_name(job_id, name) for name in names])

    def inputs(self, job: Job) -> dict[str, bytes]:
        request = job.kwargs.get("request", {})
        found = {name: self._input(job, name) for name in ("image", "mask") if request.get(name) is not None}
        return {name: data for name, data in found.items() if data is not None}

    def _input(self, job: Job, name: str) -> bytes | None:
        if self._expired(job):
            return None
        return self.blobs.get(_input_name(job.id, name))

    def put_images(self, job: Job, pngs: list[bytes], before_record: Hook | None = None,
                   video: bytes | None = None) -> None:
        # Each write of a job's images has a folder of its own, named in the record only once they
        # are all in place: an attempt that dies between the two, or a stale one whose record
        # write the fence refuses, leaves images that nothing names (the sweep removes them).
        attempt = secrets.token_hex(8)
        for index, png in enumerate(pngs):
            self.blobs.put(_image_name(job.id, attempt, index), png)
        if video is not None:
            self.blobs.put(_video_name(job.id, attempt), video)
        job.meta["images_at"] = attempt  # written with the record
        if before_record is not None:
            before_record()

    def record_images(self, job: Job, pngs: list[bytes], pipe: Pipeline, video: bytes | None = None) -> None:
        job.meta["images"] = len(pngs)
        save_meta(job, pipe)

    def save_checkpoint(self, job: Job, step: int, data: bytes) -> None:
        # The bytes under a name of their own first, then the fenced record that names them: a stale
        # attempt's object is named by no record, and the sweep removes it.
        name = _checkpoint_name(job.id, secrets.token_hex(8))
        self.blobs.put(name, data)
        with job.connection.pipeline() as pipe:
            self._record_checkpoint(job, step, ("blob", name.encode()), pipe)
            pipe.execute()

    def _checkpoint_bytes(self, record: dict[Any, Any]) -> bytes | None:
        name = record.get(b"blob")
        return None if name is None else self.blobs.get(_text(name))

    def image(self, job: Job, index: int) -> bytes:
        self._check_image(job, index)
        png = None if self._expired(job) else self.blobs.get(self._image_of(job, index))
        if png is None:
            raise ResultExpiredError()
        return png

    def image_url(self, job: Job, index: int) -> str | None:
        if not self.settings.s3_presign:
            return None
        self._check_image(job, index)
        if self._expired(job):
            raise ResultExpiredError()
        return self.blobs.url(self._image_of(job, index), self.settings.s3_presign_ttl_s)

    def _image_of(self, job: Job, index: int) -> str:
        return _image_name(job.id, str(job.meta.get("images_at", "")), index)

    def video(self, job: Job) -> bytes:
        self._check_video(job)
        name = _video_name(job.id, str(job.meta.get("images_at", "")))
        data = None if self._expired(job) else self.blobs.get(name)
        if data is None:
            raise ResultExpiredError()
        return data

    def _expired(self, job: Job) -> bool:
        """Whether the job ended longer than the result TTL ago (its bytes are then as good as gone)."""
        ended = job.ended_at
        return ended is not None and time.time() - _epoch(ended) > self.settings.result_ttl_s

    def sweep(self, connection: Redis) -> int:
        """Delete every object no live record points to and that is older than the grace; how many."""
        now, grace = time.time(), self.settings.sweep_grace_s
        by_job: dict[str, list[tuple[str, float]]] = defaultdict(list)
        doomed: list[str] = []
        for name, written in self.blobs.listing():
            parts = name.split("/")
            if len(parts) >= 3 and parts[0] in ("images", "inputs", "checkpoints"):
                by_job[parts[1]].append((name, written))
            elif now - written > grace:
                doomed.append(name)  # a stray: a partial write's leftover, say
        ids = list(by_job)
        for start in range(0, len(ids), SWEEP_BATCH):
            chunk = ids[start:start + SWEEP_BATCH]
            with connection.pipeline(transaction=False) as pipe:
                for job_id in chunk:
                    pipe.hmget(Job.key_for(job_id), "status", "ended_at", "meta")
                    pipe.hget(keys.checkpoint_key(job_id), "blob")
                replies = pipe.execute()
            for job_id, record, checkpoint in zip(chunk, replies[::2], replies[1::2], strict=True):
                kept = self._kept(job_id, record, now) + ([_text(checkpoint)] if checkpoint else [])
                doomed += [name for name, written in by_job[job_id]
                           if not any(name.startswith(prefix) for prefix in kept) and now - written > grace]
        self.blobs.delete(doomed)
        if doomed:
            log.info("swept %d stored object(s) that no live record points to", len(doomed))
        return len(doomed)

    def _kept(self, job_id: str, record: list[bytes | None], now: float) -> list[str]:
        """The name prefixes of a job's objects that its record still points to."""
        status, ended_at, meta = record
        if status is None:
            return []  # no record: nothing points here
        ended = _epoch(_parse(_text(ended_at))) if ended_at else None
        if _text(status) in TERMINAL_RQ and ended and now - ended > self.settings.result_ttl_s:
            return []
        try:
            attempt = json.loads(meta).get("images_at") if meta else None
        except ValueError:  # not the service's JSON: keep all of it rather than guess
            return [f"inputs/{job_id}/", f"images/{job_id}/"]
        return [f"inputs/{job_id}/", *([f"images/{job_id}/{attempt}/"] if attempt else [])]

    def check(self) -> None:
        self.blobs.check()


# By the identity of the settings (a process reads its settings once): no work per call on the
# paths that ask for the store each time (admission, finishing). The settings are kept with their
# store, so an id is never reused while its entry stands.
_made: dict[int, tuple[Settings, Results]] = {}


def of(settings: Settings) -> Results:
    """The result store SLOTQ_RESULT_STORE names, made once per process and settings."""
    made = _made.get(id(settings))
    if made is None or made[0] is not settings:
        made = _made[id(settings)] = (settings, _make(settings))
    return made[1]


def _make(settings: Settings) -> Results:
    store = settings.result_store
    if store == "redis":
        return Results(settings)
    if store.startswith("file://"):
        return ExternalResults(settings, Folder(Path(store.removeprefix("file://"))))
    import boto3  # only a service that stores in S3 needs it (the `s3` extra)

    bucket, _, prefix = store.removeprefix("s3://").partition("/")
    secret = settings.s3_secret_access_key
    client = boto3.client("s3", endpoint_url=settings.s3_endpoint_url, region_name=settings.s3_region,
                          aws_access_key_id=settings.s3_access_key_id,
                          aws_secret_access_key=secret.get_secret_value() if secret else None)
    return ExternalResults(settings, Bucket(client, bucket, prefix))


def _input_name(job_id: str, name: str) -> str:
    return f"inputs/{job_id}/{name}"


def _checkpoint_name(job_id: str, write: str) -> str:
    return f"checkpoints/{job_id}/{write}.pt"


def _image_name(job_id: str, attempt: str, index: int) -> str:
    return f"images/{job_id}/{attempt}/{index}.png"


def _video_name(job_id: str, attempt: str) -> str:
    return f"images/{job_id}/{attempt}/{VIDEO}"


def _epoch(moment: datetime) -> float:
    """Seconds since the epoch of a moment (RQ's are naive UTC)."""
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()


def _parse(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()
