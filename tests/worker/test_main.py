"""The real worker with the tiny diffusers model: lifecycle, images, determinism, cancel, failure."""

from __future__ import annotations

import io
import math
import re
import subprocess
import threading
from dataclasses import replace
from pathlib import Path

import numpy
import pytest
from flask.testing import FlaskClient
from PIL import Image
from redis import Redis

from shared.contract import keys
from shared.contract.jobs import JobRequest
from shared.contract.models import UNET_SCHEDULERS
from shared.contract.settings import Settings
from tests.conftest import Process, post_job, wait_for, wait_for_status
from worker import progress


def run_job(client: FlaskClient, **body: object) -> dict:
    """Submit a job and wait for it to end."""
    response = post_job(client, **body)
    assert response.status_code == 202, response.get_json()
    return wait_for_status(client, response.get_json()["id"], "succeeded", "failed", "canceled")


def image(client: FlaskClient, url: str) -> bytes:
    response = client.get(url)
    assert response.status_code == 200
    assert response.mimetype == "image/png"
    return response.data


def test_lifecycle_with_progress(worker_client: FlaskClient) -> None:
    job_id = post_job(worker_client, width=256, height=256, steps=12, seed=1).get_json()["id"]
    running = wait_for_status(worker_client, job_id, "running", "succeeded")
    done = wait_for_status(worker_client, job_id, "succeeded")
    assert done["progress"] == {"step": 12, "total": 12}
    assert done["position"] is None and done["error"] is None
    assert done["created_at"] <= done["started_at"] <= done["finished_at"]
    assert done["images"] == [f"/v1/jobs/{job_id}/images/0"]
    if running["status"] == "running":
        assert running["progress"]["total"] == 12 and running["progress"]["step"] <= 12


def test_images_have_the_requested_size_and_count(worker_client: FlaskClient) -> None:
    view = run_job(worker_client, width=192, height=64, steps=2, num_images=3, seed=5)
    assert view["status"] == "succeeded"
    assert len(view["images"]) == 3
    for url in view["images"]:
        picture = Image.open(io.BytesIO(image(worker_client, url)))
        assert picture.format == "PNG" and picture.size == (192, 64)
    missing = worker_client.get(f"/v1/jobs/{view['id']}/images/3")
    assert missing.status_code == 404 and missing.get_json()["error"]["code"] == "not_found"


def test_same_request_and_seed_give_the_same_png(worker_client: FlaskClient) -> None:
    body = {"width": 128, "height": 128, "steps": 3, "seed": 1234, "guidance_scale": 5.0}
    first = image(worker_client, run_job(worker_client, **body)["images"][0])
    second = image(worker_client, run_job(worker_client, **body)["images"][0])
    other = image(worker_client, run_job(worker_client, **{**body, "seed": 1235})["images"][0])
    assert first == second
    assert first != other


def test_a_weighted_prompt_weighs_its_words_and_at_weight_1_is_the_plain_prompt(
        worker_client: FlaskClient) -> None:
    body = {"width": 64, "height": 64, "steps": 3, "seed": 31}

    def pixels(prompt: str, syntax: str) -> bytes:
        view = run_job(worker_client, prompt=prompt, prompt_syntax=syntax, **body)
        assert view["status"] == "succeeded", view
        return Image.open(io.BytesIO(worker_client.get(view["images"][0]).data)).tobytes()

    plain = pixels("a red barn", "plain")
    assert pixels("(a red barn:1.0)", "weighted") == plain
    assert pixels("a (red:1.8) barn", "weighted") != plain
    assert pixels("(a red barn:1.0)", "plain") != plain  # plain: the brackets are words


