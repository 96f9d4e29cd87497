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
import zlib
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

from redis import Redis
from rq import Queue
from rq.job import Job
from rq.job import JobStatus as RQStatus
from rq.serializers import JSONSerializer
from rq.utils import get_call_string

from shared.contract import keys, logs, webhooks
from shared.contract.errors import (
    DeadlineUnmeetableError,
    IdempotencyConflictError,
    InvalidRequestError,
    NotReplicatedError,
    QueueFullError,
    RateLimitedError,
    TenantQueueFullError,
    UnknownModelError,
)
from shared.contract.images import InputName
from shared.contract.jobs import JobRequest, Priority
from shared.contract.settings import Settings
from shared.contract.tenants import Tenant
from shared.store import autopipeline, results
from shared.store.connection import text
from shared.store.records import fetch_job

log = logging.getLogger(__name__)
IDEMPOTENCY_TTL_S = 24 * 3600
RQ_DESCRIPTION_LENGTH = 75  # Job.get_call_string's: longer argument reprs are cut
TASK = keys.TASK.encode()


@dataclass(frozen=True)
class Record:
    """A job not yet written: its id, its request with the seed drawn (and as stored), when, and its
    RQ hash."""

    id: str
    request: JobRequest
    stored: dict[str, Any]
    created_at: datetime
    fields: dict[str, Any]


@dataclass(frozen=True)
class Admission:
    """A submit's outcome: the job admitted now (its record, place, estimates and deadline), or the
    earlier job that an idempotent retry replays (``prior``, ``replayed``). A job admitted now that
    has already left the line when its answer came (a call sent again, the admission script's
    ``-5``) has its record and, as ``prior``, where it stands."""

    job_id: str
    record: Record | None = None
    position: int | None = None
    eta: tuple[float, float] | None = None
    deadline_at: float | None = None
    prior: Job | None = None
    replayed: bool = False  # an earlier submit with this Idempotency-Key made the job
    line_paused: bool = False  # its model's line is paused: admitted, it starts once resumed


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
    # The digest tells a replay from a conflicting reuse of the key: only a keyed submit needs one.
    digest = request_digest(request) if idempotency_key else None
    if tenant is not None:
        request = tenant.prioritised(request)
    cost = request.cost
    if tenant and tenant.burst is not None and cost > tenant.burst:
        raise InvalidRequestError(details=[{"loc": [], "msg": f"the job costs {cost:g} units, more than "
                                            f"this key's burst of {tenant.burst:g}"}])
    meta = {key: value for key, value in (("tenant", tenant and tenant.name), ("request_id", request_id))
            if value}
    record = new_record(queue, settings, request, meta)
    job_key = Job.key_for(record.id)
    name, line = tenant.name if tenant else "", settings.line_of(request.model or "")
    # The line, its deadlines and estimates are the model's; buckets and idempotency the service's.
    idem = keys.idempotency_key(queue.name, _hashed(f"{name} {idempotency_key}")) if idempotency_key else ""
    script_keys = [job_key, idem or job_key, keys.deadlines_key(line), keys.issued_key(record.id),
                   keys.bucket_key(queue.name, name), keys.model_key(line),
                   keys.running_key(line), keys.inputs_key(record.id), keys.listed_key(queue.name, name)]
    fields, inputs = _fields(record, request), inputs or {}
    store = results.of(settings)
    # A file store or a bucket gets the inputs before the script admits the job (Redis, inside it).
    store.save_inputs(record.id, {str(name): data for name, data in inputs.items()})
    in_script = inputs if store.in_redis else {}
    params = _parameters(line, settings, record, request, tenant, cost, digest, len(fields), list(in_script))
    try:
        # Shares its round trip with the admissions that other requests of this process make now.
        answer = autopipeline.of(queue.connection).run("admit", script_keys,
                                                       [params, *fields, *in_script.values()])
        admission = _admission(queue, record, answer, digest, tenant)
    except BaseException:
        store.drop_inputs(record.id, inputs)  # refused: nothing of it stays behind
        raise
    if admission.replayed:
        store.drop_inputs(record.id, inputs)  # the first job has its own
    if settings.min_replicas_ack:
        _await_replicas(queue.connection, settings, admission.job_id, name)
    return admission


def describe(settings: Settings, admission: Admission, submitted: JobRequest) -> str:
    """What a log line says of a submit: the job admitted (as admitted: its model, its priority) or
    replayed, and what it asks for. The API writes it on the request's own line: one line an
    admission, not two (each line is a formatted record and a write: two were a sixteenth of an
    admission's CPU under load)."""
    request = admission.record.request if admission.record else submitted
    return (f"{'replayed' if admission.replayed else 'admitted'} job {admission.job_id}: model "
            f"{request.model or settings.default_model}, priority {request.priority}, "
            f"{request.width}x{request.height}, {request.steps} steps, "
            f"prompt {logs.prompt_for_log(settings, request.prompt)}")


def _for_model(settings: Settings, request: JobRequest) -> JobRequest:
    """The request with its model named (the default where it names none), or ``UnknownModelError``."""
    if request.model is None:
        return request.model_copy(update={"model": settings.default_model})
    if request.model not in settings.offered_models:
        raise UnknownModelError(f"No model named {request.model!r}; this service has "
                                f"{', '.join(settings.offered_models)}.")
    return request


