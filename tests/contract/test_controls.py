"""ControlNets and the hires pass at the door (shared/contract/jobs.py, the API's checks): in-process,
on a real Redis, no worker. What the worker makes of them is tests/worker/test_control_jobs.py's."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from redis import Redis

from shared.contract.jobs import JobRequest
from shared.contract.settings import Settings
from tests.conftest import app_client, data_url, post_job, start_image
from tests.contract.test_images import HOSTILE, error_of, nothing_stored

SMALL = {"width": 64, "height": 64, "steps": 2}
# Control images may have any size (the pipeline resizes them): these of HOSTILE are fine as controls.
ANY_SIZE = {"a side that is no multiple of 8", "too small"}


@pytest.fixture
def controlnet_dir(tmp_path: Path) -> Path:
    """Two ControlNets by name (the API reads the folder, never the weights) and a pickle it never offers."""
    for name in ("chalk", "ember"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        (tmp_path / name / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    (tmp_path / "old.ckpt").write_bytes(b"")
    return tmp_path


@pytest.fixture
def ip_adapter_dir(tmp_path: Path) -> Path:
    """Two IP-Adapters by name beside the image encoder they share (the API never reads the weights)."""
    folder = tmp_path / "ip-adapters"
    (folder / "image_encoder").mkdir(parents=True)
    (folder / "image_encoder" / "config.json").write_text("{}")
    (folder / "image_encoder" / "model.safetensors").write_bytes(b"")
    for name in ("plume", "slate"):
        (folder / f"{name}.safetensors").write_bytes(b"")
    (folder / "old.bin").write_bytes(b"")
    return folder


@pytest.fixture
def client(settings: Settings, controlnet_dir: Path, ip_adapter_dir: Path) -> Iterator[FlaskClient]:
    yield from app_client(settings.model_copy(update={"controlnet_dir": controlnet_dir,
                                                      "ip_adapter_dir": ip_adapter_dir}))


def control(name: str = "chalk", image: Any = None, **fields: Any) -> dict[str, Any]:
    return {"name": name, "image": image if image is not None else data_url(start_image(96, 80)), **fields}


def test_a_control_is_stored_as_an_input_and_shown_as_a_reference(client: FlaskClient, redis: Redis) -> None:
    image = data_url(start_image(96, 80, seed=3))
    response = post_job(client, controlnets=[control(image=image, scale=0.5, end=0.6, preprocess="canny"),
                                             control("ember")], **SMALL)
    assert response.status_code == 202, response.get_json()
    view = response.get_json()
    first, second = view["request"]["controlnets"]
    assert (first["name"], first["scale"], first["start"], first["end"], first["preprocess"]) == (
        "chalk", 0.5, 0.0, 0.6, "canny")
    assert (first["image"]["width"], first["image"]["height"]) == (96, 80)  # any size: no fit to the job's
    assert (second["scale"], second["preprocess"]) == (1.0, "none")
    sent = client.get(f"/v1/jobs/{view['id']}/inputs/control0")
    assert sent.status_code == 200 and sent.mimetype == "image/png"
    assert sent.data == base64.b64decode(image.partition(",")[2])
    assert client.get(f"/v1/jobs/{view['id']}/inputs/control1").status_code == 200
    assert client.get(f"/v1/jobs/{view['id']}/inputs/image").status_code == 404  # a text job: no start image


def test_the_models_list_their_controlnets_and_ip_adapters(client: FlaskClient) -> None:
    (model,) = client.get("/v1/models").get_json()["models"]
    assert model["controlnets"] == ["chalk", "ember"]  # the pickles are never offered
    assert model["ip_adapters"] == ["plume", "slate"]


def test_an_ip_adapter_is_checked_and_stored_as_an_input(client: FlaskClient, redis: Redis) -> None:
    message = error_of(post_job(client, ip_adapter={"name": "old", "image": data_url(start_image(64, 64))},
                                **SMALL), 422, "unknown_ip_adapter")
    assert "No IP-Adapter named old" in message and "plume, slate" in message
    for url, expected in (HOSTILE["a PNG bomb"], HOSTILE["a truncated PNG"], HOSTILE["no data URL"]):
        response = post_job(client, ip_adapter={"name": "plume", "image": url}, **SMALL)
        assert expected in error_of(response, 422, "invalid_image") and "ip_adapter.image" in error_of(
            response, 422, "invalid_image")
    response = post_job(client, ip_adapter={"name": "plume", "image": data_url(start_image(64, 64)),
                                            "scale": 3}, **SMALL)
    assert "less than or equal to 2" in error_of(response, 422, "invalid_request")
    assert nothing_stored(redis)
    image = data_url(start_image(40, 72, seed=2))
    view = post_job(client, ip_adapter={"name": "plume", "image": image, "scale": 0.6}, **SMALL).get_json()
    stored_request = view["request"]["ip_adapter"]
    assert stored_request["image"]["width"] == 40 and stored_request["scale"] == 0.6
    stored = client.get(f"/v1/jobs/{view['id']}/inputs/ip_adapter")
    assert stored.status_code == 200 and stored.data == base64.b64decode(image.partition(",")[2])


def test_an_unknown_controlnet_is_a_422_with_nothing_stored(client: FlaskClient, redis: Redis) -> None:
    message = error_of(post_job(client, controlnets=[control("depth")], **SMALL), 422, "unknown_controlnet")
    assert "No ControlNet named depth" in message and "chalk, ember" in message
    response = post_job(client, controlnets=[control("old")], **SMALL)
    assert "old" in error_of(response, 422, "unknown_controlnet")
    assert nothing_stored(redis)


@pytest.mark.parametrize("case", sorted(set(HOSTILE) - ANY_SIZE))
def test_a_hostile_control_image_is_refused_cleanly(client: FlaskClient, redis: Redis, case: str) -> None:
    url, expected = HOSTILE[case]
    message = error_of(post_job(client, controlnets=[control(image=url)], **SMALL), 422, "invalid_image")
    assert expected in message and "controlnets[0].image" in message
    assert nothing_stored(redis)


@pytest.mark.parametrize("fields, expected", [
    ({"scale": 2.5}, "less than or equal to 2"),
    ({"start": 0.5, "end": 0.5}, "must be below `end`"),
    ({"start": 0.8, "end": 0.2}, "must be below `end`"),
    ({"preprocess": "depth"}, "'none' or 'canny'"),
    ({"preprocess": "canny", "low": 150, "high": 100}, "must not be above `high`"),
    ({"preprocess": "canny", "high": 300}, "less than or equal to 255"),
    ({"weight": 1.0}, "Extra inputs are not permitted"),
    ({"name": "../chalk"}, "should match pattern"),
])
def test_a_control_out_of_bounds_is_refused(client: FlaskClient, redis: Redis, fields: dict[str, Any],
                                            expected: str) -> None:
    assert expected in error_of(post_job(client, controlnets=[control(**fields)], **SMALL), 422,
                                "invalid_request")
    assert nothing_stored(redis)


def test_more_than_two_controls_or_an_image_reference_are_refused(client: FlaskClient, redis: Redis) -> None:
    message = error_of(post_job(client, controlnets=[control()] * 3, **SMALL), 422, "invalid_request")
    assert "at most 2 items" in message
    reference = {"media_type": "image/png", "width": 64, "height": 64, "bytes": 1, "sha256": "0" * 64}
    response = post_job(client, controlnets=[control(image=reference)], **SMALL)
    assert "must be a data: URL" in error_of(response, 422, "invalid_request")
    assert response.get_json()["error"]["details"][0]["loc"] == ["controlnets", 0, "image"]
    assert nothing_stored(redis)


def test_a_flux_model_takes_no_controlnet_or_ip_adapter(settings: Settings, controlnet_dir: Path,
                                                        ip_adapter_dir: Path, redis: Redis) -> None:
    flux = settings.model_copy(update={"controlnet_dir": controlnet_dir, "model_names": "flux=flux",
                                       "model": "tiny-flux"})
    for client in app_client(flux.model_copy(update={"ip_adapter_dir": ip_adapter_dir})):
        response = post_job(client, controlnets=[control()], width=64, height=64, steps=2)
        assert "a flux model takes no ControlNet" in error_of(response, 422, "invalid_request")
        response = post_job(client, hires={"scale": 2}, width=64, height=64, steps=2)
        assert "send `lanczos`" in error_of(response, 422, "invalid_request")
        assert post_job(client, hires={"scale": 2, "upscaler": "lanczos"}, width=64, height=64,
                        steps=2).status_code == 202
        response = post_job(client, ip_adapter={"name": "plume", "image": data_url(start_image(64, 64))},
                            width=64, height=64, steps=2)
        assert "a flux model takes no IP-Adapter" in error_of(response, 422, "invalid_request")
        model = client.get("/v1/models").get_json()["models"][0]
        assert model["controlnets"] == model["ip_adapters"] == []  # the UNet families' only


# --- the hires pass ----------------------------------------------------------------------------------

def test_a_hires_job_counts_both_passes_in_its_progress_and_cost(client: FlaskClient, redis: Redis) -> None:
    response = post_job(client, hires={"scale": 2, "steps": 4, "denoise": 0.5}, width=64, height=64, steps=2)
    view = response.get_json()
    assert response.status_code == 202, view
    assert view["request"]["hires"] == {"scale": 2.0, "steps": 4, "denoise": 0.5, "upscaler": "latent"}
    request = JobRequest.model_validate(view["request"])
    assert (request.first_steps_run, request.hires_steps_run, request.steps_run) == (2, 2, 4)
    assert request.output_size() == (128, 128)
    # Two steps at 64x64 and two at 128x128, in units of a 512x512 step.
    assert request.cost == pytest.approx((2 * 64 * 64 + 2 * 128 * 128) / (512 * 512))
    assert JobRequest.pixels_of_batch_key(request.batch_key) == 128 * 128


@pytest.mark.parametrize("hires, expected", [
    ({"scale": 1.0}, "greater than 1"),
    ({"scale": 20}, "less than or equal to 4"),
    ({"scale": 4, "denoise": 0.5}, "over the service's 128"),
    ({"scale": 2, "steps": 3, "denoise": 0.2}, "run none"),
    ({"scale": 2, "steps": 500}, "at most 100"),
    ({"scale": 2, "upscaler": "esrgan"}, "'latent' or 'lanczos'"),
])
def test_a_hires_pass_out_of_bounds_is_refused(settings: Settings, redis: Redis, hires: dict[str, Any],
                                               expected: str) -> None:
    for client in app_client(settings.model_copy(update={"max_side": 128})):
        response = post_job(client, hires=hires, width=64, height=64, steps=2)
        assert expected in error_of(response, 422, "invalid_request")
    assert nothing_stored(redis)


def test_a_hires_pass_within_the_services_raised_limits_is_admitted(settings: Settings) -> None:
    """Above the defaults (100 steps, 1024 px) where the service allows it: its view too (it once
    checked the defaults again and answered 500 for a job it had admitted)."""
    for client in app_client(settings.model_copy(update={"max_side": 2048, "max_steps": 200})):
        response = post_job(client, hires={"scale": 2, "steps": 150}, width=1024, height=1024, steps=2)
        assert response.status_code == 202, response.get_json()
        view = client.get(f"/v1/jobs/{response.get_json()['id']}").get_json()
        assert view["request"]["hires"]["steps"] == 150 and view["request"]["width"] == 1024


def test_a_hires_pass_is_for_text_to_image(client: FlaskClient, redis: Redis) -> None:
    response = post_job(client, image=data_url(start_image(64, 64)), hires={"scale": 2}, steps=2)
    assert "a `hires` pass is for text-to-image" in error_of(response, 422, "invalid_request")
    assert nothing_stored(redis)


def test_the_batch_key_and_affinity_name_the_controls() -> None:
    image = {"media_type": "image/png", "width": 64, "height": 64, "bytes": 1, "sha256": "0" * 64}
    other = {**image, "sha256": "1" * 64}
    def request(**fields: Any) -> JobRequest:
        return JobRequest.model_validate({"prompt": "p", **SMALL, **fields})
    bare, chalk = request(), request(controlnets=[{"name": "chalk", "image": image}])
    assert bare.batch_key != chalk.batch_key and bare.affinity_key == ""
    # Other control images batch together; other settings do not.
    assert chalk.batch_key == request(controlnets=[{"name": "chalk", "image": other}]).batch_key
    assert chalk.batch_key != request(controlnets=[{"name": "chalk", "image": image, "scale": 0.5}]).batch_key
    edges = request(controlnets=[{"name": "chalk", "image": image, "preprocess": "canny"}])
    assert edges.batch_key != request(controlnets=[{"name": "chalk", "image": image, "preprocess": "canny",
                                                    "low": 50}]).batch_key
    assert chalk.affinity_key == "@chalk:1.0"
    assert request(loras=[{"name": "ink"}], controlnets=[{"name": "chalk", "image": image}]).affinity_key == (
        "ink:1.0,@chalk:1.0")
    assert request(hires={"scale": 2}).batch_key != bare.batch_key
    plume = request(ip_adapter={"name": "plume", "image": image})
    assert plume.affinity_key == "&plume:1.0" and plume.batch_key != bare.batch_key
    # Other reference images batch together (the worker masks each row's own); another scale does not.
    assert plume.batch_key == request(ip_adapter={"name": "plume", "image": other}).batch_key
    assert plume.batch_key != request(ip_adapter={"name": "plume", "image": image, "scale": 0.5}).batch_key