def test_a_sampler_per_job_is_reproducible_and_its_own(worker_client: FlaskClient) -> None:
    body = {"width": 64, "height": 64, "steps": 4, "seed": 77}

    def pixels(view: dict) -> bytes:  # not the PNG's bytes: its text chunk names the request
        return Image.open(io.BytesIO(image(worker_client, view["images"][0]))).tobytes()

    own = run_job(worker_client, **body)
    assert own["status"] == "succeeded" and own["request"]["scheduler"] is None
    made = {}
    for name in UNET_SCHEDULERS:
        view = run_job(worker_client, **body, scheduler=name)
        assert view["status"] == "succeeded" and view["request"]["scheduler"] == name  # what ran
        made[name] = pixels(view)
    assert made["euler_a"] == pixels(run_job(worker_client, **body, scheduler="euler_a"))
    # The tiny model's own scheduler is DDIM, so "ddim" makes its image; each other sampler its own.
    assert made["ddim"] == pixels(own)
    others = [made[name] for name in UNET_SCHEDULERS if name != "ddim"]
    assert len(set(others)) == len(others) and pixels(own) not in others


def test_images_of_one_job_differ_and_match_their_seeds(worker_client: FlaskClient) -> None:
    # Image i of a job uses seed + i, so a batch can be reproduced one image at a time, up to the
    # last-bit float differences of a batched forward pass (at most one 8-bit level, rarely).
    body = {"width": 64, "height": 64, "steps": 2, "guidance_scale": 0.0}
    pair = run_job(worker_client, seed=10, num_images=2, **body)
    single = run_job(worker_client, seed=11, **body)
    assert image(worker_client, pair["images"][0]) != image(worker_client, pair["images"][1])
    first = numpy.asarray(Image.open(io.BytesIO(image(worker_client, pair["images"][1]))), dtype=int)
    second = numpy.asarray(Image.open(io.BytesIO(image(worker_client, single["images"][0]))), dtype=int)
    difference = numpy.abs(first - second)
    assert difference.max() <= 1
    assert (difference > 0).mean() < 0.01


def test_cancel_of_a_running_job_stops_it_and_the_worker_goes_on(worker_client: FlaskClient) -> None:
    job_id = post_job(worker_client, width=1024, height=1024, steps=60, seed=3).get_json()["id"]
    wait_for(lambda: (worker_client.get(f"/v1/jobs/{job_id}").get_json()["progress"] or {}).get("step"),
             what="the job to take its first step")
    response = worker_client.delete(f"/v1/jobs/{job_id}")
    assert response.status_code == 202
    view = wait_for_status(worker_client, job_id, "canceled", "succeeded", "failed")
    assert view["status"] == "canceled"
    assert view["progress"]["step"] < 60 and view["images"] == []
    not_ready = worker_client.get(f"/v1/jobs/{job_id}/images/0")
    assert not_ready.status_code == 409
    assert run_job(worker_client, width=64, height=64, steps=1)["status"] == "succeeded"


def test_job_canceled_while_queued_never_runs(worker_client: FlaskClient) -> None:
    blocker = post_job(worker_client, width=256, height=256, steps=8).get_json()["id"]
    queued = post_job(worker_client, width=64, height=64, steps=1).get_json()["id"]
    assert worker_client.delete(f"/v1/jobs/{queued}").status_code == 200
    wait_for_status(worker_client, blocker, "succeeded")
    view = worker_client.get(f"/v1/jobs/{queued}").get_json()
    assert view["status"] == "canceled" and view["started_at"] is None and view["progress"] is None


def test_failing_job_is_recorded_and_the_worker_goes_on(worker_client: FlaskClient) -> None:
    # The session's worker allows 60 steps, the API 100: the worker's re-validation fails the job.
    view = run_job(worker_client, width=64, height=64, steps=80)
    assert view["status"] == "failed"
    assert view["error"]["code"] == "invalid_request"
    assert "steps" in view["error"]["message"]
    assert "Traceback" not in view["error"]["message"]
    response = worker_client.get(f"/v1/jobs/{view['id']}/images/0")
    assert response.status_code == 409
    assert run_job(worker_client, width=64, height=64, steps=1)["status"] == "succeeded"


def test_finished_job_cannot_be_canceled(worker_client: FlaskClient) -> None:
    view = run_job(worker_client, width=64, height=64, steps=1)
    response = worker_client.delete(f"/v1/jobs/{view['id']}")
    assert response.status_code == 409
    assert response.get_json()["error"]["code"] == "already_finished"


