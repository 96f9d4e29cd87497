"""worker/stepping.py: flights at different steps share one model call a step, join and leave at step
boundaries, pause and resume, and each makes the image diffusers' own pipeline makes for its seed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline, PNDMScheduler

from shared.contract.jobs import HiresRequest, JobRequest
from shared.contract.models import PIPELINE_CLASSES, Family
from worker import resuming
from worker.samplers import Samplers
from worker.stepping import (
    STEPPABLE,
    FlightState,
    NotSteppableError,
    SteppingError,
    SteppingLoop,
    refusal,
    supports,
)
from worker.tiny.model import ensure_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A flight alone against the pipeline's own call: measured 0.0 on this CPU (float32), every family and
# sampler. In a shared call its rows go through batched kernels, which may sum in another order:
# measured 3e-6 at most here; the bound allows another machine's kernels. A wrong timestep or
# guidance differs by far more: measured by breaking the loop, one timestep for every row 1.5e-3 at
# least, one guidance scale 4e-2, no generator for an ancestral sampler 0.28.
SAME = 1e-5
MODELS = ("tiny", "tiny-sdxl", "tiny-flux")
FAMILIES: dict[str, Family] = {"tiny": "sd", "tiny-sdxl": "sdxl", "tiny-flux": "flux"}
SIDE = 64
# Every model with its own sampler (None) and each sampler the loop runs on its family.
CASES = [(model, sampler) for model in MODELS for sampler in (None, *STEPPABLE[FAMILIES[model]])]


@pytest.fixture(scope="module")
def loaded(cache: Path) -> Iterator[dict[str, tuple[Any, Samplers]]]:
    """Each tiny model's pipeline, loaded as the worker loads one, with its samplers; built lazily."""
    pipes: dict[str, tuple[Any, Samplers]] = {}
    yield pipes
    pipes.clear()


