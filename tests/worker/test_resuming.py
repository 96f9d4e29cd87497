"""worker/resuming.py: a step checkpoint resumes the job it was saved for, and only that job; one that
does not load or does not fit is logged and the job starts at step 0. A whole-pipeline call resumed
from one makes the images of the call never interrupted, with every sampler."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, DPMSolverMultistepScheduler
from PIL import Image, ImageDraw
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from shared.contract import keys
from shared.contract.images import ImageRef
from shared.contract.jobs import JobRequest
from shared.contract.models import TINY_IMAGE_MODELS, family_spec
from shared.contract.settings import Settings
from tests.conftest import (
    app_client,
    drained_and_resumed,
    own_database,
    post_job,
    start_worker,
    wait_for,
    wait_for_status,
)
from worker import resuming
from worker.pipeline import ImagePipeline, load_pipeline
from worker.samplers import Samplers
from worker.stepping import SteppingLoop
from worker.tiny.controlnets import ensure_tiny_controlnets
from worker.tiny.loras import ensure_tiny_loras
from worker.tiny.model import ensure_tiny_model
from worker.whole_calls import resumable

pytestmark = pytest.mark.usefixtures("one_torch_thread")
DRAIN_DATABASE = 23  # the drain test's queue, apart from the other modules'
PREEMPT_DATABASE = 24  # the preemption test's
CONTROLLED = ("tiny", "tiny-sdxl")  # the tiny models with tiny ControlNets
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
    """Each tiny image model loaded as a worker loads it, with its tiny LoRAs and ControlNets."""
    return {model: load_pipeline(Settings(
        model=model, model_name=model, cache_dir=model_cache, device="cpu", torch_threads=1,
        lora_dir=ensure_tiny_loras(model_cache, model),
        controlnet_dir=ensure_tiny_controlnets(model_cache, model) if model in CONTROLLED else None))
        for model in TINY_IMAGE_MODELS}


Images = list[np.ndarray]


class Resumed(NamedTuple):
    whole: Images  # the job's images, run uninterrupted
    resumed: Images  # run again from the state its checkpoint kept
    reported: list[int]  # the steps the resumed call reported
    kept: resuming.Resumption  # that state


def resumed_at(loaded: ImagePipeline, request: JobRequest, step: int,
               inputs: dict[str, Image.Image] | None = None) -> Resumed:
    """A job run whole, then resumed from the state its checkpoint keeps after ``step`` steps."""
    kept: list[resuming.Resumption] = []

    def keep(done: int, latents: torch.Tensor, generators: list[torch.Generator], state: Any) -> None:
        if done == step:
            data = resuming.dump_call("print", done, latents, generators, state)
            kept.append(resuming.load_call(data, "print", request.num_images, type(state).__name__))

    def report(done: int, total: int, latents: torch.Tensor | None) -> None:
        reported.append(done)

    reported: list[int] = []
    (whole,) = loaded.generate_batch([request], inputs=[inputs or {}], checkpoint=keep)
    assert len(kept) == 1, f"no checkpoint at step {step} of {request.steps_run}"
    (resumed,) = loaded.generate_batch([request], report, [inputs or {}], resume=kept[0])
    assert isinstance(whole, list) and isinstance(resumed, list)
    return Resumed([np.asarray(each) for each in whole], [np.asarray(each) for each in resumed], reported,
                   kept[0])


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
    assert resumable(request) and request.not_steppable == ["LoRAs"]
    run = resumed_at(loaded, request, 3)
    assert all(np.array_equal(a, b) for a, b in zip(run.whole, run.resumed, strict=True))
    history = run.kept.sampler.get("model_outputs")
    if isinstance(history, list) and any(isinstance(each, torch.Tensor) for each in history):
        (forgetful,) = loaded.generate_batch([request], resume=dataclasses.replace(run.kept, sampler={}))
        assert isinstance(forgetful, list) and not all(
            np.array_equal(a, np.asarray(b)) for a, b in zip(run.whole, forgetful, strict=True))


def drawing(mode: str = "RGB") -> Image.Image:
    """A 64 px start image (or, as ``L``, a mask repainting its middle)."""
    image = Image.new(mode, (64, 64), (30, 60, 120) if mode == "RGB" else 0)
    ImageDraw.Draw(image).ellipse((12, 12, 52, 52), fill=(230, 190, 40) if mode == "RGB" else 255)
    return image


REFERENCE = {"media_type": "image/png", "width": 64, "height": 64, "bytes": 1, "sha256": "0" * 64}
START, MASK = ImageRef(**REFERENCE), ImageRef(**REFERENCE | {"sha256": "1" * 64})
CONTROL = {"name": "chalk", "image": REFERENCE | {"sha256": "2" * 64}, "start": 0.3, "end": 0.7}
JOBS = [  # model, sampler, what the job asks besides its prompt, the step its checkpoint is taken at
    ("tiny", "dpmpp_2m", {"image": START, "strength": 0.7}, 3),
    ("tiny-sdxl", "euler_a", {"image": START, "strength": 0.6}, 2),
    ("tiny-flux", "flow_euler", {"image": START, "strength": 0.7}, 3),
    ("tiny", "euler_a", {"image": START, "mask": MASK, "strength": 0.9}, 4),
    ("tiny-sdxl", "dpmpp_2m", {"image": START, "mask": MASK}, 3),
    ("tiny-flux", "flow_euler", {"image": START, "mask": MASK}, 5),
    ("tiny", "dpmpp_2m", {"controlnets": [CONTROL]}, 3),
    ("tiny-sdxl", "euler_a", {"controlnets": [CONTROL], "image": START, "strength": 0.8}, 2),
    ("tiny", "dpmpp_2m", {"hires": {"denoise": 0.6}}, 3),  # in the first pass
    ("tiny", "dpmpp_2m", {"hires": {"denoise": 0.6}}, 8),  # the first pass just ended
    ("tiny", "euler_a", {"hires": {"denoise": 0.6, "steps": 10}}, 11),  # in the second
    ("tiny-sdxl", "dpmpp_2m", {"hires": {"upscaler": "lanczos", "scale": 1.5}, "controlnets": [CONTROL]}, 10),
    ("tiny-flux", "flow_euler", {"hires": {"upscaler": "lanczos", "denoise": 0.7}}, 10),
]


@pytest.mark.parametrize(("model", "sampler", "asked", "step"), JOBS,
                         ids=[f"{model}-{'-'.join(asked)}-{step}" for model, _, asked, step in JOBS])
def test_an_image_job_the_loop_does_not_run_resumes_to_its_uninterrupted_images(
        whole_calls: dict[str, ImagePipeline], model: str, sampler: str, asked: dict[str, Any],
        step: int) -> None:
    """Image-to-image, inpainting, a ControlNet acting over part of the steps, a hires pass (resumed in
    its first pass, at its end or in its second): the state a checkpoint keeps, put back into a new
    call, makes exactly the images of the call never interrupted, and the call runs only the steps
    after it."""
    request = JobRequest.model_validate({"prompt": "a lighthouse", "width": 64, "height": 64, "steps": 8,
                                         "seed": 13, "num_images": 2, "guidance_scale": 4.0,
                                         "scheduler": sampler} | asked)
    assert resumable(request) and request.not_steppable
    inputs = {"image": drawing(), "mask": drawing("L"), "control0": drawing()}
    run = resumed_at(whole_calls[model], request, step, inputs)
    assert run.reported[0] == step + 1 and run.reported[-1] == request.steps_run, run.reported
    assert all(np.array_equal(a, b) for a, b in zip(run.whole, run.resumed, strict=True))


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
    with drained_and_resumed(settings, body, tmp_path) as (client, resumed):
        whole = wait_for_status(client, post_job(client, **body).get_json()["id"], "succeeded", "failed",
                                timeout=180)
        assert whole["status"] == "succeeded" and whole.get("resumed_from_step") is None, whole
        assert client.get(resumed["images"][0]).data == client.get(whole["images"][0]).data


def test_a_high_job_preempts_a_hires_job_in_its_second_pass_which_then_resumes_to_its_uninterrupted_image(
        redis_url: str, model_cache: Path, tmp_path: Path) -> None:
    """A normal hires job with a LoRA (a whole-pipeline call) runs its second pass when a high job is
    posted: the high job ends first; the hires job, handed back at a step of its second pass with its
    state saved, resumes there without running its first pass again and makes the PNG it makes
    uninterrupted."""
    settings = Settings(redis_url=own_database(redis_url, PREEMPT_DATABASE), queue_name="whole-call-preempt",
                        cache_dir=model_cache, lora_dir=ensure_tiny_loras(model_cache, "tiny"), drain_s=0,
                        torch_threads=1, max_steps=200, progress_interval_ms=0)
    body = {"prompt": "a lighthouse", "width": 128, "height": 128, "steps": 10, "seed": 4,
            "scheduler": "dpmpp_2m", "loras": [{"name": "moss", "scale": 0.7}],
            "hires": {"scale": 2, "steps": 200, "denoise": 0.5}}  # 10 steps, then 100 at 256 px
    worker = start_worker(settings, tmp_path / "worker.log")
    try:
        with Redis.from_url(settings.redis_url) as redis, contextmanager(app_client)(settings) as client:
            hires_id = post_job(client, **body).get_json()["id"]
            wait_for(lambda: (view := client.get(f"/v1/jobs/{hires_id}").get_json())["progress"]
                     and view["progress"]["step"] >= 12, timeout=120, what="the second pass to run")
            high = post_job(client, prompt="a boat", width=64, height=64, steps=2, seed=5, priority="high")
            high_view = wait_for_status(client, high.get_json()["id"], "succeeded", timeout=120)
            resumed = wait_for_status(client, hires_id, "succeeded", "failed", timeout=180)
            assert resumed["status"] == "succeeded" and high_view["finished_at"] < resumed["finished_at"]
            assert 12 <= resumed["resumed_from_step"] < 110, resumed  # in the second pass
            log = [(entry[b"event"], entry.get(b"data")) for _, entry in redis.xrange(keys.log_key(hires_id))]
            again = [index for index, (event, _) in enumerate(log) if event == b"started"][1]
            steps = [json.loads(data)["step"] for event, data in log[again:] if event == b"progress"]
            assert min(steps[1:]) > resumed["resumed_from_step"], steps  # no first pass again
            whole = wait_for_status(client, post_job(client, **body).get_json()["id"], "succeeded", "failed",
                                    timeout=180)
            assert whole["status"] == "succeeded" and whole.get("resumed_from_step") is None, whole
            assert client.get(resumed["images"][0]).data == client.get(whole["images"][0]).data
    finally:
        assert worker.stop() == 0, worker.output()