def test_results_expire_with_410(worker_settings: Settings, worker_client: FlaskClient) -> None:
    view = run_job(worker_client, width=64, height=64, steps=1)
    images_key = f"slotq:images:{view['id']}"
    with Redis.from_url(worker_settings.redis_url) as connection:
        ttl = connection.ttl(images_key)
        assert 0 < ttl <= worker_settings.result_ttl_s
        assert connection.ttl(f"rq:job:{view['id']}") > ttl  # the record outlives the images
        connection.pexpire(images_key, 1)  # let the result TTL run out now rather than in an hour
        wait_for(lambda: not connection.exists(images_key), what="the images to expire")
    response = worker_client.get(view["images"][0])
    assert response.status_code == 410
    assert response.get_json()["error"]["code"] == "expired"
    assert worker_client.get(f"/v1/jobs/{view['id']}").get_json()["status"] == "succeeded"
    with Redis.from_url(worker_settings.redis_url) as connection:
        # Out of the session queue's listing: the page's tests show its newest jobs, thumbnails and all,
        # and expect every image they ask for to be there.
        connection.zrem(keys.listed_key(worker_settings.queue_name, ""), view["id"])


def test_expired_record_answers_410_not_404(worker_settings: Settings, worker_client: FlaskClient) -> None:
    view = run_job(worker_client, width=64, height=64, steps=1)
    with Redis.from_url(worker_settings.redis_url) as connection:
        connection.delete(f"rq:job:{view['id']}")  # as the record TTL would, an hour or a day later
    for response in (worker_client.get(f"/v1/jobs/{view['id']}"), worker_client.get(view["images"][0]),
                     worker_client.delete(f"/v1/jobs/{view['id']}")):
        assert response.status_code == 410
        assert response.get_json()["error"]["code"] == "expired"
    assert worker_client.get("/v1/jobs/never-issued").status_code == 404


def test_rq_sees_the_worker_busy_then_idle(worker_client: FlaskClient, worker_settings: Settings) -> None:
    from rq import Worker

    connection = Redis.from_url(worker_settings.redis_url)

    def state() -> str:
        return next(worker.get_state() for worker in Worker.all(connection=connection))

    job_id = post_job(worker_client, width=256, height=256, steps=30).get_json()["id"]
    wait_for_status(worker_client, job_id, "running")
    assert state() == "busy"
    wait_for_status(worker_client, job_id, "succeeded")
    wait_for(lambda: state() == "idle", what="RQ to see the worker idle")
    connection.close()


def test_rq_lists_the_origin_queue_with_its_finished_jobs(worker_client: FlaskClient,
                                                         worker_settings: Settings) -> None:
    from rq import Queue

    connection = Redis.from_url(worker_settings.redis_url)
    job_id = post_job(worker_client, width=64, height=64, steps=1).get_json()["id"]
    wait_for_status(worker_client, job_id, "succeeded")
    queues = Queue.all(connection=connection)
    (origin,) = [queue for queue in queues if queue.name == worker_settings.queue_name]
    assert job_id in origin.finished_job_registry.get_job_ids()
    assert origin.count == 0  # what waits is in the class lists, never in the origin's own list
    connection.close()


def test_progress_cadence_reports_the_first_step_and_once_per_interval_but_not_the_last() -> None:
    now = [0.0]
    cadence = progress.Cadence(0.1, clock=lambda: now[0])
    reported = []
    for step, at in enumerate([0.0, 0.03, 0.06, 0.09, 0.12, 0.15, 0.25, 0.36]):
        now[0] = at
        if cadence.due(step, 7):
            reported.append(step)
    # 0.12 and 0.25 come 0.1 or more after the last report; 7, the last, is recorded with the end.
    assert reported == [0, 4, 6]
    every = progress.Cadence(0.0, clock=lambda: 1.0)  # SLOTQ_PROGRESS_INTERVAL_MS=0
    assert all(every.due(step, 5) for step in range(5)) and not every.due(5, 5)


