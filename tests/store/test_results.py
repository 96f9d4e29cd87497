"""Result stores: images and inputs in a folder or an S3 bucket, Redis keeping only the records.

The S3 store runs against moto's server (``moto_server``, from PyPI): a real S3-compatible HTTP
server in a process of its own, but an emulator of S3, not S3 itself.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from pydantic import SecretStr
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from shared.contract import keys
from shared.contract.errors import ResultExpiredError
from shared.contract.settings import Settings
from shared.store import results
from shared.store.blobs import Blobs, Folder
from slotq.localredis import free_port
from tests.conftest import (
    DEADLINE_S,
    Process,
    app_client,
    data_url,
    post_job,
    start_worker,
    wait_for,
    wait_for_status,
)

BUCKET = "slotq-results"
api = contextmanager(app_client)  # an in-process API: `with api(settings) as client`
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="session")
def s3_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's S3 server on a free port, with the bucket made; its endpoint URL."""
    server = shutil.which("moto_server") or str(Path(__import__("sys").executable).with_name("moto_server"))
    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    process = subprocess.Popen([server, "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        assert process.poll() is None, "moto_server exited"
        try:
            with urllib.request.urlopen(url, timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # it answers, with an S3 error for the bare root
        except OSError:
            return False

    try:
        wait_for(answers, what="the S3 server")
        client = s3_client(url)
        client.create_bucket(Bucket=BUCKET)
        yield url
    finally:
        process.terminate()
        process.wait(10)
        log.close()


def s3_client(url: str) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


@pytest.fixture(params=["file", "s3"])
def store_values(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """The settings of a file store (a fresh folder) or an S3 store (a fresh prefix); a test may ask
    for Redis's too (none: the default)."""
    if request.param == "redis":
        return {}
    if request.param == "file":
        return {"result_store": f"file://{tmp_path / 'results'}", "sweep_grace_s": 0}
    url = request.getfixturevalue("s3_url")
    return {"result_store": f"s3://{BUCKET}/{tmp_path.name}", "s3_endpoint_url": url,
            "s3_region": "us-east-1", "s3_access_key_id": "testing",
            "s3_secret_access_key": SecretStr("testing"), "sweep_grace_s": 0}


def names(store: results.Results) -> list[str]:
    blobs: Blobs = store.blobs  # type: ignore[attr-defined]
    return sorted(name for name, _ in blobs.listing())


def test_objects_round_trip_and_go(settings: Settings, store_values: dict[str, Any]) -> None:
    store = results.of(settings.model_copy(update=store_values))
    blobs: Blobs = store.blobs  # type: ignore[attr-defined]
    store.check()
    blobs.put("images/j/a/0.png", PNG + b"one")
    blobs.put("images/j/a/0.png", PNG + b"two")  # replaced whole
    assert blobs.get("images/j/a/0.png") == PNG + b"two" and blobs.get("images/j/a/1.png") is None
    assert names(store) == ["images/j/a/0.png"]  # no partial write left beside it
    blobs.delete(["images/j/a/0.png"])
    assert names(store) == [] and blobs.get("images/j/a/0.png") is None


def test_an_unwritable_folder_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    from shared.contract.errors import StorageUnavailableError

    folder = Folder(tmp_path / "a-file" / "results")
    with pytest.raises(StorageUnavailableError, match="not writable"):
        folder.check()
    with pytest.raises(StorageUnavailableError, match="could not write"):
        folder.put("images/j/a/0.png", PNG)


def test_inputs_go_to_the_store_and_a_refusal_leaves_none(settings: Settings, redis: Redis,
                                                           store_values: dict[str, Any]) -> None:
    chosen = settings.model_copy(update={**store_values, "queue_capacity": 1})
    start = data_url(Image.new("RGB", (64, 64), "teal"))
    with api(chosen) as client:
        kept = post_job(client, image=start, steps=2)
        assert kept.status_code == 202, kept.get_json()
        refused = post_job(client, image=start, steps=2)
        assert refused.status_code == 429
        job_id = kept.get_json()["id"]
        store = results.of(chosen)
        assert names(store) == [f"inputs/{job_id}/image"]
        served = client.get(f"/v1/jobs/{job_id}/inputs/image")
        assert served.status_code == 200 and served.get_data() == __import__("base64").b64decode(
            start.partition(",")[2])
        assert redis.exists(f"slotq:inputs:{job_id}") == 0  # none of it in Redis


def stored(redis: Redis, job_id: str, status: str, ended_s_ago: float | None, attempt: str | None) -> Job:
    """A job record as RQ keeps it, ended that long ago, its images at that attempt."""
    job = Job.create("worker.tasks.generate", kwargs={"request": {"prompt": "p"}}, connection=redis,
                     id=job_id, serializer=JSONSerializer)
    job.meta = {"images": 1, "images_at": attempt} if attempt else {}
    job.save()
    fields: dict[str, str] = {"status": status}
    if ended_s_ago is not None:
        moment = time.gmtime(time.time() - ended_s_ago)
        fields["ended_at"] = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", moment)
    redis.hset(job.key, mapping=fields)
    return job


def test_the_sweep_keeps_what_live_records_name_and_nothing_else(settings: Settings, redis: Redis,
                                                                 store_values: dict[str, Any]) -> None:
    chosen = settings.model_copy(update={**store_values, "result_ttl_s": 60})
    store = results.of(chosen)
    blobs: Blobs = store.blobs  # type: ignore[attr-defined]
    stored(redis, "live", "finished", 5, "good")
    stored(redis, "old", "finished", 120, "good")
    stored(redis, "waiting", "queued", None, None)
    for name in ["images/live/good/0.png", "images/live/stale/0.png", "inputs/live/image",
                 "images/old/good/0.png", "inputs/old/image", "inputs/waiting/image",
                 "inputs/no-record/image", "images/no-record/x/0.png"]:
        blobs.put(name, PNG)
    assert store.sweep(redis) == 5
    # The recorded attempt's images and the inputs of live jobs stay; a stale attempt's images, an
    # expired job's and a job without a record go.
    assert names(store) == ["images/live/good/0.png", "inputs/live/image", "inputs/waiting/image"]


def round_trip_checkpoints(store: results.Results, redis: Redis) -> Job:
    """Two checkpoints of a running job, the second replacing the first; a stale attempt's write
    refused; the job's end deletes its record."""
    from shared.store.fencing import Fence, FencedRedis, StaleAttemptError, holding

    job = stored(redis, "resuming", "started", None, None)
    fenced = Job.fetch("resuming", connection=FencedRedis.from_url(store.settings.redis_url),
                       serializer=JSONSerializer)
    assert store.checkpoint(fenced) is None
    redis.set(keys.fence_key(job.id), "token-2")
    with holding(Fence(job.id, "token-2")):
        store.save_checkpoint(fenced, 3, b"at three")
        store.save_checkpoint(fenced, 7, b"at seven")
    with holding(Fence(job.id, "token-1")), pytest.raises(StaleAttemptError):
        store.save_checkpoint(fenced, 9, b"a stale attempt's")
    assert store.checkpoint(fenced) == (7, b"at seven")
    fenced.connection.close()
    return job


def test_a_step_checkpoint_in_redis_replaces_the_last_and_goes_with_the_jobs_end(settings: Settings,
                                                                                  redis: Redis) -> None:
    from shared.store import endings

    job = round_trip_checkpoints(results.of(settings), redis)
    with redis.pipeline() as pipe:
        endings.ended(pipe, settings.queue_name, job, 60)
        pipe.execute()
    assert not redis.exists(keys.checkpoint_key(job.id))


def test_a_step_checkpoint_in_the_store_is_kept_while_named_and_swept_after(
        settings: Settings, redis: Redis, store_values: dict[str, Any]) -> None:
    store = results.of(settings.model_copy(update=store_values))
    job = round_trip_checkpoints(store, redis)
    named = redis.hget(keys.checkpoint_key(job.id), "blob")
    assert named is not None and len(names(store)) == 3  # the stale write's object too, named by none
    assert store.sweep(redis) == 2 and names(store) == [named.decode()]
    redis.delete(keys.checkpoint_key(job.id))  # as the job's end does
    assert store.sweep(redis) == 1 and names(store) == []


def test_the_grace_spares_a_write_in_progress(settings: Settings, redis: Redis,
                                              store_values: dict[str, Any]) -> None:
    store = results.of(settings.model_copy(update={**store_values, "sweep_grace_s": 600}))
    store.blobs.put("images/being-written/a/0.png", PNG)  # type: ignore[attr-defined]
    assert store.sweep(redis) == 0 and names(store) == ["images/being-written/a/0.png"]


# --- A worker on a file store or a bucket -------------------------------------------------------------

@pytest.fixture
def store_worker(redis_url: str, model_cache: Path, store_values: dict[str, Any],
                 tmp_path: Path) -> Iterator[tuple[Settings, Process]]:
    """A worker of its own (Redis database 9) on the chosen store, sweeping every second."""
    settings = Settings(redis_url=redis_url.removesuffix("/0") + "/9", queue_name="store-tests",
                        queue_capacity=200, cache_dir=model_cache, drain_s=0, result_ttl_s=20,
                        sweep_interval_s=1, **store_values)
    with Redis.from_url(settings.redis_url) as connection:
        connection.flushdb()
    process = start_worker(settings, tmp_path / "worker.log")
    yield settings, process
    assert process.stop() == 0, process.output()


def values_of(connection: Redis, key: bytes) -> list[bytes]:
    """The values a string or a hash holds (the kinds a job's bytes could be in)."""
    kind = connection.type(key)
    if kind == b"string":
        return [connection.get(key) or b""]
    return list(connection.hvals(key)) if kind == b"hash" else []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_100_jobs_keep_no_image_bytes_in_redis_and_their_images_vanish_after_the_ttl(
        store_worker: tuple[Settings, Process]) -> None:
    settings, _ = store_worker
    store = results.of(settings)
    with api(settings) as client, Redis.from_url(settings.redis_url) as connection:
        ids = [post_job(client, width=64, height=64, steps=1, seed=n).get_json()["id"] for n in range(100)]
        views = [wait_for_status(client, job_id, "succeeded", timeout=120) for job_id in ids]
        # The last jobs to end first, the furthest from their TTL: on a busy machine 100 jobs take
        # long enough for the earlier ones' images to expire before they are read.
        for view in views[-5:]:
            job = Job.fetch(view["id"], connection=connection, serializer=JSONSerializer)
            written = store.blobs.get(f"images/{view['id']}/{job.meta['images_at']}/0.png")  # type: ignore[attr-defined]
            served = client.get(view["images"][0])
            assert served.status_code == 200 and served.get_data() == written and written.startswith(PNG)
        for key in connection.scan_iter(count=1000):
            assert (connection.memory_usage(key) or 0) <= 16 * 1024, key
            values = values_of(connection, key)
            assert not [value for value in values if PNG in (value or b"")], key  # no image bytes in Redis
        # Past the result TTL the sweep takes every image away, and the API says they expired.
        wait_for(lambda: not [name for name in names(store) if name.startswith("images/")],
                 timeout=settings.result_ttl_s + DEADLINE_S, what="the sweep to take the expired images")
        gone = client.get(views[0]["images"][0])
        assert gone.status_code == 410 and gone.get_json()["error"]["code"] == "expired"


@pytest.mark.slow
def test_a_store_that_cannot_be_written_fails_the_job_after_its_attempts(
        redis_url: str, model_cache: Path, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a folder")
    settings = Settings(redis_url=redis_url.removesuffix("/0") + "/9", queue_name="store-tests",
                        cache_dir=model_cache, drain_s=0, max_attempts=2, worker_metrics_port=free_port(),
                        result_store=f"file://{tmp_path / 'a-file' / 'results'}")
    with Redis.from_url(settings.redis_url) as connection:
        connection.flushdb()
    worker = start_worker(settings, tmp_path / "worker.log")
    try:
        with api(settings) as client:
            ready = client.get("/readyz")
            assert ready.status_code == 503 and ready.get_json()["error"]["code"] == "storage_unavailable"
            job_id = post_job(client, width=64, height=64, steps=1).get_json()["id"]
            view = wait_for_status(client, job_id, "failed", timeout=90)
            assert view["error"]["code"] == "storage_unavailable" and view["attempt"] == 2, view
            # Ended once: counted once, one final event.
            with Redis.from_url(settings.redis_url) as connection:
                counts = [connection.hget(key, "failed") for key in connection.scan_iter(keys.ended_key("*"))]
                events = [entry[b"event"] for _, entry in connection.xrange(keys.log_key(job_id))]
            assert counts == [b"1"], counts
            assert events.count(b"failed") == 1, events
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(f"http://127.0.0.1:{settings.worker_metrics_port}/readyz", timeout=5)
        assert answer.value.code == 503
        assert json.loads(answer.value.read())["error"]["code"] == "storage_unavailable"
    finally:
        assert worker.stop() == 0, worker.output()


@pytest.mark.slow
def test_a_worker_killed_between_the_image_write_and_the_record_loses_no_job_and_leaves_no_orphan(
        redis_url: str, model_cache: Path, tmp_path: Path) -> None:
    settings = Settings(redis_url=redis_url.removesuffix("/0") + "/9", queue_name="store-tests",
                        cache_dir=model_cache, drain_s=0, heartbeat_ttl_s=2, fault_injection=True,
                        result_store=f"file://{tmp_path / 'results'}", sweep_interval_s=1, sweep_grace_s=1)
    with Redis.from_url(settings.redis_url) as connection:
        connection.flushdb()
    store = results.of(settings)
    first = start_worker(settings, tmp_path / "first.log", worker_name="first")
    with api(settings) as client:
        job_id = post_job(client, prompt="__kill_after_store__ once", width=64, height=64,
                          steps=1).get_json()["id"]
        assert first.popen.wait(DEADLINE_S) == -signal.SIGKILL  # the fault killed it mid-store
        orphans = [name for name in names(store) if name.startswith(f"images/{job_id}/")]
        assert orphans, "the first attempt wrote its image before it died"
        second = start_worker(settings, tmp_path / "second.log", worker_name="second")
        try:
            view = wait_for_status(client, job_id, "succeeded", timeout=90)
            assert view["attempt"] == 2
            with Redis.from_url(settings.redis_url) as connection:
                record = Job.fetch(job_id, connection=connection, serializer=JSONSerializer)
            attempt = record.meta["images_at"]
            # The first attempt's image is swept; the one the record names stays and is served.
            wait_for(lambda: names(store) == [f"images/{job_id}/{attempt}/0.png"], what="the orphan swept")
            assert client.get(view["images"][0]).get_data().startswith(PNG)
        finally:
            assert second.stop() == 0, second.output()


def test_a_presigned_download_redirects_to_the_bucket(settings: Settings, redis: Redis, s3_url: str) -> None:
    chosen = Settings(**(settings.model_dump() | {
        "result_store": f"s3://{BUCKET}/presigned", "s3_endpoint_url": s3_url, "s3_region": "us-east-1",
        "s3_access_key_id": "testing", "s3_secret_access_key": "testing", "s3_presign": True}))
    with api(chosen) as client:
        job_id = post_job(client, width=64, height=64, steps=1).get_json()["id"]
        job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
        png = PNG + b"the bucket's own bytes"
        results.of(chosen).save_images(job, [png])
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        redis.hset(job.key, mapping={"status": "finished", "ended_at": now})  # as if it had run
        answer = client.get(f"/v1/jobs/{job_id}/images/0")
        assert answer.status_code == 307, answer.get_data()
        location = answer.headers["Location"]
        assert location.startswith(f"{s3_url}/{BUCKET}/presigned/images/{job_id}/")
        assert "Signature" in location
        with urllib.request.urlopen(location, timeout=10) as fetched:
            assert fetched.read() == png
        # Without presigning the same image streams through the API.
        plain = chosen.model_copy(update={"s3_presign": False})
        with api(plain) as streaming:
            assert streaming.get(f"/v1/jobs/{job_id}/images/0").get_data() == png


@pytest.mark.parametrize("store_values", ["redis", "file", "s3"], indirect=True)
def test_a_clips_mp4_is_kept_beside_its_poster_and_goes_with_it(settings: Settings, redis: Redis,
                                                               store_values: dict[str, Any]) -> None:
    chosen = settings.model_copy(update={**store_values, "result_ttl_s": 60})
    store, mp4 = results.of(chosen), b"\x00\x00\x00\x20ftypisom" + b"the clip"
    job = Job.create("worker.tasks.generate", kwargs={"request": {"prompt": "p", "frames": 9, "fps": 8}},
                     connection=redis, id="clip", serializer=JSONSerializer)
    job.save()
    store.save_images(job, [PNG + b"poster"], video=mp4)
    redis.hset(job.key, mapping={"status": "finished", "ended_at": time.strftime(
        "%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())})
    job = Job.fetch("clip", connection=redis, serializer=JSONSerializer)
    assert store.video(job) == mp4 and store.image(job, 0) == PNG + b"poster"
    assert job.meta["images"] == 1  # the poster; the clip is no image
    if store.in_redis:
        assert redis.hget(keys.images_key("clip"), "video.mp4") == mp4
        return
    attempt = job.meta["images_at"]
    assert names(store) == [f"images/clip/{attempt}/0.png", f"images/clip/{attempt}/video.mp4"]
    # Past the result TTL the sweep takes both, and the API's read says the clip expired.
    moment = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime(time.time() - 120))
    redis.hset(job.key, "ended_at", moment)
    assert store.sweep(redis) == 2 and names(store) == []
    with pytest.raises(ResultExpiredError):
        store.video(Job.fetch("clip", connection=redis, serializer=JSONSerializer))
