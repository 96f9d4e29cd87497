"""Live previews: latents painted per family off the GPU section, stored fenced, streamed and served."""

from __future__ import annotations

import base64
import io
import json
import signal
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderTiny, FluxPipeline
from flask.testing import FlaskClient
from PIL import Image
from redis import Redis
from rq.job import Job

from shared.contract import keys
from shared.store import records
from tests.api.test_streams import open_stream
from tests.conftest import Process, post_job
from worker import previews
from worker.previews import Cadence, Previewer, load_decoder


def decoded(url: str) -> Image.Image:
    """A preview's data: URL as the picture it holds (raises unless it is a JPEG)."""
    head, _, payload = url.partition(",")
    assert head == "data:image/jpeg;base64", head
    picture = Image.open(io.BytesIO(base64.b64decode(payload)))
    assert picture.format == "JPEG"
    return picture


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_cadence_gives_the_first_step_then_one_per_interval_and_never_the_last() -> None:
    clock = Clock()
    cadence = Cadence(0.5, clock)
    assert not cadence.due(0, 10)  # before any denoising: nothing to show
    assert cadence.due(1, 10)
    clock.now = 0.4
    assert not cadence.due(2, 10)
    clock.now = 0.5
    assert cadence.due(3, 10)
    clock.now = 5.0
    assert not cadence.due(10, 10)  # the image itself comes next
    assert Cadence(0.5, clock).due(1, 2) and not Cadence(0.5, clock).due(1, 1)


def test_unpack_is_the_inverse_of_diffusers_flux_packing() -> None:
    # FluxPipeline._pack_latents is private: this fails plainly if diffusers changes the layout.
    latent = torch.randn(2, 16, 8, 12)
    packed = FluxPipeline._pack_latents(latent, 2, 16, 8, 12)
    unpacked = previews.unpack(packed.numpy(), width=96, height=64, vae_scale_factor=8)
    assert (unpacked == latent.numpy()).all()


@pytest.mark.parametrize(("family", "shape"), [("sd", (2, 4, 8, 8)), ("sdxl", (2, 4, 8, 8)),
                                               ("flux", (2, 16, 8, 8)), ("sd", (2, 6, 8, 8))])
def test_each_family_paints_a_small_picture(family: str, shape: tuple[int, ...]) -> None:
    previewer = Previewer(family, 8)  # type: ignore[arg-type]
    latents = torch.randn(*shape)
    pictures = previewer.paint(latents, 64, 64)
    assert [picture.size for picture in pictures] == [(64, 64), (64, 64)]
    # Different latents, different pictures: the map is applied, not a constant.
    assert pictures[0].tobytes() != pictures[1].tobytes()
    assert decoded(previews.data_url(pictures[0])).size == (64, 64)


def test_a_large_image_gets_a_preview_of_at_most_256_px_in_its_aspect() -> None:
    previewer = Previewer("flux", 8)
    packed = FluxPipeline._pack_latents(torch.randn(1, 16, 96, 128), 1, 16, 96, 128)
    (picture,) = previewer.paint(packed, width=1024, height=768)
    assert picture.size == (256, 192)


