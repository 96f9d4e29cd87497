"""A job's record in Redis: finding it, what clients read (status, progress, images), what the worker writes.

How a job ends is shared/store/endings.py's."""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from redis import Redis
from redis.client import Pipeline
from rq.exceptions import NoSuchJobError
from rq.job import Job
from rq.job import JobStatus as RQStatus
from rq.queue import Queue

from shared.contract import keys
from shared.contract.errors import JobNotFoundError, NoPreviewError, ResultExpiredError
from shared.contract.jobs import (
    Eta,
    JobError,
    JobRequest,
    JobStatus,
    JobView,
    ModelLoad,
    Progress,
    job_cost,
    output_size,
    steps_run,
)
from shared.contract.settings import Settings
from shared.contract.tenants import Tenant
from shared.store import estimates, events, fencing, outbox, scripts, waiting
from shared.store.connection import text

STATUS_FROM_RQ = {
    RQStatus.QUEUED: JobStatus.QUEUED,
    RQStatus.CREATED: JobStatus.QUEUED,
    RQStatus.STARTED: JobStatus.RUNNING,
    RQStatus.FINISHED: JobStatus.SUCCEEDED,
    RQStatus.FAILED: JobStatus.FAILED,
    # RQ calls a job stopped when its worker ended it on request; to a client that is a cancel.
    RQStatus.STOPPED: JobStatus.CANCELED,
    RQStatus.CANCELED: JobStatus.CANCELED,
}


STORED_LIMITS = {"max_side": 2**31, "max_steps": 2**31, "side_multiple": 1}

STATUS_BY_NAME = {rq_status.value: status for rq_status, status in STATUS_FROM_RQ.items()}


def job_status(job: Job) -> JobStatus:
    """The client-facing status of an RQ job."""
    status = STATUS_FROM_RQ.get(job.get_status(refresh=False), JobStatus.QUEUED)
    if status is JobStatus.CANCELED and job.meta.get("expired"):
        return JobStatus.EXPIRED
    return status


def stored_statuses(connection: Redis, job_ids: Sequence[str]) -> list[JobStatus | None]:
    """These jobs' statuses as their hashes hold them now, in one round trip (an expired job reads
    canceled); None for a job whose record is gone."""
    with connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(Job.key_for(job_id), "status")
        raws = pipe.execute()
    return [None if raw is None else STATUS_BY_NAME.get(text(raw), JobStatus.QUEUED) for raw in raws]


def tenants_of(connection: Redis, job_ids: Sequence[str]) -> list[str | None]:
    """The tenant each of these jobs was admitted for, in one round trip; None for a job whose record
    is gone."""
    with connection.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hget(Job.key_for(job_id), "tenant")
        return [None if raw is None else text(raw) for raw in pipe.execute()]


def attempts_used(job: Job) -> int:
    """Starts that count against SLOTQ_MAX_ATTEMPTS: a graceful interruption does not."""
    return int(job.meta.get("attempt", 0)) - int(job.meta.get("interrupted", 0))


def job_view(job: Job, position: int | None = None) -> JobView:
    """What a client sees of a job; pass ``position`` when it is already known."""
    status = job_status(job)
    meta: dict[str, Any] = job.meta or {}
    if status is not JobStatus.QUEUED:
        position = None
    elif position is None:
        # None here means a worker took it a moment ago: it is next, about to run.
        position = waiting.position(job.connection, waiting.line_of(job), job.id) or 0
    progress, error = meta.get("progress"), meta.get("error")
    images = meta.get("images", 0) if status is JobStatus.SUCCEEDED else 0
    deadline = meta.get("deadline_at")
    # Checked against the service's limits when it was admitted: read back without them (a job of
    # 150 steps under SLOTQ_MAX_STEPS=1000 is no error to show).
    request = JobRequest.model_validate(job.kwargs["request"], strict=False, context=STORED_LIMITS)
    return JobView(
        id=job.id,
        status=status,
        model=waiting.job_model(job),
        worker=job.worker_name or None,
        attempt=int(meta.get("attempt", 0)),
        position=position,
        progress=Progress(**progress) if progress else None,
        created_at=_aware(job.created_at),
        deadline_at=datetime.fromtimestamp(deadline, UTC) if deadline else None,
        started_at=_aware(job.started_at),
        finished_at=_aware(job.ended_at),
        error=JobError(**error) if error else _default_error(status),
        images=[f"/v1/jobs/{job.id}/images/{index}" for index in range(images)],
        video=f"/v1/jobs/{job.id}/video.mp4" if images and request.is_video else None,
        preview=f"/v1/jobs/{job.id}/preview" if request.previews and status is JobStatus.RUNNING else None,
        model_load=ModelLoad(**meta["model_load"]) if meta.get("model_load") else None,
        tier=meta.get("tier"),
        paused=bool(meta.get("paused")) and status is JobStatus.RUNNING,
        resumed_from_step=meta.get("resumed_from_step"),
        request=request,
    )


