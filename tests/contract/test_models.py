"""Several models: names a job may give, one capped line per model with its own estimates and
Retry-After, and workers that each claim only their own model's jobs (two real workers, SD and SDXL)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from flask.testing import FlaskClient
from pydantic import ValidationError
from redis import Redis
from rq import Queue

from api.openapi import openapi_document
from shared.contract import keys
from shared.contract.errors import InvalidRequestError
from shared.contract.jobs import validate_submission
from shared.contract.models import (
    FAMILIES,
    FAMILY_SPECS,
    PIPELINE_CLASSES,
    TINY_MODELS,
    UNET_SCHEDULERS,
    Ability,
    Family,
    FamilySpec,
    check_takes,
    family_spec,
    model_info,
)
from shared.contract.settings import CHECKPOINT_CONFIGS, Settings
from tests.conftest import (
    Process,
    app_client,
    own_database,
    post_job,
    rq_queues,
    running_worker,
    start_worker,
    wait_for,
    wait_for_status,
    waiting_ids,
)

DATABASE = 8  # the others: 0 per test, 1 the worker, 2 batching and fuzz, 3 schemathesis, 5-7 apart


@pytest.fixture
def two(settings: Settings) -> Settings:
    """The test's settings serving two models: `default` (SD, the first) and `xl` (SDXL), 2 places each."""
    return settings.model_copy(update={"model_names": ["default", "xl=sdxl"], "queue_capacity": 2})


@pytest.fixture
def two_client(two: Settings) -> Iterator[FlaskClient]:
    yield from app_client(two)


# What the per-family tables said before there was one record per family.
UNET = {"samplers": UNET_SCHEDULERS, "steppable": UNET_SCHEDULERS, "side_multiple": 8, "denoiser": "unet",
        "single_file": "pipeline", "takes_controlnet": True, "takes_ip_adapter": True,
        "takes_latent_upscale": True, "cache_interval": 3, "cache_threshold": None}
EXPECTED: dict[str, dict[str, object]] = {
    "sd": UNET | {"pipeline_class": "StableDiffusionPipeline", "tiny_model": "tiny",
                  "checkpoint_config": "stable-diffusion-v1-5/stable-diffusion-v1-5",
                  "defaults": {"steps": 30, "guidance_scale": 7.5, "width": 512, "height": 512}},
    "sdxl": UNET | {"pipeline_class": "StableDiffusionXLPipeline", "tiny_model": "tiny-sdxl",
                    "checkpoint_config": "stabilityai/stable-diffusion-xl-base-1.0",
                    "defaults": {"steps": 30, "guidance_scale": 5.0, "width": 1024, "height": 1024}},
    "flux": {"pipeline_class": "FluxPipeline", "tiny_model": "tiny-flux",
             "checkpoint_config": "black-forest-labs/FLUX.1-dev", "samplers": ("flow_euler",),
             "steppable": ("flow_euler",), "side_multiple": 16, "denoiser": "transformer",
             "single_file": "transformer", "takes_controlnet": False, "takes_ip_adapter": False,
             "takes_latent_upscale": False, "cache_interval": None, "cache_threshold": 0.08,
             "defaults": {"steps": 28, "guidance_scale": 3.5, "width": 1024, "height": 1024}},
}
IMAGE = {"media": "image", "frame_multiple": 0, "image_to_video_class": None, "min_steps": 1,
         "job_timeout_s": None, "starts_from_image": False}
# The video families, as their published defaults have them (Wan 2.1 1.3B's 480p, LTX-Video 0.9's).
VIDEO = {"samplers": ("flow_euler",), "steppable": (), "denoiser": "transformer",
         "single_file": "transformer",
         "takes_controlnet": False, "takes_ip_adapter": False, "takes_latent_upscale": False,
         "cache_interval": None, "cache_threshold": None, "media": "video", "job_timeout_s": 3600,
         "starts_from_image": False}
EXPECTED |= {
    "wan": VIDEO | {"pipeline_class": "WanPipeline", "tiny_model": "tiny-wan",
                    "checkpoint_config": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "side_multiple": 16,
                    "frame_multiple": 4, "image_to_video_class": None, "min_steps": 1,
                    "defaults": {"steps": 50, "guidance_scale": 5.0, "width": 832, "height": 480,
                                 "frames": 81, "fps": 16}},
    # Wan 2.1 I2V 14B 480p: its own checkpoints, every clip from a start image (40 steps, as Wan's
    # generate.py runs image-to-video).
    "wan_i2v": VIDEO | {"pipeline_class": "WanImageToVideoPipeline", "tiny_model": "tiny-wan-i2v",
                        "checkpoint_config": "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "side_multiple": 16,
                        "frame_multiple": 4, "image_to_video_class": None, "min_steps": 1,
                        "starts_from_image": True,
                        "defaults": {"steps": 40, "guidance_scale": 5.0, "width": 832, "height": 480,
                                     "frames": 81, "fps": 16}},
    "ltx": VIDEO | {"pipeline_class": "LTXPipeline", "tiny_model": "tiny-ltx",
                    "checkpoint_config": "Lightricks/LTX-Video", "side_multiple": 32, "frame_multiple": 8,
                    "image_to_video_class": "LTXImageToVideoPipeline", "min_steps": 2,
                    "defaults": {"steps": 50, "guidance_scale": 3.0, "width": 704, "height": 480,
                                 "frames": 161, "fps": 25}},
}


