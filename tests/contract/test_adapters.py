"""LoRA adapters: the names the service has (shared/contract/adapters.py), their refusal at the door,
and a real worker (worker/adapters.py) running jobs with them on the tiny model's tiny adapters."""

from __future__ import annotations

import io
import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image
from redis import Redis

from shared.contract.adapters import available_adapters
from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings
from tests.conftest import (
    Process,
    app_client,
    data_url,
    own_database,
    post_job,
    running_worker,
    start_image,
    wait_for,
    wait_for_status,
)

DATABASE = 7  # 0 per test, 1 the worker, 2 batching and fuzz, 3 schemathesis, 5 families, 6 webhooks


@pytest.fixture(scope="module")
def lora_dir(model_cache: Path) -> Path:
    from worker.tiny.loras import ensure_tiny_loras

    return ensure_tiny_loras(model_cache)


def names(**changes: object) -> list[dict[str, object]]:
    return [{"name": name, "scale": scale} for name, scale in changes.items()]


# --- the names, and the door (no worker) -------------------------------------------------------------

def test_the_names_are_the_file_stems_and_follow_the_folder(tmp_path: Path, lora_dir: Path) -> None:
    assert available_adapters(lora_dir) == ["ink", "moss", "neon"]
    folder = tmp_path / "loras"
    folder.mkdir()
    assert available_adapters(folder) == [] and available_adapters(None) == []
    assert available_adapters(tmp_path / "absent") == []
    shutil.copy(lora_dir / "ink.safetensors", folder / "ink.safetensors")
    (folder / "notes.txt").write_text("not an adapter")
    (folder / "has space.safetensors").write_bytes(b"")  # no job could name it
    assert available_adapters(folder) == ["ink"]
    shutil.copy(lora_dir / "moss.safetensors", folder / "style_2.safetensors")
    assert available_adapters(folder) == ["ink", "style_2"]  # read again: the folder changed


