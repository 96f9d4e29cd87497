"""worker/resuming.py: a step checkpoint resumes the job it was saved for, and only that job; one that
does not load or does not fit is logged and the job starts at step 0."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import DiffusionPipeline
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from shared.contract.jobs import JobRequest
from worker import resuming
from worker.samplers import Samplers
from worker.stepping import SteppingLoop
from worker.tiny.model import ensure_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
REQUEST = {"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 6, "seed": 5, "num_images": 2,
           "scheduler": "euler_a"}


@pytest.fixture(scope="module")
def loop(cache: Path) -> Iterator[SteppingLoop]:
    pipe = DiffusionPipeline.from_pretrained(ensure_tiny_model(cache, "tiny"), dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    yield SteppingLoop(pipe, Samplers(pipe.scheduler))


def stored_job(redis: Redis, job_id: str, **changes: Any) -> tuple[Job, JobRequest]:
    request = JobRequest.model_validate(REQUEST | changes)
    job = Job.create("worker.tasks.generate", kwargs={"request": request.model_dump(mode="json")},
                     connection=redis, id=job_id, serializer=JSONSerializer)
    return job, request


def saved_at(loop: SteppingLoop, job: Job, request: JobRequest, steps: int) -> bytes:
    """The checkpoint of a job's flights after ``steps`` steps, its flights then out of the loop."""
    flights = loop.admit_all(request)
    for _ in range(steps):
        loop.step()
    data = resuming.dump(resuming.fingerprint(job, type(loop.pipe).__name__),
                         [loop.state_of(flight) for flight in flights])
    for flight in flights:
        loop.cancel(flight)
    return data


def test_a_checkpoint_resumes_each_image_of_its_job(loop: SteppingLoop, redis: Redis) -> None:
    job, request = stored_job(redis, "resumes")
    data = saved_at(loop, job, request, 4)
    flights = resuming.resume(loop, job, request, loop.admit_all(request), (4, data))
    assert [(flight.image, flight.step) for flight in flights] == [(0, 4), (1, 4)]
    for flight in flights:
        loop.cancel(flight)


@pytest.mark.parametrize("fault", ["garbage", "truncated", "another request", "another model"])
def test_a_checkpoint_that_does_not_fit_is_logged_and_the_job_starts_at_step_0(
        loop: SteppingLoop, redis: Redis, fault: str, caplog: pytest.LogCaptureFixture) -> None:
    job, request = stored_job(redis, "starts-over")
    data = saved_at(loop, job, request, 4)
    if fault == "garbage":
        data = b"not a checkpoint at all"
    elif fault == "truncated":
        data = data[: len(data) // 2]
    elif fault == "another request":
        other, other_request = stored_job(redis, "starts-over", prompt="a lighthouse at night")
        data = saved_at(loop, other, other_request, 4)
    else:
        job.kwargs["request"]["model"] = "another"
    with caplog.at_level(logging.WARNING, logger="worker.resuming"):
        flights = resuming.resume(loop, job, request, loop.admit_all(request), (4, data))
    assert [flight.step for flight in flights] == [0, 0] and len(loop.running) == 2
    assert "not one it can resume from" in caplog.text and "starts at step 0" in caplog.text
    for flight in flights:
        loop.cancel(flight)


def test_a_checkpoint_missing_an_image_restarts_them_all(loop: SteppingLoop, redis: Redis) -> None:
    job, request = stored_job(redis, "one-image")
    flights = loop.admit_all(request)
    loop.step()
    data = resuming.dump(resuming.fingerprint(job, type(loop.pipe).__name__), [loop.state_of(flights[0])])
    for flight in flights:
        loop.cancel(flight)
    flights = resuming.resume(loop, job, request, loop.admit_all(request), (1, data))
    assert [flight.step for flight in flights] == [0, 0] and len(loop.running) == 2  # none left behind
    for flight in flights:
        loop.cancel(flight)


def test_a_whole_pipeline_calls_checkpoint_loads_only_for_its_own_job_and_kind() -> None:
    generator = torch.Generator("cpu").manual_seed(3)
    latents = torch.arange(24, dtype=torch.float32).reshape(1, 2, 3, 4)
    data = resuming.dump_call("print-a", 5, latents, [generator])
    loaded = resuming.load_call(data, "print-a", 1)
    assert loaded.step == 5 and torch.equal(loaded.latents, latents)
    assert torch.equal(loaded.generators[0], generator.get_state())
    for bad, why in [(b"not a checkpoint at all", "does not load"), (data, "another request or model"),
                     (resuming.dump("print-a", []), "not a checkpoint of a whole-pipeline call")]:
        with pytest.raises(resuming.CheckpointError, match=why):
            resuming.load_call(bad, "print-b" if why.startswith("another") else "print-a", 1)
    with pytest.raises(resuming.CheckpointError, match="generator states"):
        resuming.load_call(data, "print-a", 2)  # a batch of two images: not this call's