def pipeline(loaded: dict[str, tuple[Any, Samplers]], cache: Path, model: str) -> tuple[Any, Samplers]:
    if model not in loaded:
        pipe = DiffusionPipeline.from_pretrained(ensure_tiny_model(cache, model), dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        loaded[model] = pipe, Samplers(pipe.scheduler)
    return loaded[model]


def job(model: str, sampler: str | None = None, *, steps: int = 4, guidance: float = 6.0, seed: int = 7,
        negative: str | None = None, side: int = SIDE, prompt: str = "a lighthouse on a cliff") -> JobRequest:
    return JobRequest(prompt=prompt, negative_prompt=negative if FAMILIES[model] != "flux" else None,
                      width=side, height=side, steps=steps, guidance_scale=guidance, seed=seed,
                      scheduler=sampler)  # type: ignore[arg-type]


def alone(pipe: Any, samplers: Samplers, request: JobRequest) -> np.ndarray:
    """The image diffusers' own pipeline makes for the request, with its sampler and seed."""
    pipe.scheduler = samplers.get(request.scheduler)
    assert request.seed is not None
    flux = PIPELINE_CLASSES[type(pipe).__name__] == "flux"
    extra = {} if flux else {"negative_prompt": request.negative_prompt}
    return pipe(request.prompt, num_inference_steps=request.steps, guidance_scale=request.guidance_scale,
                generator=torch.Generator("cpu").manual_seed(request.seed), output_type="np",
                width=request.width, height=request.height, **extra).images[0]


def difference(made: np.ndarray, expected: np.ndarray) -> float:
    assert made.shape == expected.shape
    return float(np.abs(made - expected).max())


@contextmanager
def model_calls(pipe: Any) -> Iterator[list[int]]:
    """The rows of each UNet or transformer call made inside."""
    rows: list[int] = []
    model = pipe.unet if hasattr(pipe, "unet") else pipe.transformer

    def count(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        rows.append(len(args[0] if args else kwargs["hidden_states"]))

    handle = model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield rows
    finally:
        handle.remove()


def run_out(loop: SteppingLoop) -> list[list[Any]]:
    """Step until no flight runs; the flights that left at each step."""
    left = []
    while loop.running:
        left.append(loop.step())
    return left


@pytest.mark.parametrize(("model", "sampler"), CASES)
def test_a_flight_alone_makes_the_pipelines_image(loaded: Any, cache: Path, model: str, sampler: str | None
                                                  ) -> None:
    pipe, samplers = pipeline(loaded, cache, model)
    request = job(model, sampler, negative="blurry")
    loop = SteppingLoop(pipe, samplers)
    flight = loop.admit(request)
    with model_calls(pipe) as calls:
        left = run_out(loop)
    assert left[-1] == [flight] and flight.state == FlightState.FINISHED and flight.step == flight.total == 4
    assert calls == [flight.rows] * 4 and flight.rows == (1 if FAMILIES[model] == "flux" else 2)
    (image,) = loop.decode([flight])
    assert image.shape == (SIDE, SIDE, 3) and image.std() > 0.01
    assert difference(image, alone(pipe, samplers, request)) <= SAME


def test_an_empty_negative_prompt_is_none_as_a_lone_jobs_is(loaded: Any, cache: Path) -> None:
    # SDXL makes zeros of no negative prompt but encodes "": the worker passes a lone job's "" as None.
    pipe, samplers = pipeline(loaded, cache, "tiny-sdxl")
    loop = SteppingLoop(pipe, samplers)
    flight = loop.admit(job("tiny-sdxl", negative=""))
    run_out(loop)
    (image,) = loop.decode([flight])
    assert difference(image, alone(pipe, samplers, job("tiny-sdxl"))) <= SAME


@pytest.mark.parametrize(("model", "sampler"), CASES)
def test_a_flight_that_joins_a_running_batch_makes_its_alone_image(loaded: Any, cache: Path, model: str,
                                                                   sampler: str | None) -> None:
    pipe, samplers = pipeline(loaded, cache, model)
    first = job(model, sampler, steps=6, guidance=6.0, seed=11)
    later = job(model, sampler, steps=4, guidance=3.0, seed=12, negative="fog", prompt="a red fox")
    loop = SteppingLoop(pipe, samplers)
    with model_calls(pipe) as calls:
        a = loop.admit(first)
        for _ in range(3):
            assert loop.step() == []
        b = loop.admit(later)  # a at its step 3, b at its step 0: one call for both
        left = run_out(loop)
    assert left == [[], [], [a], [b]]
    both = a.rows + b.rows
    assert calls == [a.rows] * 3 + [both] * 3 + [b.rows]
    made = loop.decode([a, b])
    assert difference(made[0], alone(pipe, samplers, first)) <= SAME
    assert difference(made[1], alone(pipe, samplers, later)) <= SAME


@pytest.mark.parametrize("model", MODELS)
def test_a_short_flight_admitted_later_leaves_before_the_long_one(loaded: Any, cache: Path, model: str
                                                                  ) -> None:
    pipe, samplers = pipeline(loaded, cache, model)
    loop = SteppingLoop(pipe, samplers)
    long = loop.admit(job(model, steps=8, seed=1))
    loop.step()
    short_request = job(model, steps=2, seed=2, guidance=1.0)  # no guidance: one row, beside two
    short = loop.admit(short_request)
    assert loop.step() == [] and loop.step() == [short]
    assert short.state == FlightState.FINISHED and loop.running == [long] and long.step == 3
    (image,) = loop.decode([short])  # while the long one runs on
    assert difference(image, alone(pipe, samplers, short_request)) <= SAME
    assert run_out(loop)[-1] == [long] and long.step == 8


@pytest.mark.parametrize(("model", "sampler"), CASES)
def test_a_paused_flight_resumes_where_it_stopped(loaded: Any, cache: Path, model: str, sampler: str | None
                                                  ) -> None:
    pipe, samplers = pipeline(loaded, cache, model)
    paused_request = job(model, sampler, steps=6, seed=21)
    other_request = job(model, sampler, steps=5, seed=22, guidance=4.0)
    # Offloading on: on a CPU it moves nothing, but what it notes to move back is exercised.
    loop = SteppingLoop(pipe, samplers, offload_paused=True)
    paused, other = loop.admit(paused_request), loop.admit(other_request)
    loop.step(), loop.step()
    loop.pause(paused)
    assert paused.state == FlightState.PAUSED and loop.paused == [paused] and loop.running == [other]
    assert paused.home == loop.device and "timesteps" in paused.offloaded
    with model_calls(pipe) as calls:
        assert run_out(loop)[-1] == [other]  # the other runs its last 3 steps alone
    assert calls == [other.rows] * 3 and paused.step == 2
    loop.resume(paused)
    assert paused.home is None and paused.offloaded == () and loop.paused == []
    assert run_out(loop)[-1] == [paused] and paused.step == 6
    made = loop.decode([paused, other])
    assert difference(made[0], alone(pipe, samplers, paused_request)) <= SAME
    assert difference(made[1], alone(pipe, samplers, other_request)) <= SAME


def test_pausing_is_bounded_and_checks_the_flights_state(loaded: Any, cache: Path) -> None:
    pipe, samplers = pipeline(loaded, cache, "tiny")
    loop = SteppingLoop(pipe, samplers, max_paused=1)
    first, second = loop.admit(job("tiny", seed=1)), loop.admit(job("tiny", seed=2))
    loop.pause(first)
    with pytest.raises(SteppingError, match="1 flights are paused already"):
        loop.pause(second)
    assert loop.running == [second] and second.state == FlightState.RUNNING
    with pytest.raises(SteppingError, match="running, not paused"):
        loop.resume(second)
    with pytest.raises(SteppingError, match="paused, not running"):
        loop.pause(first)
    loop.cancel(first)  # a paused flight can be canceled too
    assert loop.paused == [] and first.state == FlightState.CANCELED


@pytest.mark.parametrize("model", MODELS)
def test_a_canceled_flight_leaves_the_batch_and_the_other_finishes(loaded: Any, cache: Path, model: str
                                                                   ) -> None:
    pipe, samplers = pipeline(loaded, cache, model)
    kept_request = job(model, steps=5, seed=31)
    loop = SteppingLoop(pipe, samplers)
    canceled, kept = loop.admit(job(model, steps=5, seed=32, guidance=2.0)), loop.admit(kept_request)
    loop.step(), loop.step()
    loop.cancel(canceled)
    assert canceled.state == FlightState.CANCELED and loop.running == [kept]
    with model_calls(pipe) as calls:
        assert run_out(loop)[-1] == [kept]
    assert calls == [kept.rows] * 3
    (image,) = loop.decode([kept])
    assert difference(image, alone(pipe, samplers, kept_request)) <= SAME
    with pytest.raises(SteppingError, match="a canceled flight cannot be canceled"):
        loop.cancel(canceled)


@pytest.mark.parametrize("model", MODELS)
def test_flights_of_other_sizes_step_in_their_own_call(loaded: Any, cache: Path, model: str) -> None:
    pipe, samplers = pipeline(loaded, cache, model)
    requests = [job(model, seed=41), job(model, seed=42, side=96), job(model, seed=43, steps=3)]
    loop = SteppingLoop(pipe, samplers)
    flights = [loop.admit(request) for request in requests]
    with model_calls(pipe) as calls:
        loop.step()
    rows = [flight.rows for flight in flights]
    assert sorted(calls) == sorted([rows[0] + rows[2], rows[1]])  # one call a size
    run_out(loop)
    made = loop.decode(flights)
    assert [image.shape for image in made] == [(64, 64, 3), (96, 96, 3), (64, 64, 3)]
    for image, request in zip(made, requests, strict=True):
        assert difference(image, alone(pipe, samplers, request)) <= SAME


def test_a_sampler_or_job_the_loop_cannot_step_is_refused(loaded: Any, cache: Path) -> None:
    pipe, samplers = pipeline(loaded, cache, "tiny")
    loop = SteppingLoop(pipe, samplers)
    assert supports(job("tiny", "euler"), pipe, samplers)
    with pytest.raises(ValueError, match="the request makes 1 images: there is no image 1"):
        loop.admit(job("tiny"), image=1)
    refused = "'flow_euler' is not steppable on sd models; steppable: ddim, euler"
    with pytest.raises(NotSteppableError, match=refused):
        loop.admit(job("tiny", "flow_euler"))
    flux, flux_samplers = pipeline(loaded, cache, "tiny-flux")
    assert refusal(job("tiny-flux", "euler"), flux, flux_samplers) == (
        "the sampler 'euler' is not steppable on flux models; steppable: flow_euler")
    # A model whose own sampler is untested here (SD 1.5's PNDM), for a job that names none.
    plms = Samplers(PNDMScheduler.from_config(pipe.scheduler.config))
    with pytest.raises(NotSteppableError, match="the model's own sampler, PNDMScheduler, is not steppable"):
        SteppingLoop(pipe, plms).admit(job("tiny"))
    assert supports(job("tiny", "ddim"), pipe, plms)  # a named one still is
    special = {"hires": HiresRequest(), "speed": "fast", "prompt_syntax": "weighted"}
    reason = refusal(job("tiny").model_copy(update=special), pipe, samplers)
    assert reason == ("step-level scheduling does not run jobs with a hires pass, weighted prompts, the fast "
                      "tier yet")
    assert loop.running == [] and loop.paused == []  # nothing admitted by a refusal


@pytest.mark.parametrize("model", MODELS)
def test_a_requests_images_admitted_together_are_those_it_makes_one_by_one(loaded: Any, cache: Path,
                                                                          model: str) -> None:
    pipe, samplers = pipeline(loaded, cache, model)
    request = job(model).model_copy(update={"num_images": 2})  # the model's own sampler
    loop = SteppingLoop(pipe, samplers)
    flights = loop.admit_all(request)
    assert [flight.image for flight in flights] == [0, 1]
    run_out(loop)
    together = loop.decode(flights)
    for image, made in enumerate(together):  # image i is seeded seed + i, as ImagePipeline seeds it
        single = SteppingLoop(pipe, samplers)
        flight = single.admit(request, image)
        run_out(single)
        assert difference(made, single.decode([flight])[0]) <= SAME
    assert difference(together[0], together[1]) > 0.01  # two seeds, two images


@pytest.mark.parametrize(("model", "sampler"), CASES)
def test_a_flights_saved_state_in_a_new_loop_makes_the_uninterrupted_image(
        loaded: Any, cache: Path, model: str, sampler: str | None) -> None:
    """A step checkpoint's round trip: the state read out after 3 of 6 steps, saved to bytes and loaded,
    taken by a flight of the same request in a loop of its own, makes the very image the flight that
    was never stopped makes (an ancestral sampler's generator and a multistep one's history with it)."""
    pipe, samplers = pipeline(loaded, cache, model)
    request = job(model, sampler, steps=6, seed=31)
    straight, stopped = SteppingLoop(pipe, samplers), SteppingLoop(pipe, samplers)
    whole, part = straight.admit(request), stopped.admit(request)
    for _ in range(3):
        stopped.step()
    saved = resuming.dump("print", [stopped.state_of(part)])
    stopped.cancel(part)
    again = SteppingLoop(pipe, samplers)
    resumed = again.admit(request)
    again.restore(resumed, resuming.load(saved, "print")[0])
    assert resumed.step == 3
    run_out(straight), run_out(again)
    assert np.array_equal(again.decode([resumed])[0], straight.decode([whole])[0])


def test_a_state_that_does_not_fit_the_flight_is_refused_and_changes_nothing(loaded: Any, cache: Path
                                                                              ) -> None:
    pipe, samplers = pipeline(loaded, cache, "tiny")
    loop = SteppingLoop(pipe, samplers)
    source = loop.admit(job("tiny", "euler", steps=6, seed=3))
    loop.step()
    state = loop.state_of(source)
    larger = loop.admit(job("tiny", "euler", steps=6, seed=3, side=2 * SIDE))
    other_sampler = loop.admit(job("tiny", "ddim", steps=6, seed=3))
    fewer_steps = loop.admit(job("tiny", "euler", steps=3, seed=3))
    same = loop.admit(job("tiny", "euler", steps=6, seed=3))
    for flight, saved, why in ((larger, state, "shape"), (other_sampler, state, "another sampler"),
                               (fewer_steps, state, "sampler attributes"),
                               (same, state | {"step": 6}, "step"),
                               (same, state | {"generator": None}, "generator")):
        latents = flight.latents.clone()
        with pytest.raises(ValueError, match=why):
            loop.restore(flight, saved)
        assert flight.step == 0 and torch.equal(flight.latents, latents)
    loop.step()
    with pytest.raises(ValueError, match="step 0"):
        loop.restore(source, state)