def test_an_entry_that_is_no_regular_file_is_not_offered_and_said_once(
        tmp_path: Path, lora_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "loras"
    folder.mkdir()
    shutil.copy(lora_dir / "ink.safetensors", folder / "ink.safetensors")
    (folder / "dir.safetensors").mkdir()  # a FIFO of that name would block the worker that opened it
    with caplog.at_level(logging.WARNING, "shared.contract.adapters"):
        assert available_adapters(folder) == available_adapters(folder) == ["ink"]
    assert [record.getMessage() for record in caplog.records] == [
        f"SLOTQ_LORA_DIR: not offered: {folder / 'dir.safetensors'}: not a regular file"]


@pytest.fixture
def adapter_client(settings: Settings, lora_dir: Path) -> Iterator[FlaskClient]:
    yield from app_client(settings.model_copy(update={"lora_dir": lora_dir}))


def test_an_unknown_adapter_is_refused_at_the_door_with_nothing_stored(adapter_client: FlaskClient,
                                                                       redis: Redis) -> None:
    response = post_job(adapter_client, loras=names(ink=1.0, ghost=0.5))
    body = response.get_json()
    assert response.status_code == 422 and body["error"]["code"] == "unknown_lora", body
    assert "ghost" in body["error"]["message"] and "ink, moss, neon" in body["error"]["message"]
    assert redis.keys("*") == []


@pytest.mark.parametrize("loras", [
    names(ink=1.0, neon=1.0, moss=1.0, a=1.0, b=1.0),  # five: at most four
    [{"name": "ink"}, {"name": "ink", "scale": 0.5}],  # one twice
    names(ink=2.5),  # scale within [-2, 2]
    [{"name": "../ink"}],  # a name, not a path
    [{"name": "ink", "weight": 1}],  # a misspelt field
    "ink",
])
def test_a_malformed_list_is_invalid(adapter_client: FlaskClient, redis: Redis, loras: object) -> None:
    response = post_job(adapter_client, loras=loras)
    assert response.status_code == 422 and response.get_json()["error"]["code"] == "invalid_request"
    assert redis.keys("*") == []


def test_a_job_with_adapters_is_admitted_and_shows_them(adapter_client: FlaskClient) -> None:
    view = post_job(adapter_client, loras=names(neon=-0.5, ink=1.25), width=64, height=64).get_json()
    assert view["status"] == "queued"
    assert view["request"]["loras"] == [{"name": "neon", "scale": -0.5}, {"name": "ink", "scale": 1.25}]
    assert post_job(adapter_client).get_json()["request"]["loras"] == []
    (model,) = adapter_client.get("/v1/models").get_json()["models"]
    assert model["loras"] == ["ink", "moss", "neon"] and model["workers"] == 0  # known without a worker


def test_adapters_and_their_scales_separate_batches() -> None:
    def key(**changes: float) -> str:
        return JobRequest(prompt="a", width=64, height=64, loras=names(**changes)).batch_key

    assert key() != key(ink=1.0) != key(ink=0.5)
    reordered = JobRequest(prompt="b", width=64, height=64, loras=names(neon=0.5, ink=1.0))
    assert key(ink=1.0, neon=0.5) == reordered.batch_key  # the order they are named in is no matter
    assert JobRequest.pixels_of_batch_key(key(ink=1.0, neon=0.5)) == 64 * 64


# --- a real worker with two adapters resident at most ----------------------------------------------

@pytest.fixture(scope="module")
def lora_settings(redis_url: str, model_cache: Path, lora_dir: Path) -> Settings:
    url = own_database(redis_url, DATABASE)
    return Settings(redis_url=url, queue_name="lora-tests", queue_capacity=50, cache_dir=model_cache,
                    lora_dir=lora_dir, lora_cache=2, drain_s=0)


@pytest.fixture(scope="module")
def lora_worker(lora_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(lora_settings, tmp_path_factory, "loras")


@pytest.fixture
def lora_client(lora_worker: Process, lora_settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(lora_settings)


def pixels(client: FlaskClient, **body: object) -> np.ndarray:
    """The first image of a job that must succeed, as an array."""
    response = post_job(client, width=64, height=64, steps=3, seed=11, **body)
    assert response.status_code == 202, response.get_json()
    view = wait_for_status(client, response.get_json()["id"], "succeeded", "failed")
    assert view["status"] == "succeeded", view
    return np.asarray(Image.open(io.BytesIO(client.get(view["images"][0]).data)), dtype=np.int16)


def test_an_adapter_changes_the_image_and_at_scale_0_is_the_bare_model(lora_client: FlaskClient) -> None:
    bare = pixels(lora_client)
    ink = pixels(lora_client, loras=names(ink=1.0))
    assert np.abs(ink - bare).mean() > 5  # visibly another image
    assert np.array_equal(pixels(lora_client, loras=names(ink=0.0)), bare)
    assert np.array_equal(pixels(lora_client), bare)  # an adapter left resident changes no later job
    half = pixels(lora_client, loras=names(ink=0.5))
    assert not np.array_equal(half, ink) and not np.array_equal(half, bare)


def test_evicted_adapters_load_again_to_the_same_image(lora_client: FlaskClient,
                                                       lora_worker: Process) -> None:
    first = {name: pixels(lora_client, loras=names(**{name: 1.0})) for name in ("ink", "neon", "moss")}
    assert len({array.tobytes() for array in first.values()}) == 3  # each adapter its own image
    # Two resident at most: ink was unloaded for moss, and loads again to the same weights.
    assert np.array_equal(pixels(lora_client, loras=names(ink=1.0)), first["ink"])
    assert "unloaded LoRA ink" in lora_worker.output()
    both = pixels(lora_client, loras=names(ink=1.0, neon=1.0))
    assert all(not np.array_equal(both, alone) for alone in first.values())


def test_an_image_job_runs_with_an_adapter(lora_client: FlaskClient) -> None:
    image = data_url(start_image(64, 64))
    bare = pixels(lora_client, image=image, strength=1.0)
    assert not np.array_equal(pixels(lora_client, image=image, strength=1.0, loras=names(moss=1.0)), bare)


def test_the_worker_lists_its_adapters_and_fails_a_job_with_one_it_lacks(
        lora_client: FlaskClient, lora_settings: Settings, tmp_path: Path) -> None:
    def live() -> list[dict]:
        return [m for m in lora_client.get("/v1/models").get_json()["models"] if m["workers"]]

    (model,) = wait_for(live, what="the worker's heartbeat")
    assert model["loras"] == ["ink", "moss", "neon"] and model["workers"] == 1
    # An API whose folder has one more adapter than the worker's (say, a mount not yet synced).
    wider = tmp_path / "wider"
    shutil.copytree(lora_settings.lora_dir, wider)  # type: ignore[arg-type]
    shutil.copy(wider / "ink.safetensors", wider / "extra.safetensors")
    for client in app_client(lora_settings.model_copy(update={"lora_dir": wider})):
        job_id = post_job(client, width=64, height=64, steps=1, loras=names(extra=1.0)).get_json()["id"]
        failed = wait_for_status(client, job_id, "failed")
        assert failed["error"]["code"] == "unknown_lora" and "extra" in failed["error"]["message"]
    wait_for(lambda: pixels(lora_client).size > 0, what="the worker to go on")


def test_the_worker_runs_an_alternating_line_in_runs_of_one_adapter(lora_client: FlaskClient) -> None:
    blocker = post_job(lora_client, width=512, height=512, steps=30, seed=1).get_json()["id"]
    wait_for(lambda: lora_client.get(f"/v1/jobs/{blocker}").get_json()["status"] == "running",
             what="the long job to start")
    ids = [post_job(lora_client, width=64, height=64, steps=1, seed=i,
                    loras=names(**{("ink", "neon")[i % 2]: 1.0})).get_json()["id"] for i in range(12)]
    views = sorted((wait_for_status(lora_client, job_id, "succeeded") for job_id in ids),
                   key=lambda view: view["started_at"])
    ran = [view["request"]["loras"][0]["name"] for view in views]
    changes = sum(before != after for before, after in zip(ran, ran[1:], strict=False))
    assert changes <= 12 // 8 + 1, ran  # in the line's order: 11


def test_the_document_offers_exactly_the_adapters_there_are(settings: Settings, lora_dir: Path) -> None:
    import jsonschema_rs

    from api.openapi import openapi_document

    def accepts(lora_dir: Path | None, loras: list[dict[str, object]]) -> bool:
        components = openapi_document(settings.model_copy(update={"lora_dir": lora_dir}))["components"]
        schema = {"$ref": "#/components/schemas/JobRequest", "components": components}
        return jsonschema_rs.validator_for(schema).is_valid({"prompt": "p", "loras": loras})

    assert accepts(lora_dir, names(ink=1.0, moss=-1.0)) and not accepts(lora_dir, names(ghost=1.0))
    assert accepts(None, []) and not accepts(None, names(ink=1.0))  # no folder: a job names none


# --- half precision: an adapter that overflows float16 ---------------------------------------------

@pytest.fixture
def half_worker(settings: Settings, lora_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Settings]:
    """The tiny model in float16 in this process, as the worker's, with the tiny adapters."""
    from worker import pipeline, tasks

    half = settings.model_copy(update={"device": "cpu", "dtype": "float16", "lora_dir": lora_dir})
    before = pipeline._current
    pipeline.set_current_pipeline(pipeline.load_pipeline(half))
    monkeypatch.setattr(tasks, "get_settings", lambda: half)
    yield half
    pipeline._current = before


@contextmanager
def calls_of(settings: Settings, vae_nan: bool = False) -> Iterator[list[str]]:
    """Each UNet call ("unet") and decoding ("vae") of the worker's pipeline meanwhile; with
    ``vae_nan``, each decoding's output is NaN, as a VAE that overflows float16 makes it."""
    from worker import pipeline

    pipe, calls = pipeline.current_pipeline().pipe, []
    hook = pipe.unet.register_forward_hook(lambda *_: calls.append("unet"))
    decode = pipe.vae.decode  # the pipeline decodes through vae.decode, not the VAE's forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append("vae")
        made = decode(*args, **kwargs)
        if vae_nan:
            made[0].fill_(float("nan"))  # the sample, whether a tuple or diffusers' DecoderOutput
        return made

    pipe.vae.decode = counted
    try:
        yield calls
    finally:
        hook.remove()
        del pipe.vae.decode


def rendered(settings: Settings, scale: float, steps: int) -> Any:
    """One 64x64 job with ``ink`` at ``scale``, admitted by the API and run by ``tasks.render``."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from worker import tasks

    for client in app_client(settings):
        response = post_job(client, width=64, height=64, steps=steps, seed=11, loras=names(ink=scale))
        assert response.status_code == 202, response.get_json()
        with Redis.from_url(settings.redis_url) as connection:
            job = Job.fetch(response.get_json()["id"], connection=connection, serializer=JSONSerializer)
            (outcome,) = tasks.render([job])
    return outcome


def test_an_image_that_comes_out_nan_fails_the_job_with_nan_output_not_a_black_image(
        half_worker: Settings) -> None:
    """``ink`` at scale 2 overflows the tiny SD model in float16 (its weights are large on purpose):
    every latent is NaN from the first step, which diffusers turns into a black image. A NaN latent
    can only decode to a NaN image: the job ends once the latents are looked at (after the first
    step), instead of holding the device for all its steps and the decoding."""
    from shared.contract.errors import JobFailedError

    outcomes, calls = {}, {}
    for scale in (2.0, 0.5):
        with calls_of(half_worker) as made:
            outcomes[scale] = rendered(half_worker, scale, steps=40)
        calls[scale] = made
    failed = outcomes[2.0]
    assert isinstance(failed, JobFailedError) and failed.code == "nan_output", failed
    assert "bfloat16" in str(failed)
    assert calls[2.0] == ["unet"]  # one step, then no decoding
    passed = outcomes[0.5]  # the same model and adapter at half the scale stays finite: images
    assert not isinstance(passed, Exception), passed
    _, (image,) = passed
    assert np.asarray(image, dtype=np.float32).std() > 2.0
    assert calls[0.5].count("unet") == 40 and "vae" in calls[0.5]  # finite latents run every step


def test_nan_that_only_the_vae_makes_is_found_after_the_decoding(half_worker: Settings) -> None:
    """Finite latents whose decoding overflows (some checkpoints' VAEs in float16): every step
    runs, and the images' own check ends the job ``nan_output``, not a black image."""
    from shared.contract.errors import JobFailedError

    with calls_of(half_worker, vae_nan=True) as made:
        failed = rendered(half_worker, 0.5, steps=3)
    assert isinstance(failed, JobFailedError) and failed.code == "nan_output", failed
    assert made == ["unet"] * 3 + ["vae"]


def test_an_execution_ends_each_member_whose_rows_turn_nan_and_stops_once_none_is_left() -> None:
    """Per member of a batch: its own rows of the latents decide, the others run on; with none
    left the execution stops, each member keeping its outcome (a cancel only where all were)."""
    import torch

    from shared.contract.errors import JobCanceledError, JobFailedError
    from worker.tasks import NothingLeft, Running

    nan = float("nan")
    invalid = JobFailedError("invalid_request", "bad")
    outcomes: list[object] = [None, invalid, None, None]  # job 1 failed before the execution
    running = Running([None] * 4, outcomes, [0, 2, 3], per_job=2)  # type: ignore[arg-type]
    latents = torch.zeros(6, 4, 8, 8)
    latents[3, 0, 0, 0] = nan  # the second image of job 2
    running.step_done(5, 40, due=False, latents=latents)  # no report due, nor the first step: not looked at
    assert outcomes == [None, invalid, None, None]
    running.step_done(1, 40, due=False, latents=latents)  # the first step is always looked at
    assert outcomes[2].code == "nan_output" and outcomes[0] is None and outcomes[3] is None  # type: ignore[union-attr]
    assert running.live == [0, 3]
    outcomes[0] = JobCanceledError()  # as a report that saw its cancel would have
    latents[4:] = nan
    with pytest.raises(NothingLeft):  # one canceled, one NaN: not a cancel of both
        running.step_done(1, 40, due=False, latents=latents)
    assert isinstance(outcomes[0], JobCanceledError) and outcomes[3].code == "nan_output"  # type: ignore[union-attr]
    canceled: list[object] = [JobCanceledError(), JobCanceledError()]  # both seen canceled by a report
    with pytest.raises(JobCanceledError):  # a cancel, as one job's cancel always ended
        Running([None] * 2, canceled, [0, 1], per_job=1).step_done(3, 40, due=False, latents=None)  # type: ignore[arg-type]
