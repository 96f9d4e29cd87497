"""A video model's jobs in the contract: frames and fps checked against the model, clip costs and
batch keys counting frames, and what an image model or a video model refuses."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from shared.contract.errors import InvalidRequestError, TooLargeForWorkersError
from shared.contract.jobs import JobRequest, Submission, job_cost, validate_submission
from shared.contract.models import model_info


def submit(body: dict[str, Any], family: str = "wan", capacity: int | None = None) -> Submission:
    model = model_info("m", family, capacity_pixels=capacity)  # type: ignore[arg-type]
    return validate_submission({"prompt": "a fox"} | body, max_side=1024, max_steps=100,
                               max_image_bytes=2**20, model=model)


def refused_at(body: dict[str, Any], family: str = "wan") -> list[Any]:
    with pytest.raises((InvalidRequestError, ValidationError)) as refusal:
        submit(body, family)
    error = refusal.value
    details = error.errors() if isinstance(error, ValidationError) else error.details
    return [list(detail["loc"]) for detail in details]


def test_a_video_job_gets_its_models_default_clip_and_counts_its_frames() -> None:
    request = submit({}).request
    assert (request.frames, request.fps, request.width, request.height) == (81, 16, 832, 480)
    assert request.is_video and request.pictures == 81 and request.not_steppable == ["a clip"]
    assert request.cost == job_cost(832, 480, 50, 81)
    assert JobRequest.pixels_of_batch_key(request.batch_key) == 832 * 480 * 81


def test_clips_batch_only_with_clips_of_the_same_frames_and_rate() -> None:
    key = submit({"frames": 9, "fps": 8, "width": 64, "height": 64}).request.batch_key
    assert submit({"frames": 9, "fps": 8, "width": 64, "height": 64, "seed": 3}).request.batch_key == key
    assert submit({"frames": 13, "fps": 8, "width": 64, "height": 64}).request.batch_key != key
    assert submit({"frames": 9, "fps": 12, "width": 64, "height": 64}).request.batch_key != key


@pytest.mark.parametrize(("family", "frames"), [("wan", 8), ("wan", 1), ("ltx", 13), ("ltx", 265)])
def test_frames_off_the_models_multiple_or_past_the_most_are_refused_at_frames(family: str,
                                                                               frames: int) -> None:
    assert refused_at({"frames": frames}, family) == [["frames"]]


def test_an_image_model_refuses_frames_and_fps() -> None:
    assert refused_at({"frames": 9, "fps": 8}, "sd") == [["frames"], ["fps"]]
    assert submit({}, "sd").request.frames is None


@pytest.mark.parametrize(("body", "loc"), [
    ({"num_images": 2}, ["num_images"]), ({"speed": "fast"}, ["speed"]),
    ({"hires": {"scale": 2.0}, "width": 64, "height": 64}, ["hires"]),
    ({"prompt_syntax": "weighted"}, ["prompt_syntax"]),
    ({"steps": 1, "frames": 9}, ["steps"])])
def test_what_a_video_family_cannot_do_is_refused_at_its_field(body: dict[str, Any], loc: list[str]) -> None:
    assert refused_at(body, "ltx") == [loc]


def test_a_clip_larger_than_the_workers_run_is_refused_with_the_frames_that_fit() -> None:
    with pytest.raises(TooLargeForWorkersError, match="at most 40960 pixels a job: 10 frames at this size"):
        submit({"width": 64, "height": 64, "frames": 13}, capacity=64 * 64 * 10)
    assert submit({"width": 64, "height": 64, "frames": 9}, capacity=64 * 64 * 10).request.frames == 9


def test_the_document_offers_clips_on_the_models_multiple_and_an_image_service_none() -> None:
    from api.openapi import openapi_document
    from shared.contract.settings import Settings

    video = openapi_document(Settings(model="tiny-wan", max_frames=17))["components"]["schemas"]["JobRequest"]
    assert video["properties"]["frames"]["anyOf"] == [{"type": "integer", "enum": [5, 9, 13, 17]}]
    assert video["properties"]["frames"]["default"] == 17  # the family's 81, within SLOTQ_MAX_FRAMES
    assert video["properties"]["num_images"]["const"] == 1
    assert video["properties"]["prompt_syntax"]["enum"] == ["plain"]
    image = openapi_document(Settings(model="tiny"))["components"]["schemas"]["JobRequest"]
    assert image["properties"]["frames"]["type"] == "null" and image["properties"]["fps"]["type"] == "null"


def test_a_video_models_jobs_get_their_familys_longer_timeout_unless_the_setting_is_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from shared.contract.settings import Settings
    from slotq.harness import slotq_env

    assert Settings(model="tiny-wan").job_timeout_of(None) == 3600
    assert Settings(model="tiny").job_timeout_of(None) == 900
    assert Settings(model="tiny-wan", job_timeout_s=120).job_timeout_of(None) == 120
    monkeypatch.setenv("SLOTQ_JOB_TIMEOUT_S", "300")
    assert Settings(model="tiny-wan").job_timeout_of(None) == 300
    # The harness hands a child process the setting only where it was given.
    monkeypatch.delenv("SLOTQ_JOB_TIMEOUT_S")
    assert "SLOTQ_JOB_TIMEOUT_S" not in slotq_env(Settings(model="tiny-wan"))
    assert slotq_env(Settings(model="tiny-wan", job_timeout_s=120))["SLOTQ_JOB_TIMEOUT_S"] == "120"