def test_a_finishing_process_started_while_redis_is_away_waits_for_it(tmp_path: Path) -> None:
    # Seen in CI: a failover killed the finishing process; its replacement, started while no master
    # answered, exited at once, and the worker with it (as if its device were lost).
    from slotq.localredis import free_port, start_redis
    from worker import finisher

    port = free_port()
    settings = Settings(redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_s=0.2, cache_dir=tmp_path)
    servers: list[subprocess.Popen[bytes]] = []
    comeback = threading.Timer(1.0, lambda: servers.append(start_redis(port, tmp_path / "redis")))
    comeback.start()  # the fault's schedule: Redis is back a second after the start
    try:
        finishing = finisher._connected(settings, "away-worker")
        assert finishing.connection.ping()
    finally:
        comeback.join()  # start_redis returns a moment after Redis listens: the finisher may be first
        for server in servers:
            server.terminate()
            server.wait(10)
    assert servers  # it reached the Redis that came back: none listened on the port before


def test_the_worker_answers_readyz_on_its_metrics_port(worker: Process, worker_settings: Settings) -> None:
    import json
    import urllib.request

    base = f"http://127.0.0.1:{worker_settings.worker_metrics_port}"
    with urllib.request.urlopen(f"{base}/readyz", timeout=5) as answer:
        assert answer.status == 200 and json.loads(answer.read()) == {"status": "ready"}
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as answer:  # the metrics still beside it
        assert b"slotq_worker_jobs" in answer.read()


def test_torch_threads_are_one_below_the_threshold_and_the_default_from_it_on_the_cpu() -> None:
    # A small execution's operators gain little from more threads and lose the most when the
    # finishing process, Redis or the API takes a core (every thread waits for the slowest); a
    # large one's gain. A setting fixes the count; on a GPU the work is the device's.
    import torch

    from worker.threads import TORCH_DEFAULT_THREADS, ThreadChoice, work_of

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    automatic = ThreadChoice.configured(0, cpu)
    assert (automatic.fewer, automatic.more) == (1, TORCH_DEFAULT_THREADS)
    assert automatic.threads_for(10**9) == 1  # until calibrated
    calibrated = replace(automatic, more=2, threshold=100_000)
    small = work_of([JobRequest(prompt="a", width=64, height=64, steps=4, seed=0)])
    large = work_of([JobRequest(prompt="a", width=256, height=256, steps=4, seed=0)])
    batch = work_of([JobRequest(prompt="a", width=64, height=64, steps=4, num_images=2, seed=0)] * 4)
    assert (small, large, batch) == (64 * 64 * 4, 256 * 256 * 4, 64 * 64 * 4 * 8)
    works = (small, 99_999, 100_000, batch, large)
    assert [calibrated.threads_for(work) for work in works] == [1, 1, 2, 2, 2]
    fixed = replace(ThreadChoice.configured(3, cpu), threshold=0)
    assert [fixed.threads_for(work) for work in (0, small, large)] == [3, 3, 3] and not fixed.automatic
    assert [ThreadChoice.configured(0, cuda).threads_for(work) for work in (small, large)] == [0, 0]
    assert ThreadChoice.configured(3, cuda).threads_for(small) == 3


def test_the_threshold_is_where_more_threads_start_to_win_by_the_margin() -> None:
    from worker.threads import MARGIN, Timing, crossover

    assert MARGIN == 0.05
    # Two threads 10 ms short of winning by 5 % at 10,000 pixel-steps, 10 ms past it at 110,000:
    # the threshold is half way.
    assert crossover(Timing(10_000, 0.100, 0.105), Timing(110_000, 0.500, 0.465)) == pytest.approx(60_000)
    assert crossover(Timing(10_000, 0.100, 0.050), Timing(110_000, 0.500, 0.200)) == 0  # they win at both
    assert crossover(Timing(10_000, 0.100, 0.100), Timing(110_000, 0.500, 0.490)) == math.inf  # by 2 %
    # Another process took a core: more threads lost at both sizes, by less at the large one.
    assert crossover(Timing(8_192, 0.029, 0.371), Timing(131_072, 0.090, 0.283)) == math.inf


