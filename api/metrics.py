"""Prometheus metrics of the API: admissions, request latency, and the queue as Redis holds it now.

Under gunicorn each process counts its own requests into files of a shared directory
(prometheus_client's multiprocess mode) and ``GET /metrics`` sums them, whichever process answers.
Figures that belong to the whole service (queue depth, jobs ended) are read from Redis at scrape
time, so every API replica reports the same values and none is lost when a process restarts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from rq import Queue

from shared.contract.jobs import PRIORITIES
from shared.contract.settings import Settings
from shared.store import endings, waiting

# Refusals of a malformed request, counted as one outcome: the client must fix the request.
INVALID_CODES = frozenset({"invalid_request", "invalid_json", "unsupported_media_type", "payload_too_large"})
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def use_multiprocess_dir(path: Path) -> None:
    """Make this process, and the gunicorn workers it forks, count into files under ``path``."""
    # prometheus_client takes the directory from the environment and picks its value class when it
    # is first imported, which in gunicorn's master happens before the directory is known; so both
    # are set here, before any worker starts.
    path.mkdir(parents=True, exist_ok=True)
    for stale in path.glob("*.db"):  # files of an earlier run would be summed in
        stale.unlink()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    values.ValueClass = values.get_value_class()


def process_exited(pid: int) -> None:
    """gunicorn's child_exit hook: drop the live gauges of a worker process that is gone."""
    multiprocess.mark_process_dead(pid)


class ApiMetrics:
    """The API's own counters and histograms, and the text ``GET /metrics`` answers."""

    def __init__(self, settings: Settings, queue: Queue) -> None:
        self.directory = settings.metrics_dir
        # In multiprocess mode the values live in files and are collected from there; registering
        # them in a registry as well would count each twice.
        self.registry = None if self.directory else CollectorRegistry()
        self.admissions = Counter("slotq_admissions", "Job submissions, by outcome (admitted, replayed, "
                                  "invalid, or the error code of a refusal) and surface (native, openai, "
                                  "a1111).", ["outcome", "surface"], registry=self.registry)
        self.latency = Histogram("slotq_http_request_duration_seconds", "Time to answer an HTTP request.",
                                 ["method", "route", "status"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.admin_actions = Counter("slotq_admin_actions", "Operators' actions on the lines (/v1/admin), by "
                                     "action and model.", ["action", "model"], registry=self.registry)
        self._latencies: dict[tuple[str, str, int], Histogram] = {}
        self._admitted: dict[tuple[str, str], Counter] = {}
        self.service = ServiceCollector(queue, settings)
        if self.registry is not None:
            self.registry.register(self.service)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one answered request and its latency."""
        series = self._latencies.get((method, route, status))
        if series is None:  # labels() checks and converts its values: once per series, not per request
            series = self._latencies[method, route, status] = self.latency.labels(method, route, str(status))
        series.observe(seconds)

    def admission(self, outcome: str, surface: str = "native") -> None:
        """Count one submission by how it ended, and the API it came through."""
        outcome = "invalid" if outcome in INVALID_CODES else outcome
        series = self._admitted.get((outcome, surface))
        if series is None:
            series = self._admitted[outcome, surface] = self.admissions.labels(outcome, surface)
        series.inc()

    def exposition(self) -> bytes:
        """Every metric, in Prometheus' text format."""
        registry = self.registry
        if registry is None:
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry, path=str(self.directory))
            registry.register(self.service)
        return generate_latest(registry)


class ServiceCollector(Collector):
    """The queue and job counts of the whole service, read from Redis when scraped."""

    def __init__(self, queue: Queue, settings: Settings) -> None:
        self.queue, self.settings = queue, settings

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        depth = GaugeMetricFamily("slotq_queue_depth", "Jobs waiting, by model and priority class.",
                                  labels=["model", "priority"])
        limit = GaugeMetricFamily("slotq_queue_limit", "Jobs that may wait in a model's line before a "
                                  "class is refused.", labels=["model", "priority"])
        for model in self.settings.offered_models:
            counts = waiting.waiting_counts(self.queue, self.settings, self.settings.line_of(model))
            for priority, count in counts.items():
                depth.add_metric([model, priority], count)
            for priority in PRIORITIES:
                limit.add_metric([model, priority], self.settings.waiting_limit(priority))
        ended = CounterMetricFamily("slotq_jobs_ended", "Jobs that reached a final status, by status.",
                                    labels=["status"])
        for status, count in endings.ended_counts(self.queue).items():
            ended.add_metric([status], count)
        yield from (depth, limit, ended)