def test_every_family_has_one_complete_record_that_says_what_the_old_tables_said() -> None:
    assert tuple(FAMILY_SPECS) == FAMILIES
    for family in FAMILIES:
        spec = family_spec(family)
        # Every field given, but the step-cache setting its denoiser does not use and, for an image
        # family, those of clips.
        assert set(FamilySpec.model_fields) - spec.model_fields_set <= {"cache_interval", "cache_threshold",
                                                                        *IMAGE}
        record = spec.model_dump(exclude={"text_encoders", "latent_format"})
        record["defaults"] = spec.defaults.fields
        assert record == ((IMAGE | EXPECTED[family]) if spec.media == "image" else EXPECTED[family]), family
        assert (PIPELINE_CLASSES[spec.pipeline_class], TINY_MODELS[spec.tiny_model]) == (family, family)
        assert CHECKPOINT_CONFIGS[family] == spec.checkpoint_config
        info = model_info("m", family)
        assert (info.schedulers, info.defaults, info.side_multiple, info.spec) == (
            list(spec.samplers), spec.defaults, spec.side_multiple, spec)
    # Each family its own text encoders and latent space (Wan's two the same).
    assert [(spec.text_encoders, spec.latent_format) for spec in FAMILY_SPECS.values()] == [
        ("clip", "sd15"), ("clip_pair", "sdxl"), ("t5_clip", "flux"), ("t5", "wan21"), ("t5", "wan21"),
        ("t5", "ltxv")]


def test_a_record_that_contradicts_itself_is_refused() -> None:
    sd = family_spec("sd").model_dump()
    for change in ({"steppable": ("flow_euler",)}, {"cache_interval": None}, {"cache_threshold": 0.1},
                   {"denoiser": "transformer"}):
        with pytest.raises(ValidationError):
            FamilySpec(**(sd | change))


@pytest.mark.parametrize(("ability", "loc", "message"), [
    ("takes_controlnet", ["controlnets"],
     "a flux model takes no ControlNet here: slotq's ControlNets are the sd, sdxl families'"),
    ("takes_ip_adapter", ["ip_adapter"],
     "a flux model takes no IP-Adapter here: slotq's are the sd, sdxl families'"),
    ("takes_latent_upscale", ["hires", "upscaler"],
     "a flux model's hires pass upscales the image: send `lanczos`"),
])
def test_what_a_family_cannot_take_is_refused_at_its_field(ability: Ability, loc: list[str],
                                                           message: str) -> None:
    able: tuple[Family, ...] = ("sd", "sdxl")
    for family in able:
        check_takes(family, ability)
    with pytest.raises(InvalidRequestError) as refused:
        check_takes("flux", ability)
    assert refused.value.details == [{"loc": loc, "msg": message}]


def test_names_are_checked_when_the_settings_are_read() -> None:
    assert Settings(model_names="a, b=flux").offered_models == {"a": "sd", "b": "flux"}
    assert Settings(model_names='["a", "b"]').default_model == "a"
    for bad in ("a,a", "a=dalle", "", "a:b", "../x"):
        with pytest.raises(ValidationError):
            Settings(model_names=bad)


def test_aliases_name_offered_models_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLOTQ_MODEL_ALIASES", '{"sdxl-turbo": "b", "dall-e-3": "a"}')
    assert Settings(model_names="a,b").model_aliases == {"sdxl-turbo": "b", "dall-e-3": "a"}
    with pytest.raises(ValidationError, match="SLOTQ_MODEL_ALIASES: c not in SLOTQ_MODEL_NAMES"):
        Settings(model_names="a,b", model_aliases={"x": "c"})


