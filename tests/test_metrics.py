"""Prometheus metrics: scraped from real API processes and a real worker after real jobs."""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from shared.contract.settings import Settings
from tests.conftest import Process, http_post_job, post_job, wait_for, wait_for_status

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, by name and labels."""
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def scrape(url: str) -> Samples:
    """Every sample a metrics endpoint answers."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        return parse(response.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 when the series does not exist yet."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of every series of ``name`` whose labels include ``labels``."""
    return sum(found for (series, have), found in samples.items()
               if series == name and set(labels.items()) <= set(have))


def test_api_metrics_add_up_across_processes(settings: Settings, start_api: Any) -> None:
    # Two gunicorn processes; no worker, so admitted jobs stay queued. Capacity 5.
    api: Process = start_api(settings, api_workers=2, api_threads=4)
    answers = [http_post_job(api.url, {"prompt": f"job {index}", "width": 64, "height": 64})[0]
               for index in range(7)]
    assert answers == [202] * 5 + [429] * 2
    assert http_post_job(api.url, {"prompt": ""})[0] == 422
    assert http_post_job(api.url, {"prompt": "again", "priority": "high"})[0] == 202  # high has a reserve

    # Each scrape is answered by either process; both must see the sum of both.
    for _ in range(6):
        samples = scrape(api.url + "/metrics")
        assert value(samples, "slotq_admissions_total", outcome="admitted", surface="native") == 6
        assert value(samples, "slotq_admissions_total", outcome="queue_full", surface="native") == 2
        assert value(samples, "slotq_admissions_total", outcome="invalid", surface="native") == 1
        assert total(samples, "slotq_http_request_duration_seconds_count", method="POST",
                     route="/v1/jobs") == 9
        assert value(samples, "slotq_http_request_duration_seconds_count", method="POST",
                     route="/v1/jobs", status="429") == 2
        assert value(samples, "slotq_queue_depth", model="default", priority="normal") == 5
        assert value(samples, "slotq_queue_depth", model="default", priority="high") == 1
        assert value(samples, "slotq_queue_limit", model="default", priority="normal") == 5


def test_worker_and_api_metrics_move_with_jobs(worker: Process, worker_client: Any,
                                               worker_settings: Settings) -> None:
    worker_url = f"http://127.0.0.1:{worker_settings.worker_metrics_port}/metrics"
    before = wait_for(lambda: _try_scrape(worker_url), what="the worker's metrics port")
    api_before = scrape_app(worker_client)

    # Of two widths: they neither batch nor join, so each has a GPU section of its own.
    ids = [post_job(worker_client, width=64 + 8 * index, height=64, steps=2).get_json()["id"]
           for index in range(2)]
    for job_id in ids:
        wait_for_status(worker_client, job_id, "succeeded")
    # The job's end is recorded before its metrics: wait for the counter, not for a fixed time.
    after = wait_for(lambda: _moved(worker_url, before, "slotq_job_duration_seconds_count", 2),
                     what="the worker's job counters")

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("slotq_gpu_section_seconds_count") == 2
    assert moved("slotq_job_queue_wait_seconds_count") == 2
    assert moved("slotq_worker_jobs_total", status="succeeded") == 2
    assert value(after, "slotq_gpu_busy_seconds_total") > value(before, "slotq_gpu_busy_seconds_total")
    assert 0 < value(after, "slotq_worker_duty_cycle") <= 1
    assert total(after, "slotq_worker_info", device="cpu") == 1

    api_after = scrape_app(worker_client)
    assert value(api_after, "slotq_jobs_ended_total", status="succeeded") - value(
        api_before, "slotq_jobs_ended_total", status="succeeded") == 2


def scrape_app(client: Any) -> Samples:
    """The in-process API's metrics (one process: no multiprocess directory)."""
    response = client.get("/metrics")
    assert response.status_code == 200
    return parse(response.get_data(as_text=True))


def _try_scrape(url: str) -> Samples | None:
    try:
        return scrape(url)
    except OSError:
        return None


def _moved(url: str, before: Samples, name: str, by: float) -> Samples | None:
    samples = scrape(url)
    return samples if value(samples, name) - value(before, name) >= by else None