def new_record(queue: Queue, settings: Settings, request: JobRequest, meta: dict[str, Any]) -> Record:
    """A new job's RQ hash, its seed drawn, built the way ``Job.create`` and ``Job.to_dict`` build it
    (tests/worker/test_rq.py checks the two agree) without their cost: building and saving an ``rq.Job`` is a
    large share of an admission's own work."""
    seeded = request.with_seed()
    kwargs = {"request": seeded.model_dump(mode="json")}
    now = datetime.now(UTC)
    at = now.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"  # utcformat's, without strftime
    fields = {
        "created_at": at,
        # The call as RQ's JSONSerializer reads it back; pydantic writes the request's JSON itself,
        # quicker than json.dumps of its dump.
        "data": _compressed(b'["%s",null,[],{"request":%s}]' % (TASK, seeded.model_dump_json().encode())),
        "success_callback_name": "", "failure_callback_name": "", "stopped_callback_name": "",
        "started_at": "", "ended_at": "", "last_heartbeat": "", "worker_name": "", "group_id": "",
        "origin": queue.name,
        "description": get_call_string(keys.TASK, (), kwargs, max_length=RQ_DESCRIPTION_LENGTH),
        "enqueued_at": at,
        "timeout": settings.job_timeout_of(seeded.model),
        "result_ttl": settings.record_ttl_s,
        "failure_ttl": settings.failure_ttl_s,
        "status": RQStatus.QUEUED.value,
    }
    if meta:
        fields["meta"] = JSONSerializer.dumps(meta)
    return Record(str(uuid4()), seeded, kwargs["request"], now, fields)


def _compressed(data: bytes) -> bytes:
    """A zlib stream, as RQ stores a job's data (it reads any back), of stored blocks: a job's data is
    a few hundred bytes, and setting zlib up to compress them costs more than compressing saves."""
    compressor = zlib.compressobj(0, zlib.DEFLATED, 9, 1)  # level 0, a 512-byte window: quick to set up
    return compressor.compress(data) + compressor.flush()


def _parameters(line: str, settings: Settings, record: Record, request: JobRequest, tenant: Tenant | None,
                cost: float, digest: str | None, fields: int, inputs: list[InputName]) -> str:
    """The admission script's parameters, as JSON: the line's and class's, written once, then the job's."""
    params = {
        "id": record.id, "tenant": tenant.name if tenant else "", "cost": cost,
        # What a job that expires in this call's sweep is stamped with: the admission's time.
        "deadline_s": request.deadline_s, "ended_at": record.fields["created_at"],
        "digest": digest, "fields": fields, "inputs": inputs or None,
    }
    if tenant:
        params |= {"rate": tenant.rate, "burst": tenant.burst, "max_queued": tenant.max_queued}
    # cjson reads JSON null as a truthy value: leave unset parameters out instead.
    job = json.dumps({key: value for key, value in params.items() if value is not None})
    return f"{{{_line_parameters(settings, line, request.priority)}, {job[1:]}"


# The parameters every admission to a line and class shares, per settings (kept with them, so an id
# is never reused while its entry stands; see results.of): the members of a JSON object, without
# its braces.
_shared: dict[tuple[int, str, str], tuple[Settings, str]] = {}


def _line_parameters(settings: Settings, line: str, priority: Priority) -> str:
    """The parameters every admission to this line and class shares, written once."""
    made = _shared.get((id(settings), line, priority))
    if made is None or made[0] is not settings:
        queue = settings.queue_name
        made = _shared[id(settings), line, priority] = (settings, json.dumps({
            "queue": line, "job_prefix": Job.redis_job_namespace_prefix, "priority": priority,
            "limit": settings.waiting_limit(priority), "idempotency_ttl": IDEMPOTENCY_TTL_S,
            "record_ttl": settings.record_ttl_s, "issued_ttl": settings.issued_ttl_s,
            "listed_ttl": max(settings.record_ttl_s, settings.failure_ttl_s),
            "channel": keys.events_channel(queue), "outbox": keys.webhooks_key(queue),
            "ended": keys.ended_key(queue), "inputs_ttl": settings.result_ttl_s,
        })[1:-1])
    return made[1]


def _fields(record: Record, request: JobRequest) -> list[Any]:
    """The job's hash as the script writes it: RQ's fields, which jobs it may share a GPU execution
    with (worker/batching.py) or join at a step (worker/joining.py), the adapters it runs with (the
    claim's affinity), and whether its expiry in the line sends a webhook (the Lua cannot read the
    compressed request)."""
    fields = [item for pair in record.fields.items() for item in pair]
    fields += ["batch", request.batch_key, "join", request.join_key, "adapters", request.affinity_key]
    if webhooks.wants(record.stored, "completed"):
        fields += ["webhook", "1"]
    return fields


def _admission(queue: Queue, record: Record, answer: list[Any], digest: str | None,
               tenant: Tenant | None) -> Admission:
    outcome, detail = answer[0], answer[1] if len(answer) > 1 else None
    refusals = {-1: QueueFullError, -3: RateLimitedError, -4: TenantQueueFullError,
                -6: DeadlineUnmeetableError}
    if outcome in refusals:
        raise refusals[outcome](retry_after=_whole_seconds(detail))
    if outcome == -5:  # admitted by this call's first sending, and taken from the line since
        return Admission(record.id, record, prior=fetch_job(queue, record.id, tenant))
    if outcome == -2:
        prior_digest, prior_id = text(answer[1]).split(" ")
        if prior_digest != digest:
            raise IdempotencyConflictError()
        return Admission(prior_id, prior=fetch_job(queue, prior_id, tenant), replayed=True)
    start, finish, deadline, paused = (answer + [None] * 5)[1:5]
    eta = (float(start), float(finish)) if start is not None else None
    return Admission(record.id, record, int(outcome), eta, float(deadline) if deadline is not None else None,
                     line_paused=paused == 1)


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