def test_a_job_runs_on_the_model_it_names_else_the_first(two_client: FlaskClient) -> None:
    first = post_job(two_client, steps=2).get_json()
    assert first["model"] == "default" and first["request"]["model"] == "default"
    assert first["worker"] is None  # not started
    xl = post_job(two_client, model="xl", steps=2).get_json()
    assert xl["model"] == "xl" and xl["request"]["model"] == "xl"
    # What the body leaves out comes from the named model's family: SDXL's sides (within 1024).
    assert (xl["request"]["width"], xl["request"]["guidance_scale"]) == (1024, 5.0)
    assert (first["request"]["width"], first["request"]["guidance_scale"]) == (512, 7.5)
    assert two_client.get(f"/v1/jobs/{xl['id']}").get_json()["model"] == "xl"


def test_an_unknown_model_is_refused_at_the_door_with_nothing_stored(two_client: FlaskClient,
                                                                       redis: Redis) -> None:
    post_job(two_client)  # the line exists: the refusal must add nothing to it
    before = sorted(redis.keys("*"))
    response = post_job(two_client, model="sdxl-turbo")
    assert response.status_code == 422
    error = response.get_json()["error"]
    assert error["code"] == "unknown_model" and "default, xl" in error["message"]
    assert sorted(redis.keys("*")) == before
    malformed = post_job(two_client, model=7)
    assert malformed.status_code == 422 and malformed.get_json()["error"]["code"] == "invalid_request"


def test_each_model_has_its_own_capped_line_and_rq_queues(two_client: FlaskClient, two: Settings,
                                                          redis: Redis) -> None:
    ids = [post_job(two_client).get_json()["id"] for _ in range(2)]
    full = post_job(two_client)
    assert full.status_code == 429 and full.get_json()["error"]["code"] == "queue_full"
    assert int(full.headers["Retry-After"]) >= 1
    xl = [post_job(two_client, model="xl").get_json()["id"] for _ in range(2)]  # its own places
    assert post_job(two_client, model="xl").status_code == 429
    assert waiting_ids(redis, two) == ids and waiting_ids(redis, two, "xl") == xl
    queues = {queue.name: queue.get_job_ids() for queue in rq_queues(redis, two)}
    assert queues == {f"{two.queue_name}:default:normal": ids, f"{two.queue_name}:xl:normal": xl}
    line = two_client.get("/v1/queue").get_json()
    assert (line["waiting"], line["capacity"], line["by_priority"]["normal"]) == (4, 4, 4)
    assert {name: (entry["waiting"], entry["capacity"]) for name, entry in line["models"].items()} == {
        "default": (2, 2), "xl": (2, 2)}
    # A cancel frees a place in its own line only.
    assert two_client.delete(f"/v1/jobs/{xl[0]}").status_code == 200
    assert post_job(two_client).status_code == 429
    assert post_job(two_client, model="xl").status_code == 202


def test_each_model_has_its_own_estimates_and_retry_after(two_client: FlaskClient, two: Settings,
                                                          redis: Redis) -> None:
    # Fitted job times as the workers of each line would leave them: 3 s a job for SD, 40 s for SDXL.
    redis.hset(keys.model_key(two.line_of("default")), mapping={"a": 3, "b": 0})
    redis.hset(keys.model_key(two.line_of("xl")), mapping={"a": 40, "b": 0})
    views = [post_job(two_client, model=model).get_json() for model in ("default", "default", "xl", "xl")]
    assert [view["eta_s"]["start"] for view in views] == [0, 3, 0, 40]
    # A low job may take 1 of the 2 places: one frees when the second of its line starts.
    assert int(post_job(two_client, priority="low").headers["Retry-After"]) == 3
    assert int(post_job(two_client, model="xl", priority="low").headers["Retry-After"]) == 40


def test_the_document_offers_the_names_and_what_every_model_takes(two: Settings) -> None:
    fields = openapi_document(two)["components"]["schemas"]["JobRequest"]["properties"]
    assert fields["model"]["anyOf"][0]["enum"] == ["default", "xl"]
    sd_and_flux = two.model_copy(update={"model_names": ["default", "flux=flux"]})
    fields = openapi_document(sd_and_flux)["components"]["schemas"]["JobRequest"]["properties"]
    assert fields["width"]["multipleOf"] == 16  # Flux's, which SD's multiples of 8 include
    assert fields["scheduler"]["anyOf"] == [{"type": "null"}]  # no sampler both take


# --- two real workers, one per model --------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet_settings(redis_url: str, model_cache: Path) -> Settings:
    url = own_database(redis_url, DATABASE)
    return Settings(redis_url=url, queue_name="fleet", model_names=["sd", "xl=sdxl"], queue_capacity=20,
                    cache_dir=model_cache, drain_s=0, heartbeat_ttl_s=2, max_side=256)


def worker_of(settings: Settings, model: str, checkpoint: str, name: str, log: Path) -> Process:
    return start_worker(settings, log, model_name=model, model=checkpoint, worker_name=name,
                        worker_metrics_port=0)