def _aware(moment: datetime | None) -> datetime | None:
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


def _default_error(status: JobStatus) -> JobError | None:
    if status is JobStatus.FAILED:
        return JobError(code="job_failed", message="The job failed.")
    return None


def save_meta(job: Job, pipe: Pipeline | None = None) -> None:
    """Write the job's meta alone, never the rest of its record."""
    (pipe or job.connection).hset(job.key, "meta", job.serializer.dumps(job.meta))


def begin_attempt(job: Job) -> None:
    """Count a start (in the job's meta: :func:`announce_start` writes it, with step 0)."""
    job.meta["attempt"] = int(job.meta.get("attempt", 0)) + 1


def cost_of(job: Job) -> float:
    """The job's cost in units, from its stored request (both passes of a hires job)."""
    request = job.kwargs.get("request", {})
    try:
        width, height = request["width"], request["height"]
        images = request["num_images"] * (request.get("frames") or 1)  # a clip's frames count each
        cost = job_cost(width, height, _first_steps_of(request) or request["steps"], images)
        hires = request.get("hires")
        if hires:
            larger = output_size(width, height, hires["scale"])
            steps = steps_run(hires.get("steps") or request["steps"], hires["denoise"])
            cost += job_cost(*larger, steps, images)
        return cost
    except (KeyError, TypeError):
        return 0.0


def report_progress(jobs: list[Job], step: int, total: int) -> list[bool]:
    """Record step progress on jobs that run together, from inside the GPU section, where every
    round trip is idle GPU time; whether each was canceled by its client.

    Step 0 comes once the jobs are marked running, so it also announces their start (and queues
    the ``started`` webhooks), in one fenced transaction like any other write (the slotq worker
    queues it with its start bookkeeping instead: :func:`announce_start`). Each later step costs
    one round trip for the whole batch: one script that, for each job, checks the attempt's fence
    itself, writes the progress and answers whether the job was canceled, rather than the two
    round trips of a watched transaction.
    """
    if step:
        for job in jobs:
            job.meta["progress"] = {"step": step, "total": total}
        # At one step together: their worker's running entry takes this step's time, which ETAs read.
        worker = jobs[0].worker_name
        return _report_step(jobs, (waiting.line_of(jobs[0]), worker, step, total) if worker else None)
    with jobs[0].connection.pipeline(transaction=False) as pipe:
        announce_start(jobs, pipe)
        answers = pipe.execute()
    return [bool(answer) for answer in answers[-len(jobs):]]


def report_steps(jobs: list[Job], steps: Sequence[tuple[int, int]], timed: tuple[int, int] | None = None
                 ) -> list[bool]:
    """:func:`report_progress` for jobs each at its own step (``(step, total)`` each, none 0: the
    step-level loop's), in one round trip; whether each was canceled by its client. ``timed``: the
    steps the loop has run since its running entry was marked, and that plus the most any job has
    left, for the entry's step time (ETAs)."""
    for job, (step, total) in zip(jobs, steps, strict=True):
        job.meta["progress"] = {"step": step, "total": total}
    worker = jobs[0].worker_name
    if timed is None or not worker:
        return _report_step(jobs)
    return _report_step(jobs, (waiting.line_of(jobs[0]), worker, *timed))


