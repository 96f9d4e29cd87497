"""Admission: one script call checks every limit and, only when all pass, puts the job in line.

Limits: the class's share of the line, the tenant's token bucket and waiting cap, an idempotent
replay, a deadline; each refusal is a typed error (shared/contract/errors.py) and writes nothing.
Each model has its own line, capped on its own (SLOTQ_QUEUE_CAPACITY places each, a tenant's waiting
cap in each); a tenant's token bucket and its Idempotency-Keys are the service's, whatever the model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from redis import Redis
from rq import Queue
from rq.job import Job
from rq.utils import utcformat

from shared.contract import keys, logs, webhooks
from shared.contract.errors import (
    IdempotencyConflictError,
    InvalidRequestError,
    NotReplicatedError,
    QueueFullError,
    RateLimitedError,
    TenantQueueFullError,
    UnknownModelError,
)
from shared.contract.images import InputName
from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings
from shared.contract.tenants import Tenant, job_cost
from shared.store import results, scripts
from shared.store.connection import text
from shared.store.records import fetch_job

log = logging.getLogger(__name__)
IDEMPOTENCY_TTL_S = 24 * 3600


@dataclass(frozen=True)
class Admission:
    """The outcome of a submit: the job, its place, and whether an earlier submit made it."""

    job: Job
    position: int | None
    eta: tuple[float, float] | None = None
    replayed: bool = False


def request_digest(request: JobRequest) -> str:
    """A stable hash of a request as the client sent it (before a seed is drawn)."""
    canonical = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def enqueue_job(queue: Queue, settings: Settings, request: JobRequest,
                idempotency_key: str | None = None, tenant: Tenant | None = None,
                request_id: str | None = None, inputs: dict[InputName, bytes] | None = None) -> Admission:
    """Admit one job atomically, replay an idempotent retry, or raise a typed refusal.

    ``inputs`` are the bytes of the request's input images (``request.image`` and ``request.mask``
    are their references): written by the same script (or, to a file store or a bucket, before it
    and deleted again on a refusal), so a refused job leaves none behind.

    With SLOTQ_MIN_REPLICAS_ACK set, either answer stands only once that many replicas have the job.

    ``request_id`` (the HTTP request's X-Request-ID) is kept with the job, for its log lines.
    """
    webhooks.check_target(settings, request)
    request = _for_model(settings, request)
    digest = request_digest(request)
    if tenant is not None:
        request = tenant.prioritised(request)
    cost = job_cost(request.width, request.height, request.steps_run, request.num_images)
    if tenant and tenant.burst is not None and cost > tenant.burst:
        raise InvalidRequestError(details=[{"loc": [], "msg": f"the job costs {cost:g} units, more than "
                                            f"this key's burst of {tenant.burst:g}"}])
    job = _new_job(queue, settings, request, tenant, request_id)
    name, line = tenant.name if tenant else "", settings.line_of(request.model or "")
    # The line, its deadlines and estimates are the model's; buckets and idempotency the service's.
    idem = keys.idempotency_key(queue.name, _hashed(f"{name} {idempotency_key}")) if idempotency_key else ""
    script_keys = [job.key, idem or job.key, keys.deadlines_key(line), keys.issued_key(job.id),
                   keys.bucket_key(queue.name, name), keys.model_key(line),
                   keys.running_key(line), keys.inputs_key(job.id), keys.listed_key(queue.name, name)]
    fields, inputs = _fields(job, request), inputs or {}
    store = results.of(settings)
    # A file store or a bucket gets the inputs before the script admits the job (Redis, inside it).
    store.save_inputs(job.id, {str(name): data for name, data in inputs.items()})
    in_script = inputs if store.in_redis else {}
    params = _parameters(queue, line, settings, job, request, tenant, cost, digest if idem else None,
                         len(fields), list(in_script))
    try:
        answer = scripts.run(queue.connection, "admit", script_keys, [params, *fields, *in_script.values()])
        admission = _admission(queue, job, answer, digest, tenant)
    except BaseException:
        store.drop_inputs(job.id, inputs)  # refused: nothing of it stays behind
        raise
    if admission.replayed:
        store.drop_inputs(job.id, inputs)  # the first job has its own
    if settings.min_replicas_ack:
        _await_replicas(queue.connection, settings, admission.job.id, name)
    log.info("%s job %s: model %s, priority %s, %dx%d, %d steps, prompt %s",
             "replayed" if admission.replayed else "admitted", admission.job.id, request.model,
             request.priority, request.width, request.height, request.steps,
             logs.prompt_for_log(settings, request.prompt))
    return admission


def _for_model(settings: Settings, request: JobRequest) -> JobRequest:
    """The request with its model named (the default where it names none), or ``UnknownModelError``."""
    if request.model is None:
        return request.model_copy(update={"model": settings.default_model})
    if request.model not in settings.offered_models:
        raise UnknownModelError(f"No model named {request.model!r}; this service has "
                                f"{', '.join(settings.offered_models)}.")
    return request


def _new_job(queue: Queue, settings: Settings, request: JobRequest, tenant: Tenant | None,
             request_id: str | None) -> Job:
    """The RQ job for a request, its seed drawn; not yet written anywhere."""
    job = queue.create_job(
        keys.TASK,
        kwargs={"request": request.with_seed().model_dump(mode="json")},
        meta={key: value for key, value in (("tenant", tenant and tenant.name), ("request_id", request_id))
              if value},
        timeout=settings.job_timeout_s,
        result_ttl=settings.record_ttl_s,
        failure_ttl=settings.failure_ttl_s,
    )
    job.enqueued_at = datetime.now(UTC)
    return job


def _parameters(queue: Queue, line: str, settings: Settings, job: Job, request: JobRequest,
                tenant: Tenant | None, cost: float, digest: str | None, fields: int,
                inputs: list[InputName]) -> str:
    """The admission script's parameters, as JSON."""
    limits = ({"rate": tenant.rate, "burst": tenant.burst, "max_queued": tenant.max_queued}
              if tenant else {})
    params = {
        "id": job.id, "queue": line, "job_prefix": Job.redis_job_namespace_prefix,
        "priority": request.priority, "limit": settings.waiting_limit(request.priority),
        "tenant": tenant.name if tenant else "", "cost": cost, "digest": digest,
        "idempotency_ttl": IDEMPOTENCY_TTL_S, "deadline_s": request.deadline_s,
        "ended_at": utcformat(datetime.now(UTC)),
        "record_ttl": settings.record_ttl_s, "issued_ttl": settings.issued_ttl_s,
        "listed_ttl": max(settings.record_ttl_s, settings.failure_ttl_s),
        "channel": keys.events_channel(queue.name), "outbox": keys.webhooks_key(queue.name),
        "ended": keys.ended_key(queue.name), "inputs_ttl": settings.result_ttl_s,
        "fields": fields, "inputs": inputs or None, **limits,
    }
    # cjson reads JSON null as a truthy value: leave unset parameters out instead.
    return json.dumps({key: value for key, value in params.items() if value is not None})


def _fields(job: Job, request: JobRequest) -> list[Any]:
    """The job's hash as the script writes it: RQ's fields, which jobs it may share a GPU execution
    with (worker/batching.py), the adapters it runs with (the claim's affinity), and whether its
    expiry in the line sends a webhook (the Lua cannot read the compressed request)."""
    fields = [item for pair in job.to_dict().items() for item in pair]
    fields += ["batch", request.batch_key, "adapters", request.adapters_key]
    if webhooks.wants(job.kwargs["request"], "completed"):
        fields += ["webhook", "1"]
    return fields


def _admission(queue: Queue, job: Job, answer: list[Any], digest: str, tenant: Tenant | None) -> Admission:
    outcome, detail = answer[0], answer[1] if len(answer) > 1 else None
    refusals = {-1: QueueFullError, -3: RateLimitedError, -4: TenantQueueFullError}
    if outcome in refusals:
        raise refusals[outcome](retry_after=_whole_seconds(detail))
    if outcome == -2:
        prior_digest, prior_id = text(answer[1]).split(" ")
        if prior_digest != digest:
            raise IdempotencyConflictError()
        return Admission(fetch_job(queue, prior_id, tenant), None, replayed=True)
    start, finish, deadline = (answer + [None] * 4)[1:4]
    if deadline is not None:
        job.meta["deadline_at"] = float(deadline)
    eta = (float(start), float(finish)) if start is not None else None
    return Admission(job, int(outcome), eta)


def _await_replicas(connection: Redis, settings: Settings, job_id: str, tenant: str) -> None:
    """Return once SLOTQ_MIN_REPLICAS_ACK replicas hold the job, or raise ``NotReplicatedError``.

    WAIT covers only the writes of the connection it runs on. The pool may lend another one than
    the script's, or a fresh one after a reconnect (WAIT would then have nothing to wait for), and
    a replay writes nothing at all. So a marker write goes first, on the connection that WAITs:
    the job's issued key, rewritten as it is. Replication is one ordered stream, so a replica
    that has the marker has the job; and a master without the key does not have the job.
    """
    with connection.pipeline(transaction=False) as pipe:
        # XX: no key where the job is missing (KEEPTTL would make one that never expires);
        # GET: the old value, None when missing. A pipeline retried after a reconnect sends both
        # again, on one connection.
        pipe.set(keys.issued_key(job_id), tenant, xx=True, keepttl=True, get=True)
        pipe.execute_command("WAIT", settings.min_replicas_ack, settings.replicas_ack_timeout_ms)
        present, acked = pipe.execute()
    if present is None or acked < settings.min_replicas_ack:
        log.warning("job %s: %s", job_id, "not on the master" if present is None else
                    f"{acked} of {settings.min_replicas_ack} replicas acknowledged it in time")
        raise NotReplicatedError(retry_after=1)


def _whole_seconds(seconds: bytes | None) -> int:
    return max(1, math.ceil(float(seconds or 1)))


def _hashed(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()