@pytest.mark.parametrize(("scale", "stall", "calls", "found"), [
    (1, 1, 1 + 5 * 4, "between"),  # the tiny model: five rounds fit in a second
    (100, 1, 1 + 3 * 4, "between"),  # a model 100 times slower: its budget grows with its first call
    (1, 30, 1 + 4 + 2, "never"),  # more threads stall (a core taken): cut at 2 s, and they lose
    (1, 120, 1 + 2, "never"),  # not one round in 2 s
])
def test_calibration_keeps_the_best_of_interleaved_rounds_within_its_budget(
        monkeypatch: pytest.MonkeyPatch, scale: float, stall: float, calls: int, found: str) -> None:
    from worker import threads

    # A clock that only the calls move: each size's time at each count, more threads stalled by `stall`.
    costs = {(64, 1): 0.017, (64, 2): 0.018 * stall, (256, 1): 0.045, (256, 2): 0.038 * stall}
    now, made = [0.0], []

    def run(side: int, count: int) -> None:
        made.append((side, count))
        now[0] += scale * costs[side, count]

    monkeypatch.setattr(threads, "perf_counter", lambda: now[0])
    choice = threads.ThreadChoice(1, 2).calibrated(run, 64, 256)
    assert len(made) == calls and made[:3] == [(256, 1), (64, 1), (64, 2)]  # untimed first, then in turn
    assert choice.calibration_s == pytest.approx(now[0])
    if found == "never":
        assert choice.threshold == math.inf
    else:  # two threads lose at 64 (8,192 pixel-steps) and win by over 5 % at 256 (131,072)
        expected = threads.crossover(threads.Timing(8_192, 0.017 * scale, 0.018 * scale),
                                     threads.Timing(131_072, 0.045 * scale, 0.038 * scale))
        assert choice.threshold == pytest.approx(expected) and 8_192 < expected < 131_072


def test_on_the_cpu_each_execution_runs_at_the_threads_its_work_takes(model_cache: Path) -> None:
    import torch

    from worker.pipeline import load_pipeline
    from worker.threads import TORCH_DEFAULT_THREADS, ThreadChoice

    before = torch.get_num_threads()
    try:
        pipeline = load_pipeline(Settings(cache_dir=model_cache, device="cpu", torch_threads=0))
        assert pipeline.threads.automatic == (TORCH_DEFAULT_THREADS > 1)
        assert (pipeline.threads.calibration_s is not None) == pipeline.threads.automatic
        assert re.fullmatch(automatic_choice(TORCH_DEFAULT_THREADS), str(pipeline.threads))
        # The threshold calibrated on a busy machine may be anywhere: set one between the two sizes.
        pipeline.threads = ThreadChoice(1, 2, threshold=64 * 64 * 2 + 1)
        seen: list[int] = []

        def threads_in(side: int) -> int:
            request = JobRequest(prompt="a", width=side, height=side, steps=2, seed=0)
            pipeline.generate(request, lambda step, total, latents: seen.append(torch.get_num_threads()))
            return seen[-1]

        assert [threads_in(64), threads_in(128), threads_in(64)] == [1, 2, 1]
    finally:
        torch.set_num_threads(before)


def automatic_choice(more: int) -> str:
    """The start-up line's words for a count chosen per execution: the threshold the warm-up found,
    or that more threads never won (on a busy machine), or the one count where torch has only one."""
    if more == 1:
        return r"1 CPU thread\(s\)"
    return (rf"1 CPU thread\(s\) (below [\d,]+ pixel-steps .*, {more} from there"
            rf"|at any work \({more} never won .*), calibrated in [\d.]+ s\)?")


def test_the_worker_logs_its_thread_choice_when_it_is_ready(worker: Process,
                                                            worker_settings: Settings) -> None:
    from worker.threads import TORCH_DEFAULT_THREADS

    # The suite's workers run a fixed count (tests/conftest.py); the automatic line is checked in-process.
    fixed = worker_settings.torch_threads
    choice = rf"{fixed} CPU thread\(s\)" if fixed else automatic_choice(TORCH_DEFAULT_THREADS)
    assert re.search(rf"loaded default on cpu as torch.float32: {choice}$", worker.output(), re.MULTILINE)