def announce_start(jobs: list[Job], pipe: Pipeline) -> None:
    """Queue step 0 of jobs just marked running: their progress, ``started`` and ``progress`` events
    and webhooks, then (the pipeline's last answers, one per job) whether each was canceled."""
    for job in jobs:
        job.meta["progress"] = {"step": 0, "total": steps_run_of(job.kwargs.get("request", {}))}
        save_meta(job, pipe)
        events.log(pipe, job.id, "started")
        events.log(pipe, job.id, "progress", job.meta["progress"])
        events.announce(pipe, job.origin, job.id)
        outbox.schedule_started(pipe, job.origin, job)
    for job in jobs:
        pipe.exists(keys.cancel_key(job.id))


def _report_step(jobs: list[Job], timed: tuple[str, str, int, int] | None = None) -> list[bool]:
    # For each job: its hash, cancel key, fence key and event log; its meta and its attempt's token
    # ('' when the writer holds no fence: a plain RQ worker). ``timed``: the line, the worker, the step
    # and the total, for the worker's running entry (step.lua).
    tokens = {fence.job_id: fence.token for fence in fencing.held()}
    job_keys: list[str] = []
    args: list[str | bytes] = [keys.events_channel(jobs[0].origin)]
    for job in jobs:
        job_keys += [job.key, keys.cancel_key(job.id), keys.fence_key(job.id), keys.log_key(job.id)]
        args += [job.serializer.dumps(job.meta), tokens.get(job.id, "")]
    if timed is not None:
        line, worker, step, total = timed
        job_keys.append(keys.running_key(line))
        args += [worker, str(step), str(total)]
    # The script is the fence: no watched transaction around it. One EVALSHA, not in a pipeline
    # (a pipeline asks SCRIPT EXISTS first: a second round trip).
    connection = jobs[0].connection
    client = connection.unfenced if isinstance(connection, fencing.FencedRedis) else connection
    answers = scripts.run(client, "step", job_keys, args)
    stale = [job.id for job, answer in zip(jobs, answers, strict=True) if answer == -1]
    if stale:
        raise fencing.StaleAttemptError(f"a newer attempt took over job(s) {', '.join(stale)}")
    return [bool(answer) for answer in answers]


def report_preview(jobs: list[Job], tokens: list[str], step: int, images: list[str]) -> int:
    """Store each job's preview (a ``data:`` URL) of this step as its latest, and log and announce
    it, each under its attempt's fence token ('' for none); how many were written (a stale
    attempt's are not). Called from the worker's preview thread, off the GPU section."""
    job_keys: list[str] = []
    args: list[str | int] = [keys.events_channel(jobs[0].origin), keys.PREVIEW_TTL_MS, step]
    for job, token, image in zip(jobs, tokens, images, strict=True):
        job_keys += [keys.fence_key(job.id), keys.log_key(job.id), keys.preview_key(job.id)]
        args += [token, image]
    connection = jobs[0].connection
    client = connection.unfenced if isinstance(connection, fencing.FencedRedis) else connection
    return int(scripts.run(client, "preview", job_keys, args))


def latest_preview(job: Job) -> dict[str, Any] | None:
    """A job's latest preview, ``{"step", "image"}`` with the image a ``data:`` URL, while it has one."""
    stored = job.connection.get(keys.preview_key(job.id))
    return json.loads(stored) if stored is not None else None


def fetch_preview(job: Job) -> tuple[bytes, int]:
    """A running job's latest preview as JPEG bytes and its step, or the error that says why there is none."""
    status = job_status(job)
    if not job.kwargs["request"].get("previews"):
        raise NoPreviewError('The job was submitted without "previews": true.')
    if status is not JobStatus.RUNNING:
        raise NoPreviewError(f"The job is {status.value}; a preview exists while it runs.")
    preview = latest_preview(job)
    if preview is None:
        raise NoPreviewError("No preview yet: the first comes after the first step.")
    return base64.b64decode(preview["image"].partition(",")[2]), int(preview["step"])


