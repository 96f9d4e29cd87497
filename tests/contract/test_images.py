"""Image inputs at the door (shared/contract/images.py, the API's checks and routes): in-process, on a
real Redis, no worker. What the worker makes of them is tests/worker/test_main.py's and test_families.py's."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import struct
import zlib
from typing import Any

import pytest
from flask.testing import FlaskClient
from PIL import Image
from redis import Redis

from shared.contract import keys
from shared.contract.settings import Settings
from tests.conftest import app_client, box_mask, data_url, post_job, start_image, wait_for, waiting_ids


def error_of(response: Any, status: int, code: str) -> str:
    """The refusal's message (with its details' messages), once its status and code are the expected ones."""
    body = response.get_json()
    assert response.status_code == status, body
    assert body["error"]["code"] == code, body
    details = [detail["msg"] for detail in body["error"].get("details", [])]
    return " ".join([body["error"]["message"], *details])


def raw_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def png_bomb(width: int, height: int) -> bytes:
    """A small PNG whose header declares width x height pixels (a decompression bomb's shape)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    rows = zlib.compress(b"\0" * 1024)  # a few rows' worth: the file is small, the image is not
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def animated_gif() -> bytes:
    frames = [Image.new("P", (64, 64), color) for color in (1, 2)]
    buffer = io.BytesIO()
    frames[0].save(buffer, "GIF", save_all=True, append_images=frames[1:], duration=100)
    return buffer.getvalue()


def animated_png() -> bytes:
    frames = [Image.new("RGB", (64, 64), color) for color in ("red", "blue")]
    buffer = io.BytesIO()
    frames[0].save(buffer, "PNG", save_all=True, append_images=frames[1:])
    return buffer.getvalue()


def nothing_stored(redis: Redis) -> bool:
    """No job, no input, no place in line: what a refused submit leaves (the fixture flushed the db)."""
    return [key for key in redis.keys("*") if not key.startswith(b"slotq:ended:")] == []


# --- accepted --------------------------------------------------------------------------------------

def test_an_image_job_takes_its_size_from_the_image_and_shows_a_reference(client: FlaskClient,
                                                                         redis: Redis) -> None:
    image = png_bytes(start_image(192, 128))
    response = post_job(client, image=raw_url(image), strength=0.5, steps=10)
    assert response.status_code == 202, response.get_json()
    view = response.get_json()
    request = view["request"]
    assert (request["width"], request["height"], request["strength"]) == (192, 128, 0.5)
    assert request["image"] == {"media_type": "image/png", "width": 192, "height": 128, "bytes": len(image),
                                "sha256": hashlib.sha256(image).hexdigest()}
    assert request["mask"] is None
    assert "base64" not in json.dumps(view)  # the view never carries the bytes
    assert "base64" not in json.dumps(client.get(f"/v1/jobs/{view['id']}").get_json())
    assert view["progress"] is None and waiting_ids(redis, client.application.extensions["slotq.settings"]) \
        == [view["id"]]
    # The stored record is small: the bytes live beside it, not in the job's hash.
    assert image not in b"".join(redis.hvals(f"rq:job:{view['id']}"))
    assert redis.ttl(keys.inputs_key(view["id"])) == -1  # kept while the job waits, whatever it takes

    fetched = client.get(f"/v1/jobs/{view['id']}/inputs/image")
    assert (fetched.status_code, fetched.mimetype, fetched.data) == (200, "image/png", image)
    assert error_of(client.get(f"/v1/jobs/{view['id']}/inputs/mask"), 404, "not_found")
    assert client.get(f"/v1/jobs/{view['id']}/inputs/other").status_code == 404


def test_an_inpainting_job_keeps_its_mask_and_both_expire_with_the_job(client: FlaskClient, redis: Redis,
                                                                       settings: Settings) -> None:
    mask = png_bytes(box_mask(128, 128).convert("RGB"))
    jpeg = io.BytesIO()
    start_image(128, 128).save(jpeg, "JPEG")
    view = post_job(client, image=raw_url(jpeg.getvalue(), "image/jpeg"), mask=raw_url(mask)).get_json()
    assert view["request"]["image"]["media_type"] == "image/jpeg"
    assert view["request"]["mask"]["sha256"] == hashlib.sha256(mask).hexdigest()
    assert client.get(f"/v1/jobs/{view['id']}/inputs/image").mimetype == "image/jpeg"
    assert client.get(f"/v1/jobs/{view['id']}/inputs/mask").data == mask

    assert client.delete(f"/v1/jobs/{view['id']}").status_code == 200
    # Canceled: the inputs stay as long as the job's images would (SLOTQ_RESULT_TTL_S).
    assert 0 < redis.ttl(keys.inputs_key(view["id"])) <= settings.result_ttl_s
    assert client.get(f"/v1/jobs/{view['id']}/inputs/mask").data == mask


def test_an_expired_job_keeps_its_inputs_for_the_result_ttl(client: FlaskClient, redis: Redis,
                                                            settings: Settings) -> None:
    view = post_job(client, image=data_url(start_image(64, 64)), deadline_s=0.05).get_json()
    wait_for(lambda: client.get(f"/v1/jobs/{view['id']}").get_json()["status"] == "expired",
             what="the job to expire")
    assert 0 < redis.ttl(keys.inputs_key(view["id"])) <= settings.result_ttl_s


def test_the_same_image_with_the_same_key_replays_the_job(client: FlaskClient) -> None:
    body = json.dumps({"prompt": "again", "image": data_url(start_image(64, 64))})
    headers = {"Idempotency-Key": "img-1"}
    first = client.post("/v1/jobs", data=body, content_type="application/json", headers=headers)
    again = client.post("/v1/jobs", data=body, content_type="application/json", headers=headers)
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.get_json()["id"] == first.get_json()["id"]
    other = json.dumps({"prompt": "again", "image": data_url(start_image(64, 64, seed=1))})
    conflict = client.post("/v1/jobs", data=other, content_type="application/json", headers=headers)
    assert error_of(conflict, 409, "idempotency_conflict")


def test_given_sides_must_be_the_images(client: FlaskClient, redis: Redis) -> None:
    url = data_url(start_image(128, 64))
    assert post_job(client, image=url, width=128, height=64).status_code == 202
    redis.flushdb()
    message = error_of(post_job(client, image=url, width=256), 422, "invalid_image")
    assert "`width` is 256 but the image's is 128" in message
    assert nothing_stored(redis)


# --- refused, each with nothing left behind ---------------------------------------------------------

HOSTILE = {
    "not an image": (raw_url(b"this is not a picture at all"), "could not be read"),
    "a PNG bomb": (raw_url(png_bomb(30_000, 30_000)), "over 1048576 pixels"),
    "a smaller PNG bomb": (raw_url(png_bomb(4096, 4096)), "4096x4096: over 1048576 pixels"),
    "a truncated PNG": (raw_url(png_bytes(start_image(64, 64))[:300]), "could not be read"),
    "an animated GIF": (raw_url(animated_gif(), "image/gif"), "image/gif; send PNG, JPEG or WebP"),
    "an animated PNG": (raw_url(animated_png()), "animated"),
    "a side that is no multiple of 8": (data_url(start_image(100, 100)), "100x100: its sides must be"),
    "too small": (data_url(start_image(32, 64)), "between 64 and 1024"),
    "bad base64": ("data:image/png;base64,iVBOR!!", "not valid base64"),
    "no data URL": ("https://example.com/cat.png", "must be a data: URL"),
    "a WebP that is a PNG": (raw_url(png_bytes(start_image(64, 64)), "image/webp"), "could not be read"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_image_is_refused_cleanly(client: FlaskClient, redis: Redis, case: str) -> None:
    url, expected = HOSTILE[case]
    assert expected in error_of(post_job(client, image=url), 422, "invalid_image")
    assert nothing_stored(redis)


def test_a_mask_of_another_size_is_refused(client: FlaskClient, redis: Redis) -> None:
    response = post_job(client, image=data_url(start_image(128, 128)), mask=data_url(box_mask(64, 64)))
    assert "`mask` is 64x64 and the image 128x128" in error_of(response, 422, "invalid_image")
    assert nothing_stored(redis)


def test_a_mask_without_an_image_is_refused(client: FlaskClient, redis: Redis) -> None:
    response = post_job(client, mask=data_url(box_mask(64, 64)))
    assert "needs an `image`" in error_of(response, 422, "invalid_request")
    assert nothing_stored(redis)


def test_an_input_that_is_no_string_is_refused(client: FlaskClient, redis: Redis) -> None:
    # A reference as a view shows it cannot stand in for the bytes.
    reference = {"media_type": "image/png", "width": 64, "height": 64, "bytes": 1, "sha256": "0" * 64}
    assert "must be a data: URL" in error_of(post_job(client, image=reference), 422, "invalid_request")
    assert "must be a data: URL" in error_of(post_job(client, image=[1]), 422, "invalid_request")
    assert nothing_stored(redis)


def test_a_strength_that_runs_no_step_is_refused(client: FlaskClient, redis: Redis) -> None:
    url = data_url(start_image(64, 64))
    assert "run none" in error_of(post_job(client, image=url, steps=3, strength=0.2), 422, "invalid_request")
    assert error_of(post_job(client, image=url, strength=0), 422, "invalid_request")
    assert error_of(post_job(client, image=url, strength=1.5), 422, "invalid_request")
    assert nothing_stored(redis)


def test_an_image_over_the_byte_limit_is_refused(settings: Settings, redis: Redis) -> None:
    small = settings.model_copy(update={"max_image_bytes": 2048})
    url = data_url(start_image(64, 64))  # noise: far over 2 KiB as PNG
    for client in app_client(small):
        assert "over 2048 bytes" in error_of(post_job(client, image=url), 422, "invalid_image")
    assert nothing_stored(redis)


def test_a_20_mb_body_is_refused_with_413(client: FlaskClient, redis: Redis) -> None:
    body = json.dumps({"prompt": "big", "image": raw_url(b"\0" * (15 * 2**20))})
    assert len(body) > 20 * 10**6
    response = client.post("/v1/jobs", data=body, content_type="application/json")
    assert error_of(response, 413, "payload_too_large")
    assert nothing_stored(redis)


def test_a_refusal_for_a_full_line_stores_no_input(client: FlaskClient, redis: Redis,
                                                   settings: Settings) -> None:
    url = data_url(start_image(64, 64))
    admitted = [post_job(client, image=url).get_json()["id"] for _ in range(settings.queue_capacity)]
    assert error_of(post_job(client, image=url), 429, "queue_full")
    assert sorted(redis.keys(keys.inputs_key("*"))) == sorted(keys.inputs_key(i).encode() for i in admitted)


def test_an_image_job_costs_the_steps_it_runs(settings: Settings, redis: Redis) -> None:
    keyed = Settings(**(settings.model_dump() | {"api_keys": {"k": {"tenant": "t", "rate": 1, "burst": 10}}}))
    headers = {"Authorization": "Bearer k"}
    url = data_url(start_image(512, 512))
    for client in app_client(keyed):
        def submit(client: FlaskClient = client, **body: Any) -> Any:
            return client.post("/v1/jobs", data=json.dumps({"prompt": "p", **body}),
                               content_type="application/json", headers=headers)

        # 16 steps of a 512x512 image cost 16 units, over the burst of 10; at strength 0.5, 8 run.
        assert error_of(submit(width=512, height=512, steps=16), 422, "invalid_request")
        assert submit(image=url, steps=16, strength=0.5).status_code == 202
        assert "rate_limited" == submit(image=url, steps=16, strength=0.5).get_json()["error"]["code"]


def test_the_steps_that_run_are_read_from_a_stored_request_whatever_the_limits() -> None:
    from shared.store.records import steps_run_of

    # SLOTQ_MAX_STEPS=200 and SLOTQ_MAX_SIDE=2048 admit this; the progress's total must not depend on it.
    large = {"prompt": "p", "width": 2048, "height": 2048, "steps": 150, "strength": 0.8, "image": None}
    assert steps_run_of(large) == 150
    reference = {"media_type": "image/png", "width": 2048, "height": 2048, "bytes": 1, "sha256": "0" * 64}
    assert steps_run_of({**large, "image": reference, "strength": 0.5}) == 75
    assert steps_run_of({"prompt": "p"}) is None and steps_run_of({**large, "steps": "150"}) is None
