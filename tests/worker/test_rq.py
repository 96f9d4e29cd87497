"""worker/rq.py: the one adapter for RQ's private API still fits the installed RQ."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable
from importlib.metadata import version

import pytest
from packaging.requirements import Requirement
from packaging.version import Version
from redis import Redis
from rq.executions import Execution
from rq.job import Job

from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings
from shared.store.connection import job_queue
from shared.store.fencing import connect_worker
from worker.rq import RQWorker, check_rq

Written = tuple[str, str, str, tuple[str, ...]]  # a key, its type, whether it expires, its members


def test_the_installed_rq_is_in_the_range_pyproject_names() -> None:
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    (wanted,) = [Requirement(line) for line in project["dependencies"] if line.startswith("rq")]
    installed = Version(version("rq"))
    assert installed in wanted.specifier, f"RQ {installed} is outside pyproject's {wanted}"


def test_rq_still_has_the_private_api_the_worker_uses() -> None:
    # Fails with a message naming what RQ changed (a method gone, its parameters, a key name).
    check_rq()


@pytest.mark.parametrize("request_body", [
    {"prompt": "a fox"},
    {"prompt": "ü" * 300, "negative_prompt": "blur", "width": 128, "height": 64, "steps": 3, "num_images": 2,
     "priority": "high", "deadline_s": 30, "webhook": "https://example.com/hook"},
])
def test_admission_writes_the_hash_rq_itself_would(settings: Settings, redis: Redis,
                                                    request_body: dict[str, object]) -> None:
    # Admission builds a job's hash without rq.Job (a quarter of its own work): it must be the
    # hash Job.create and Job.save write for the same job, so that RQ and its tools read it alike.
    from rq.job import Job

    from shared.store import admission
    from shared.store.connection import job_queue

    queue = job_queue(redis, settings)
    request = JobRequest.model_validate({"model": settings.default_model, **request_body})
    record = admission.new_record(queue, settings, request, {"request_id": "r-1", "tenant": "web"})
    job = queue.create_job("worker.tasks.generate", kwargs={"request": record.stored}, job_id=record.id,
                           meta={"request_id": "r-1", "tenant": "web"}, timeout=settings.job_timeout_s,
                           result_ttl=settings.record_ttl_s, failure_ttl=settings.failure_ttl_s)
    job.created_at = job.enqueued_at = record.created_at
    expected = {key: value.value if key == "status" else value for key, value in job.to_dict().items()}
    # The data is compressed with a smaller window than RQ's, and its JSON is written without
    # spaces (by pydantic): the same call once decompressed and read.
    ours = dict(record.fields)
    assert json.loads(zlib.decompress(ours.pop("data"))) == json.loads(zlib.decompress(expected.pop("data")))
    assert ours == expected
    assert record.stored["seed"] is not None and record.stored["seed"] == record.request.seed
    redis.hset(job.key, mapping=record.fields)
    loaded = Job.fetch(record.id, connection=queue.connection, serializer=queue.serializer)
    assert loaded.kwargs == {"request": record.stored}
    assert loaded.meta == {"request_id": "r-1", "tenant": "web"}
    assert loaded.get_status() == "queued" and loaded.origin == queue.name


def rq_writes(settings: Settings, name: str, act: Callable[[RQWorker, Job], None]) -> set[Written]:
    """Each key that names a new worker ``name`` or its job, or holds a member that does, once
    ``act(worker, job)`` ran on a job just enqueued; names, ids, times and scores made alike."""
    connection = connect_worker(settings)
    try:
        queue = job_queue(connection, settings)
        job = queue.enqueue("worker.tasks.generate", kwargs={"request": {}}, job_id=f"{name}-job")
        worker = RQWorker(queue, settings, name)
        worker.register_birth()
        act(worker, job)

        def normal(text: bytes) -> str:
            value = text.decode(errors="replace").replace(name, "<worker>")
            value = re.sub(r"\d{4}-\d\d-\d\dT[\d:.]+Z?|\b\d{10}\.\d+\b|\b\d{13}-\d+\b", "<time>", value)
            value = re.sub(r"ip_address=\S+", "ip_address=<client>", value)  # a connection each
            value = re.sub(r"total_working_time=\S+", "total_working_time=<seconds>", value)
            return re.sub(r"[0-9a-f]{32}", "<execution>", value)

        def hash_items(key: bytes) -> list[bytes]:  # each field with its value
            return [field + b"=" + value for field, value in connection.hgetall(key).items()]

        def stream_items(key: bytes) -> list[bytes]:  # each entry's fields with their values
            return [b";".join(f + b"=" + v for f, v in sorted(fields.items()))
                    for _, fields in connection.xrange(key)]

        found = set()
        for key in connection.keys("*"):
            kind = connection.type(key).decode()
            members = {"hash": hash_items, "zset": lambda k: connection.zrange(k, 0, -1),
                       "set": connection.smembers, "stream": stream_items}.get(kind, lambda k: [])(key)
            ours = [member for member in members if name.encode() in member or name.encode() in key]
            if name.encode() in key or ours:
                ttl = "expires" if connection.ttl(key) > 0 else "kept"
                found.add((normal(key), kind, ttl, tuple(sorted(normal(member) for member in ours))))
        return found
    finally:
        connection.close()


def rq_starts(worker: RQWorker, job: Job) -> Execution:
    """RQ's own start bookkeeping: its prepare_execution and prepare_job_execution."""
    execution = worker.prepare_execution(job)
    worker.prepare_job_execution(job)
    return execution


def test_the_worker_starts_a_job_as_rq_s_own_start_bookkeeping_would(settings: Settings) -> None:
    # RQWorker.start writes in one transaction what RQ's prepare_execution and
    # prepare_job_execution write in two: the same keys, fields and registry entries.
    def in_one(worker: RQWorker, job: Job) -> None:
        with worker.connection.pipeline() as pipe:
            worker.start([job], pipe)
            pipe.execute()

    theirs, ours = rq_writes(settings, "theirs", rq_starts), rq_writes(settings, "ours", in_one)
    assert ours == theirs
    assert any("<worker>-job" in key for key, _, _, _ in ours)  # the job's hash was among them


def test_the_worker_ends_a_job_as_rq_s_own_success_path_would(settings: Settings) -> None:
    # RQWorker.succeed queues on the caller's pipeline (one transaction for a whole batch) what RQ's
    # _finalize_success writes with a WATCH and two round trips of its own: the same keys, fields,
    # expiries, results and registry entries.
    result = {"images": 1, "seed": 7}

    def rq_own(worker: RQWorker, job: Job) -> None:
        worker.record_success(job, rq_starts(worker, job), result)

    def queued(worker: RQWorker, job: Job) -> None:
        execution = rq_starts(worker, job)
        with worker.connection.pipeline() as pipe:
            worker.succeed(job, execution, result, pipe)
            pipe.execute()
        worker.succeeded(job)

    theirs, ours = rq_writes(settings, "theirs", rq_own), rq_writes(settings, "ours", queued)
    assert ours == theirs
    assert any(kind == "stream" for _, kind, _, _ in ours)  # RQ's result of the job was among them
    assert ("rq:job:<worker>-job", "hash", "expires") in {found[:3] for found in ours}