def steps_run_of(request: dict[str, Any]) -> int | None:
    """The steps a stored request runs, a hires pass's included (its progress's total), or None when
    it is malformed. Read from the fields alone: the limits that validate a request are the
    service's, not known here."""
    first, hires = _first_steps_of(request), request.get("hires")
    if first is None or not hires:
        return first
    steps, denoise = hires.get("steps") or request.get("steps"), hires.get("denoise", 0.5)
    if not isinstance(steps, int) or not isinstance(denoise, int | float):
        return None
    return first + steps_run(steps, denoise)


def _first_steps_of(request: dict[str, Any]) -> int | None:
    """The steps of a stored request's pass at its own size."""
    steps, strength = request.get("steps"), request.get("strength", 0.8)
    if not isinstance(steps, int) or not isinstance(strength, int | float):
        return None
    return steps_run(steps, strength if request.get("image") is not None else None)










def fetch_job(queue: Queue, job_id: str, tenant: Tenant | None = None) -> Job:
    """The job with this id on our queue and of this tenant, or ``JobNotFoundError``."""
    if not keys.JOB_ID_PATTERN.fullmatch(job_id):
        raise JobNotFoundError()
    try:
        job = Job.fetch(job_id, connection=queue.connection, serializer=queue.serializer)
    except NoSuchJobError:
        issued_to = queue.connection.get(keys.issued_key(job_id))
        if issued_to is not None and (tenant is None or text(issued_to) == tenant.name):
            raise ResultExpiredError("The job's record has expired.") from None
        raise JobNotFoundError() from None
    if job.origin != queue.name or job.func_name != keys.TASK:
        raise JobNotFoundError()
    if tenant is not None and job.meta.get("tenant") != tenant.name:
        raise JobNotFoundError()  # another tenant's job looks exactly like an unknown one
    return job


# --- what a client reads of a job now: its place, its estimates, and expiry first --------------


def standing_view(queue: Queue, job: Job) -> JobView:
    """The job's view, with its place and start and finish estimates while it waits or runs."""
    if job_status(job).is_terminal:
        return job_view(job)
    position, estimate, paused = estimates.standing(queue, job)
    view = view_with_eta(job_view(job, position), estimate)
    return view.model_copy(update={"line_paused": True}) if paused else view


def current_view(queue: Queue, settings: Settings, job: Job, tenant: Tenant | None = None) -> JobView:
    """The job's standing view; a waiting job whose deadline has passed is expired first."""
    view = standing_view(queue, job)
    if view.status is JobStatus.QUEUED and view.deadline_at and view.deadline_at <= datetime.now(UTC):
        # Nothing ends a waiting job the moment its deadline passes: the first read past it does.
        waiting.expire_due(queue, settings, waiting.line_of(job))
        view = standing_view(queue, fetch_job(queue, job.id, tenant))
    return view


def admitted_view(job_id: str, request: JobRequest, created_at: datetime, position: int,
                  estimate: tuple[float, float] | None, deadline_at: float | None,
                  line_paused: bool = False) -> JobView:
    """The view of a job just admitted, from its request and what its admission answered: what
    ``job_view`` reads from a waiting job's record, without reading or parsing it back."""
    return JobView(id=job_id, status=JobStatus.QUEUED, model=request.model or waiting.DEFAULT_MODEL_NAME,
                   position=position, eta_s=Eta(start=estimate[0], finish=estimate[1]) if estimate else None,
                   created_at=created_at, request=request, line_paused=line_paused,
                   deadline_at=datetime.fromtimestamp(deadline_at, UTC) if deadline_at is not None else None)


def view_with_eta(view: JobView, estimate: tuple[float, float] | None) -> JobView:
    """The view with these seconds until start and finish; as it is once the job has ended."""
    if estimate is None or view.status.is_terminal:
        return view
    return view.model_copy(update={"eta_s": Eta(start=estimate[0], finish=estimate[1])})
