"""worker/finisher.py: a batch's ends are recorded in one fenced transaction, and a stale member
sends the batch down the one-by-one path, where it alone is dropped."""

from __future__ import annotations

import io
import json
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from flask.testing import FlaskClient
from PIL import Image
from redis import Redis
from rq.job import Job

from shared.contract import keys
from shared.contract.jobs import JobRequest, Outcome
from shared.contract.settings import Settings
from shared.store import records
from shared.store.claims import Claims
from shared.store.connection import job_queue
from shared.store.fencing import Fence, FencedPipeline, connect_worker, holding
from tests.conftest import post_job
from worker.finisher import Finishing
from worker.messages import Batch, Work, encode_png

NAME = "finisher-test"


@pytest.fixture
def finishing(settings: Settings) -> Iterator[Finishing]:
    """The finishing side of a worker that has registered and holds nothing yet."""
    connection = connect_worker(settings)
    side = Finishing(job_queue(connection, settings), settings, NAME)
    side.register_birth()
    yield side
    connection.close()


def started_batch(client: FlaskClient, finishing: Finishing, count: int) -> Batch:
    """``count`` jobs admitted, claimed, fenced and started as the worker does, with their images."""
    for seed in range(count):
        post_job(client, width=64, height=64, steps=1, seed=seed)
    claims = Claims(finishing.queue, finishing.settings, NAME)
    claimed = [claims.claim(1.0) for _ in range(count)]
    jobs, fences = [], []
    for each in claimed:
        assert each is not None and each.token  # the claim started the attempt
        job = Job(each.job_id, connection=finishing.connection, serializer=finishing.serializer)
        job.restore(each.record)
        jobs.append(job)
        fences.append(Fence(each.job_id, each.token))
    with holding(*fences), finishing.connection.pipeline() as pipe:
        for job in jobs:
            records.begin_attempt(job)
        executions = finishing.start(jobs, pipe)
        pipe.execute()
    works = [Work.of(job, execution, fence, (JobRequest.model_validate(job.kwargs["request"]),
                                              [Image.new("RGB", (64, 64), (seed, 0, 0))]))
             for seed, (job, execution, fence) in enumerate(zip(jobs, executions, fences, strict=True))]
    return Batch(works, running="", cost=1.0, seconds=0.1, line=finishing.settings.line)


@pytest.fixture
def transactions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many commands each fenced transaction the finishing side runs holds, in order."""
    counted: list[int] = []
    execute = FencedPipeline.execute

    def counting(self: FencedPipeline, raise_on_error: bool = True) -> Any:
        if self.command_stack:
            counted.append(len(self.command_stack))
        return execute(self, raise_on_error)

    monkeypatch.setattr(FencedPipeline, "execute", counting)
    return counted


def test_a_batch_ends_in_one_fenced_transaction(client: FlaskClient, finishing: Finishing, redis: Redis,
                                                transactions: list[int],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    batch = started_batch(client, finishing, 3)
    transactions.clear()  # the start's
    watched: list[tuple[Any, ...]] = []
    watch = FencedPipeline.watch
    monkeypatch.setattr(FencedPipeline, "watch",
                        lambda self, *names: watched.append(names) or watch(self, *names))
    ended = finishing.finish(batch)
    assert watched == []  # one round trip: fenced.lua runs the ends' writes too, no WATCH … EXEC
    assert [end.outcome for end in ended] == [Outcome.SUCCEEDED] * 3
    assert len(transactions) == 1 and transactions[0] > 3 * 10  # images, RQ's success, the settling
    for work in batch.works:
        view = client.get(f"/v1/jobs/{work.job_id}").get_json()
        assert view["status"] == "succeeded" and view["progress"] == {"step": 1, "total": 1}
        assert client.get(view["images"][0]).data.startswith(b"\x89PNG")
        assert redis.exists(keys.fence_key(work.job_id)) == 0  # the attempt is over
    assert redis.llen(keys.claims_key(NAME)) == 0
    assert redis.hget(keys.ended_key(finishing.queue.name), "succeeded") == b"3"
    assert redis.zcard(finishing.queue.started_job_registry.key) == 0  # RQ's: nothing runs
    assert len(finishing.queue.finished_job_registry.get_job_ids()) == 3


def test_a_stale_member_sends_the_batch_one_by_one_and_is_the_only_one_dropped(
        client: FlaskClient, finishing: Finishing, redis: Redis, transactions: list[int]) -> None:
    batch = started_batch(client, finishing, 3)
    stale = batch.works[1].job_id
    redis.delete(keys.fence_key(stale))  # recovered by another worker meanwhile
    transactions.clear()
    ended = finishing.finish(batch)
    assert [end.outcome for end in ended] == [Outcome.SUCCEEDED, Outcome.SUPERSEDED, Outcome.SUCCEEDED]
    assert len(transactions) > 1  # the batch's transaction was refused, then each job's own ran
    assert client.get(f"/v1/jobs/{stale}").get_json()["status"] == "running"  # untouched by this attempt
    assert redis.exists(keys.images_key(stale)) == 0
    assert redis.hget(keys.ended_key(finishing.queue.name), "succeeded") == b"2"


@pytest.mark.parametrize("level", [0, 1, 9])
def test_the_pngs_are_compressed_at_the_set_level_and_lossless(client: FlaskClient, settings: Settings,
                                                                level: int) -> None:
    connection, leveled = connect_worker(settings), settings.model_copy(update={"png_compress_level": level})
    side = Finishing(job_queue(connection, settings), leveled, NAME)
    side.register_birth()
    (work,) = started_batch(client, side, 1).works
    side.finish(Batch([work], running="", cost=1.0, seconds=0.1, line=settings.line))
    png = client.get(f"/v1/jobs/{work.job_id}/images/0").data
    raw = 64 * 64 * 3  # a flat colour: zlib's level 0 stores it, 9 shrinks it to almost nothing
    assert (len(png) > raw) if level == 0 else (len(png) < raw // 20)
    with Image.open(io.BytesIO(png)) as image:
        assert image.convert("RGB").getpixel((5, 5)) == (0, 0, 0)
    connection.close()


def test_level_1_matches_runs_and_makes_a_photograph_smaller_than_zlib_s_usual_level_1() -> None:
    # A photograph's stand-in: a smooth gradient with sensor-like noise, as a diffusion model's
    # images are smooth with fine texture (not the tiny model's noise, which nothing compresses).
    rows, columns = np.mgrid[0:256, 0:256]
    noise = np.random.default_rng(0).normal(0, 6, (256, 256, 3))
    pixels = np.clip((rows * 0.6 + columns * 0.3)[..., None] + [20, 60, 100] + noise, 0, 255).astype(np.uint8)
    image, request = Image.fromarray(pixels), JobRequest(prompt="a gradient")
    png = encode_png(image, request, 1)
    usual = io.BytesIO()
    image.save(usual, format="PNG", compress_level=1, compress_type=zlib.Z_DEFAULT_STRATEGY)
    assert len(png) < 0.95 * len(usual.getvalue())  # measured: 0.90, the text chunk included
    with Image.open(io.BytesIO(png)) as decoded:
        assert (np.asarray(decoded.convert("RGB")) == pixels).all()
        assert json.loads(decoded.info["parameters"])["prompt"] == "a gradient"
