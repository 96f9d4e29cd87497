"""worker/resuming.py: a step checkpoint resumes the job it was saved for, and only that job; one that
does not load or does not fit is logged and the job starts at step 0. A whole-pipeline call resumed
from one makes the images of the call never interrupted, with every sampler."""

from __future__ import annotations

import dataclasses
import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, DPMSolverMultistepScheduler
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from shared.contract import keys
from shared.contract.jobs import JobRequest
from shared.contract.models import TINY_IMAGE_MODELS, family_spec
from shared.contract.settings import Settings
from tests.conftest import app_client, own_database, post_job, start_worker, wait_for, wait_for_status
from worker import clips, resuming
from worker.pipeline import ImagePipeline, load_pipeline
from worker.samplers import Samplers
from worker.stepping import SteppingLoop
from worker.tiny.loras import ensure_tiny_loras
from worker.tiny.model import ensure_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DRAIN_DATABASE = 23  # the drain test's queue, apart from the other modules'
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
    sampler = DPMSolverMultistepScheduler()
    sampler.set_timesteps(10)
    sampler.model_outputs = [None, torch.ones(2)]  # a past prediction, as after a step
    data = resuming.dump_call("print-a", 5, latents, [generator], sampler)
    loaded = resuming.load_call(data, "print-a", 1, "DPMSolverMultistepScheduler")
    assert loaded.step == 5 and torch.equal(loaded.latents, latents)
    assert torch.equal(loaded.generators[0], generator.get_state())
    assert torch.equal(loaded.sampler["model_outputs"][1], torch.ones(2))
    assert torch.equal(loaded.sampler["timesteps"], sampler.timesteps)
    for bad, why in [(b"not a checkpoint at all", "does not load"), (data, "another request or model"),
                     (resuming.dump("print-a", []), "not a checkpoint of a whole-pipeline call")]:
        with pytest.raises(resuming.CheckpointError, match=why):
            resuming.load_call(bad, "print-b" if why.startswith("another") else "print-a", 1,
                               "DPMSolverMultistepScheduler")
    with pytest.raises(resuming.CheckpointError, match="generator states"):
        resuming.load_call(data, "print-a", 2, "DPMSolverMultistepScheduler")  # two images: not this call's
    with pytest.raises(resuming.CheckpointError, match="than the job.s EulerDiscreteScheduler"):
        resuming.load_call(data, "print-a", 1, "EulerDiscreteScheduler")  # another sampler's state


# --- a whole-pipeline call ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def whole_calls(model_cache: Path) -> dict[str, ImagePipeline]:
    """Each tiny image model loaded as a worker loads it, with its tiny LoRAs."""
    return {model: load_pipeline(Settings(model=model, cache_dir=model_cache, device="cpu", torch_threads=1,
                                          lora_dir=ensure_tiny_loras(model_cache, model)))
            for model in TINY_IMAGE_MODELS}


CALLS = [pytest.param(model, sampler, id=f"{model}-{sampler}") for model, family in TINY_IMAGE_MODELS.items()
         for sampler in family_spec(family).samplers]


@pytest.mark.parametrize(("model", "sampler"), CALLS)
def test_a_one_pass_call_with_a_lora_resumes_to_the_uninterrupted_images_with_every_sampler(
        whole_calls: dict[str, ImagePipeline], model: str, sampler: str) -> None:
    """The state a checkpoint keeps after step 3 of 7 (latents, generators, the sampler's: a multistep
    one's past predictions), put back into a new call: exactly the images of the call never interrupted.
    Not without the sampler's state, where it has one."""
    loaded = whole_calls[model]
    request = JobRequest(prompt="a lighthouse", width=64, height=64, steps=7, seed=11, num_images=2,
                         guidance_scale=4.0, scheduler=sampler, loras=[{"name": "ink", "scale": 0.8}])
    assert clips.resumable(request) and request.not_steppable == ["LoRAs"]
    kept: list[resuming.Resumption] = []

    def keep(step: int, latents: torch.Tensor, generators: list[torch.Generator], state: Any) -> None:
        if step == 3:
            data = resuming.dump_call("print", step, latents, generators, state)
            kept.append(resuming.load_call(data, "print", 2, type(state).__name__))

    (whole,) = loaded.generate_batch([request], checkpoint=keep)
    (resumed,) = loaded.generate_batch([request], resume=kept[0])
    assert isinstance(whole, list) and isinstance(resumed, list)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(whole, resumed, strict=True))
    history = kept[0].sampler.get("model_outputs")
    if isinstance(history, list) and any(isinstance(each, torch.Tensor) for each in history):
        (forgetful,) = loaded.generate_batch([request], resume=dataclasses.replace(kept[0], sampler={}))
        assert isinstance(forgetful, list) and not all(
            np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(whole, forgetful, strict=True))


def test_a_drained_lora_job_keeps_its_step_and_the_next_worker_makes_its_uninterrupted_image(
        redis_url: str, model_cache: Path, tmp_path: Path) -> None:
    """SIGTERM with SLOTQ_STOP_TIMEOUT_S while a job with a LoRA (a whole-pipeline call) runs: it saves
    its state at the step it reached and goes back to its line; the next worker resumes it there and
    makes the PNG the job makes uninterrupted."""
    settings = Settings(redis_url=own_database(redis_url, DRAIN_DATABASE), queue_name="whole-call-drain",
                        cache_dir=model_cache, lora_dir=ensure_tiny_loras(model_cache, "tiny"), drain_s=0,
                        torch_threads=1, stop_timeout_s=0.1, max_steps=200)
    body = {"prompt": "a lighthouse", "width": 256, "height": 256, "steps": 200, "seed": 3,
            "scheduler": "dpmpp_2m", "loras": [{"name": "moss", "scale": 0.7}]}
    first, second = start_worker(settings, tmp_path / "first.log"), None
    try:
        with Redis.from_url(settings.redis_url) as redis, contextmanager(app_client)(settings) as client:
            drained_id = post_job(client, **body).get_json()["id"]
            wait_for(lambda: (view := client.get(f"/v1/jobs/{drained_id}").get_json())["progress"]
                     and view["progress"]["step"] >= 2, timeout=120, what="the job to run")
            first.popen.send_signal(signal.SIGTERM)
            assert first.popen.wait(60) == 0
            saved = int(redis.hget(keys.checkpoint_key(drained_id), "step") or 0)
            assert 2 <= saved < 200 and client.get(f"/v1/jobs/{drained_id}").get_json()["status"] == "queued"
            second = start_worker(settings, tmp_path / "second.log")
            resumed = wait_for_status(client, drained_id, "succeeded", "failed", timeout=180)
            assert resumed["status"] == "succeeded" and resumed["resumed_from_step"] == saved, resumed
            whole = wait_for_status(client, post_job(client, **body).get_json()["id"], "succeeded", "failed",
                                    timeout=180)
            assert whole["status"] == "succeeded" and whole.get("resumed_from_step") is None, whole
            assert client.get(resumed["images"][0]).data == client.get(whole["images"][0]).data
    finally:
        first.stop()
        if second is not None:
            assert second.stop() == 0, second.output()
