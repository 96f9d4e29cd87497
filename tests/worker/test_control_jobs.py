"""Issue 47 end to end: ControlNet, IP-Adapter and hires jobs through the API and a real worker process on
the tiny SD model, its tiny ControlNets (worker/tiny/controlnets.py: chalk and ember in diffusers' layout,
chalk-file chalk's weights as one file) and its tiny IP-Adapters (worker/tiny/ip_adapters.py: plume and
slate)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image, ImageDraw

from shared.contract.settings import Settings
from tests.conftest import (
    Process,
    app_client,
    data_url,
    own_database,
    post_job,
    running_worker,
    wait_for_status,
)

DATABASE = 4  # apart from the others' (0 per test, 1 the worker, 2-3, 5-9, 11-15 other modules)
SMALL = {"prompt": "a lighthouse on a cliff", "width": 64, "height": 64, "steps": 2, "seed": 5}
# Mean absolute difference of two images' pixels (0-255) that no rounding reaches; measured 10-14 for
# one tiny ControlNet at scale 1 against none.
VISIBLE = 3.0


def edges() -> Image.Image:
    """A control image as a canny ControlNet takes it: a square's edges, white on black."""
    image = Image.new("RGB", (64, 64))
    ImageDraw.Draw(image).rectangle((14, 14, 50, 50), outline="white", width=2)
    return image


def picture() -> Image.Image:
    """A plain picture, whose canny edges differ from the picture itself."""
    image = Image.new("RGB", (64, 64), (40, 90, 160))
    ImageDraw.Draw(image).ellipse((10, 20, 54, 60), fill=(230, 200, 60))
    return image


@pytest.fixture(scope="module")
def control_settings(redis_url: str, model_cache: Path) -> Settings:
    from worker.tiny.controlnets import ensure_tiny_controlnets
    from worker.tiny.ip_adapters import ensure_tiny_ip_adapters

    url = own_database(redis_url, DATABASE)
    # The model is named after the tiny one: the folders keep its own ControlNets and IP-Adapters under it.
    return Settings(redis_url=url, queue_name="control-tests", cache_dir=model_cache, drain_s=0, device="cpu",
                    dtype="float32", torch_threads=1, model_name="tiny", model_names=["tiny"],
                    controlnet_dir=ensure_tiny_controlnets(model_cache, "tiny"),
                    ip_adapter_dir=ensure_tiny_ip_adapters(model_cache, "tiny"), heartbeat_ttl_s=2)