@pytest.fixture(scope="module")
def sd_worker(fleet_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(fleet_settings, tmp_path_factory, "sd", clean_stop=False, model_name="sd",
                              model="tiny", worker_name="gpu-sd", worker_metrics_port=0)


@pytest.fixture
def fleet(sd_worker: Process, fleet_settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(fleet_settings)


def live_workers(client: FlaskClient) -> dict[str, list[str]]:
    return {model["name"]: model["worker_names"] for model in client.get("/v1/models").get_json()["models"]}


@pytest.mark.timeout(300)
def test_two_workers_run_only_their_own_models_jobs(fleet: FlaskClient, fleet_settings: Settings,
                                                    tmp_path: Path) -> None:
    wait_for(lambda: live_workers(fleet)["sd"] == ["gpu-sd"], what="the SD worker's heartbeat")
    assert live_workers(fleet)["xl"] == []
    body = {"steps": 2, "width": 64, "height": 64}
    xl = [post_job(fleet, model="xl", **body).get_json()["id"] for _ in range(2)]
    sd = [post_job(fleet, model="sd", **body).get_json()["id"] for _ in range(2)]
    for job_id in sd:  # the SD worker runs the SD jobs, behind the SDXL ones in time...
        assert wait_for_status(fleet, job_id, "succeeded")["worker"] == "gpu-sd"
    # ...and leaves the SDXL ones waiting: no worker serves their line.
    assert [fleet.get(f"/v1/jobs/{job_id}").get_json()["status"] for job_id in xl] == ["queued", "queued"]
    xl_worker = worker_of(fleet_settings, "xl", "tiny-sdxl", "gpu-xl", tmp_path / "xl.log")
    try:
        for job_id in xl:
            view = wait_for_status(fleet, job_id, "succeeded")
            assert (view["worker"], view["model"]) == ("gpu-xl", "xl")
            image = fleet.get(view["images"][0])
            assert image.status_code == 200 and image.mimetype == "image/png"
        assert live_workers(fleet) == {"sd": ["gpu-sd"], "xl": ["gpu-xl"]}
        listed = {entry["name"]: (entry["model"], entry["checkpoint"], entry["family"])
                  for entry in fleet.get("/v1/workers").get_json()["workers"]}
        assert listed == {"gpu-sd": ("sd", "tiny", "sd"), "gpu-xl": ("xl", "tiny-sdxl", "sdxl")}
    finally:
        assert xl_worker.stop() == 0, xl_worker.output()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_workers_job_runs_again_on_its_own_models_line(fleet: FlaskClient, fleet_settings: Settings,
                                                                tmp_path: Path) -> None:
    first = worker_of(fleet_settings, "xl", "tiny-sdxl", "xl-one", tmp_path / "one.log")
    try:
        job_id = post_job(fleet, model="xl", steps=60, width=64, height=64).get_json()["id"]
        wait_for(lambda: (fleet.get(f"/v1/jobs/{job_id}").get_json()["progress"] or {}).get("step", 0) >= 1,
                 what="the SDXL job to be running")
        first.popen.send_signal(signal.SIGKILL)
        first.popen.wait(30)
    finally:
        first.stop()
    # The SD worker never takes it: the job waits for a worker of its own model, which recovers it.
    second = worker_of(fleet_settings, "xl", "tiny-sdxl", "xl-two", tmp_path / "two.log")
    try:
        view = wait_for_status(fleet, job_id, "succeeded", timeout=120)
        assert (view["worker"], view["attempt"], view["model"]) == ("xl-two", 2, "xl")
        with Redis.from_url(fleet_settings.redis_url) as connection:
            assert Queue(fleet_settings.queue_name, connection=connection).finished_job_registry.get_job_ids()
    finally:
        assert second.stop() == 0, second.output()


def test_a_models_defaults_within_a_smaller_side_hold_whatever_was_read_before() -> None:
    # The family's defaults are one shared instance: their fields read at full size first, as a job
    # on a service with a larger SLOTQ_MAX_SIDE reads them, must not leak into the clamped copy.
    assert model_info("flux-a", "flux").defaults.fields["width"] == 1024
    clamped = model_info("flux-b", "flux").within(512)
    assert clamped.defaults.width == 512
    assert clamped.defaults.fields == {"steps": 28, "guidance_scale": 3.5, "width": 512, "height": 512}
    request = validate_submission({"prompt": "defaults only"}, max_side=512, max_steps=100,
                                  max_image_bytes=2**20, model=model_info("flux-c", "flux"))
    assert (request.request.width, request.request.height) == (512, 512)