def test_a_tiny_decoder_on_disk_paints_instead_of_the_linear_map(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tiny = AutoencoderTiny(encoder_block_out_channels=(4, 4, 4, 4), decoder_block_out_channels=(4, 4, 4, 4),
                           num_encoder_blocks=(1, 1, 1, 1), num_decoder_blocks=(1, 1, 1, 1))
    tiny.save_pretrained(tmp_path / "taesd")
    decoder = load_decoder(tmp_path / "taesd", torch.device("cpu"), torch.float32)
    latents = torch.randn(1, 4, 8, 8)
    by_decoder = Previewer("sd", 8, decoder).paint(latents, 64, 64)[0]
    by_map = Previewer("sd", 8).paint(latents, 64, 64)[0]
    assert by_decoder.size == (64, 64) and by_decoder.tobytes() != by_map.tobytes()


def stored_job(redis: Redis, job_id: str) -> Job:
    job = Job.create("worker.tasks.generate", kwargs={"request": {"prompt": "p", "previews": True}},
                     connection=redis, id=job_id, origin="api-tests")
    job.save()
    return job


def test_a_stale_attempt_stores_no_preview(redis: Redis) -> None:
    current, stale = stored_job(redis, "current"), stored_job(redis, "stale")
    redis.set(keys.fence_key("current"), "token-now")
    redis.set(keys.fence_key("stale"), "token-of-a-newer-attempt")
    url = previews.data_url(Image.new("RGB", (8, 8), "red"))
    written = records.report_preview([current, stale], ["token-now", "token-of-old"], 3, [url, url])
    assert written == 1
    assert json.loads(redis.get(keys.preview_key("current")) or b"") == {"step": 3, "image": url}
    assert redis.get(keys.preview_key("stale")) is None and redis.xlen(keys.log_key("stale")) == 0
    ((_, fields),) = redis.xrange(keys.log_key("current"))
    # The log holds the step only: image bytes stay in the one preview key.
    assert fields == {b"event": b"preview", b"data": b'{"step":3}'}
    assert 0 < redis.pttl(keys.preview_key("current")) <= keys.PREVIEW_TTL_MS


def test_a_job_with_previews_streams_them_and_serves_the_latest(worker_client: FlaskClient) -> None:
    response = post_job(worker_client, steps=60, width=256, height=256, previews=True)
    job_id = response.get_json()["id"]
    reader = open_stream(worker_client, job_id)
    frames = []
    while (frame := reader.next()) is not None:
        frames.append(frame)
        if frame[1] == "preview":
            break
    assert frame is not None, [event for _, event, _ in frames]
    _, _, data = frame
    assert 1 <= data["step"] < 60 and decoded(data["image"]).size == (256, 256)
    assert "started" in [event for _, event, _ in frames]  # a preview comes once it runs
    # The job runs for seconds yet: its latest preview is served as JPEG.
    served = worker_client.get(f"/v1/jobs/{job_id}/preview")
    assert served.status_code == 200 and served.mimetype == "image/jpeg", served.get_data()
    assert Image.open(io.BytesIO(served.get_data())).size == (256, 256)
    assert int(served.headers["Preview-Step"]) >= data["step"]
    assert worker_client.get(f"/v1/jobs/{job_id}").get_json()["preview"] == f"/v1/jobs/{job_id}/preview"
    assert worker_client.delete(f"/v1/jobs/{job_id}").status_code in (200, 202)
    while (frame := reader.next()) is not None:
        frames.append(frame)
    assert frames[-1][1] == "canceled"
    gone = worker_client.get(f"/v1/jobs/{job_id}/preview")
    assert gone.status_code == 409 and gone.get_json()["error"]["code"] == "no_preview"


def test_a_client_reading_only_the_stream_sees_the_whole_job(worker_client: FlaskClient,
                                                             worker: Process) -> None:
    worker.popen.send_signal(signal.SIGSTOP)  # so that the stream opens while the job waits
    try:
        job_id = post_job(worker_client, steps=4, width=64, height=64, previews=True).get_json()["id"]
        reader = open_stream(worker_client, job_id)
        first = reader.next()
    finally:
        worker.popen.send_signal(signal.SIGCONT)
    assert first is not None and first[1] == "queued" and first[2]["status"] == "queued"
    frames = [first]
    while (frame := reader.next()) is not None:
        frames.append(frame)
    events = [event for _, event, _ in frames]
    assert events[1] == "started" and events[-1] == "succeeded"
    steps = [data["step"] for _, event, data in frames if event == "progress"]
    assert steps == sorted(set(steps)) and steps[0] == 0 and steps[-1] == 4
    previews = [data for _, event, data in frames if event == "preview"]
    assert previews and all(1 <= data["step"] < 4 for data in previews)
    assert decoded(previews[0]["image"]).size == (64, 64)
    # Every preview comes while it runs: after the start, before the end.
    assert events.index("started") < events.index("preview") < events.index("succeeded")
    assert len({event_id for event_id, _, _ in frames}) == len(frames)  # each event once


def test_every_job_of_two_steps_gets_a_preview_before_its_end(worker_client: FlaskClient) -> None:
    job_id = post_job(worker_client, steps=2, width=64, height=64, previews=True).get_json()["id"]
    reader = open_stream(worker_client, job_id)
    events = []
    while (frame := reader.next()) is not None:
        events.append(frame[1])
    assert "preview" in events and events.index("preview") < events.index("succeeded") == len(events) - 1


def test_a_job_without_previews_has_none(worker_client: FlaskClient) -> None:
    job_id = post_job(worker_client, steps=4, width=64, height=64).get_json()["id"]
    reader = open_stream(worker_client, job_id)
    events = []
    while (frame := reader.next()) is not None:
        events.append(frame[1])
    assert events[-1] == "succeeded" and "preview" not in events
    answer = worker_client.get(f"/v1/jobs/{job_id}/preview")
    assert answer.status_code == 409 and answer.get_json()["error"]["code"] == "no_preview"
    assert "without" in answer.get_json()["error"]["message"]


def test_previews_must_be_a_boolean(client: FlaskClient) -> None:
    response = post_job(client, previews="yes")
    assert response.status_code == 422 and response.get_json()["error"]["code"] == "invalid_request"