@pytest.fixture(scope="module")
def control_worker(control_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(control_settings, tmp_path_factory, "control")


@pytest.fixture
def client(control_settings: Settings, control_worker: Process) -> Iterator[FlaskClient]:
    yield from app_client(control_settings)


def run(client: FlaskClient, **body: Any) -> dict[str, Any]:
    response = post_job(client, **(SMALL | body))
    assert response.status_code == 202, response.get_json()
    return wait_for_status(client, response.get_json()["id"], "succeeded", "failed")


def pixels(client: FlaskClient, view: dict[str, Any]) -> np.ndarray:
    assert view["status"] == "succeeded", view
    return np.asarray(Image.open(io.BytesIO(client.get(view["images"][0]).data)), dtype=float)


def control(name: str = "chalk", image: Image.Image | None = None, **fields: Any) -> dict[str, Any]:
    return {"name": name, "image": data_url(image or edges()), **fields}


def test_a_controlnet_changes_the_image_at_scale_1_and_not_at_scale_0(client: FlaskClient) -> None:
    bare = pixels(client, run(client))
    chalk = pixels(client, run(client, controlnets=[control()]))
    assert np.abs(chalk - bare).mean() > VISIBLE
    assert np.abs(pixels(client, run(client, controlnets=[control(scale=0.0)])) - bare).max() <= 1
    # The same weights as one file, loaded by diffusers' from_single_file: chalk's image.
    assert np.abs(pixels(client, run(client, controlnets=[control("chalk-file")])) - chalk).max() <= 1
    both = pixels(client, run(client, controlnets=[control(), control("ember")]))
    assert np.abs(both - chalk).mean() > VISIBLE
    # Acting on the first of the two steps only: neither chalk's image nor the bare one (measured 1.4 from
    # chalk's: the last step moves the pixels less).
    half = pixels(client, run(client, controlnets=[control(end=0.5)]))
    assert np.abs(half - chalk).mean() > 0.5 and np.abs(half - bare).mean() > VISIBLE


def test_a_job_without_controls_after_one_with_them_runs_without(client: FlaskClient) -> None:
    bare = pixels(client, run(client, seed=9))
    controlled = run(client, seed=9, controlnets=[control("ember")])
    later = run(client, seed=9)
    assert later["started_at"] > controlled["finished_at"]
    assert np.abs(pixels(client, later) - bare).max() <= 1  # no residue of the ControlNet in the model


def test_canny_preprocessing_makes_the_control_image_from_a_picture(client: FlaskClient) -> None:
    raw = pixels(client, run(client, controlnets=[control(image=picture())]))
    edged = pixels(client, run(client, controlnets=[control(image=picture(), preprocess="canny")]))
    assert np.abs(edged - raw).mean() > VISIBLE


def test_canny_thresholds_choose_which_edges_steer(client: FlaskClient) -> None:
    faint = Image.new("RGB", (64, 64), (100, 100, 100))  # a step of 20: below the default thresholds
    ImageDraw.Draw(faint).ellipse((12, 12, 52, 52), fill=(120, 120, 120))
    blank = pixels(client, run(client, controlnets=[control(image=Image.new("RGB", (64, 64)))]))
    default = pixels(client, run(client, controlnets=[control(image=faint, preprocess="canny")]))
    assert np.abs(default - blank).max() <= 1  # no edge found: a black control image
    low = pixels(client, run(client, controlnets=[control(image=faint, preprocess="canny", low=20, high=40)]))
    assert np.abs(low - blank).mean() > VISIBLE


def test_a_control_image_of_another_size_is_resized_to_the_job(client: FlaskClient) -> None:
    small = pixels(client, run(client, controlnets=[control()]))
    large = pixels(client, run(client, controlnets=[control(image=edges().resize((128, 128)))]))
    assert large.shape == small.shape == (64, 64, 3)
    assert np.abs(large - small).mean() < VISIBLE  # the same edges, at twice the size


def test_controls_act_on_an_image_to_image_job(client: FlaskClient) -> None:
    start = data_url(picture())
    plain = pixels(client, run(client, image=start, strength=1.0))
    chalk = pixels(client, run(client, image=start, strength=1.0, controlnets=[control()]))
    assert np.abs(chalk - plain).mean() > VISIBLE


def test_a_hires_job_makes_the_larger_image_and_counts_both_passes(client: FlaskClient) -> None:
    for upscaler in ("latent", "lanczos"):
        view = run(client, hires={"scale": 2, "steps": 4, "denoise": 0.5, "upscaler": upscaler})
        assert pixels(client, view).shape == (128, 128, 3)
        assert view["progress"] == {"step": 4, "total": 4}  # 2 steps at 64x64, 2 of 4 at 128x128
    plain = pixels(client, run(client, width=128, height=128))
    hires = pixels(client, run(client, hires={"scale": 2}))
    assert np.abs(hires - plain).mean() > VISIBLE  # not the job at the larger size
    again = pixels(client, run(client, hires={"scale": 2}))
    assert np.abs(again - hires).max() <= 1  # reproducible from its seed
    controlled = pixels(client, run(client, hires={"scale": 2}, controlnets=[control()]))
    assert controlled.shape == (128, 128, 3) and np.abs(controlled - hires).mean() > VISIBLE


def test_the_worker_reports_the_running_total_of_both_passes(client: FlaskClient,
                                                            control_settings: Settings) -> None:
    response = post_job(client, **(SMALL | {"steps": 6, "width": 128, "height": 128, "hires": {"scale": 2}}))
    job_id = response.get_json()["id"]
    assert response.get_json()["progress"] is None or response.get_json()["progress"]["total"] == 9
    totals = set()
    while (view := client.get(f"/v1/jobs/{job_id}").get_json())["status"] in ("queued", "running"):
        if view["progress"]:
            totals.add(view["progress"]["total"])
    assert view["status"] == "succeeded" and totals <= {9} and view["progress"] == {"step": 9, "total": 9}


def test_an_ip_adapter_changes_the_image_and_at_scale_0_does_not(client: FlaskClient) -> None:
    assert client.get("/v1/models").get_json()["models"][0]["ip_adapters"] == ["plume", "slate"]
    bare = pixels(client, run(client, seed=11))
    plume = run(client, seed=11, ip_adapter={"name": "plume", "image": data_url(picture())})
    assert np.abs(pixels(client, plume) - bare).mean() > VISIBLE
    assert plume["request"]["ip_adapter"]["image"]["width"] == 64  # a reference, the bytes kept apart
    assert client.get(f"/v1/jobs/{plume['id']}/inputs/ip_adapter").status_code == 200
    other = run(client, seed=11, ip_adapter={"name": "plume", "image": data_url(edges())})
    assert np.abs(pixels(client, other) - pixels(client, plume)).mean() > VISIBLE  # it follows its image
    zero = run(client, seed=11, ip_adapter={"name": "plume", "image": data_url(picture()), "scale": 0.0})
    assert np.abs(pixels(client, zero) - bare).max() <= 1
    later = run(client, seed=11)
    assert np.abs(pixels(client, later) - bare).max() <= 1  # unloaded: the bare model again
    both = run(client, seed=11, ip_adapter={"name": "slate", "image": data_url(picture())},
               controlnets=[control()])
    assert np.abs(pixels(client, both) - pixels(client, plume)).mean() > VISIBLE


def test_the_pipeline_tells_the_claim_which_controls_it_holds(control_settings: Settings,
                                                                 one_torch_thread: None) -> None:
    from shared.contract.jobs import JobRequest
    from worker.pipeline import load_pipeline

    pipeline = load_pipeline(control_settings.model_copy(update={"controlnet_cache": 2}))
    reference = {"media_type": "image/png", "width": 64, "height": 64, "bytes": 1, "sha256": "0" * 64}

    def generate(*names: str) -> None:
        controls = [{"name": name, "image": reference, "scale": 0.5} for name in names]
        request = JobRequest.model_validate(SMALL | {"controlnets": controls})
        pipeline.generate(request, inputs={f"control{index}": edges() for index in range(len(names))})

    generate("chalk")
    assert pipeline.holding == ("@chalk:0.5", ("@chalk",))
    generate()
    assert pipeline.holding == ("", ("@chalk",))  # the bare model ran last; chalk is still loaded
    generate("ember", "chalk-file")
    assert pipeline.holding == ("@ember:0.5,@chalk-file:0.5", ("@ember", "@chalk-file"))  # chalk dropped
    slate = JobRequest.model_validate(SMALL | {"ip_adapter": {"name": "slate", "image": reference}})
    pipeline.generate(slate, inputs={"ip_adapter": picture()})
    assert pipeline.holding == ("&slate:1.0", ("@ember", "@chalk-file", "&slate"))
    assert pipeline.controlnets.loads == 3


def test_sdxl_runs_controls_an_ip_adapter_and_a_hires_pass_together(model_cache: Path,
                                                                     one_torch_thread: None) -> None:
    from shared.contract.jobs import JobRequest
    from worker.pipeline import load_pipeline
    from worker.tiny.controlnets import ensure_tiny_controlnets
    from worker.tiny.ip_adapters import ensure_tiny_ip_adapters

    settings = Settings(cache_dir=model_cache, device="cpu", dtype="float32", model="tiny-sdxl",
                        model_name="tiny-sdxl", model_names=["tiny-sdxl=sdxl"],
                        controlnet_dir=ensure_tiny_controlnets(model_cache, "tiny-sdxl"),
                        ip_adapter_dir=ensure_tiny_ip_adapters(model_cache, "tiny-sdxl"))
    pipeline = load_pipeline(settings)
    reference = {"media_type": "image/png", "width": 64, "height": 64, "bytes": 1, "sha256": "0" * 64}
    inputs = {"control0": edges(), "control1": picture(), "ip_adapter": picture(), "image": picture()}

    def generate(**fields: Any) -> np.ndarray:
        request = JobRequest.model_validate(SMALL | {"guidance_scale": 5.0} | fields)
        return np.asarray(pipeline.generate(request, inputs=inputs)[0], dtype=float)

    bare = generate()
    controls = [{"name": "chalk", "image": reference}, {"name": "ember", "image": reference, "scale": 0.5}]
    assert np.abs(generate(controlnets=controls) - bare).mean() > VISIBLE
    assert np.abs(generate(ip_adapter={"name": "plume", "image": reference}) - bare).mean() > VISIBLE
    assert np.abs(generate(controlnets=controls[:1], image=reference, strength=1.0) - bare).mean() > VISIBLE
    together = generate(controlnets=controls, ip_adapter={"name": "slate", "image": reference},
                        hires={"scale": 2, "denoise": 0.5}, prompt_syntax="weighted",
                        prompt="(a lighthouse:1.2)")
    assert together.shape == (128, 128, 3) and not np.isnan(together).any()
