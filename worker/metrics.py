"""Prometheus metrics of one worker, on a port of its own: job and GPU times, duty cycle, device memory."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shared.contract.settings import Settings
from worker.device_time import DeviceTime
from worker.models import Switch

log = logging.getLogger(__name__)
DUTY_WINDOW_S = 60.0
SECONDS_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
WAIT_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600)


class WorkerMetrics:
    """What a worker counts while it runs jobs, in a registry of its own."""

    def __init__(self, device: torch.device, device_time: DeviceTime, settings: Settings, worker_name: str
                 ) -> None:
        """``device_time``: the device's GPU sections, whichever model ran them (worker/models.py)."""
        self.registry = CollectorRegistry()
        self.queue_wait = Histogram("slotq_job_queue_wait_seconds", "Time from a job's admission to its "
                                    "start.", buckets=WAIT_BUCKETS, registry=self.registry)
        self.gpu_section = Histogram("slotq_gpu_section_seconds", "Time one GPU execution (denoising and "
                                     "decoding, a batch counts once) held the slot.",
                                     buckets=SECONDS_BUCKETS, registry=self.registry)
        self.job_duration = Histogram("slotq_job_duration_seconds", "Time from a job's start to its end "
                                      "being recorded (images stored).", buckets=SECONDS_BUCKETS,
                                      registry=self.registry)
        self.jobs = Counter("slotq_worker_jobs", "Jobs this worker ran, by how they ended.", ["status"],
                            registry=self.registry)
        self.model_switches = Histogram("slotq_model_switch_seconds", "Time a worker serving several models "
                                        "took to make a job's model current, by model and where it came "
                                        "from (host: host memory; disk: loaded); none when it was on the "
                                        "device.", ["model", "source"], buckets=SECONDS_BUCKETS,
                                        registry=self.registry)
        self.registry.register(DeviceCollector(device, device_time, settings, worker_name))

    def switched(self, switch: Switch) -> None:
        """Count a model made current for a job: from host memory or disk (from the device: nothing)."""
        if switch.source != "device":
            self.model_switches.labels(switch.model, switch.source).observe(switch.seconds)

    def ended(self, status: str, seconds: float) -> None:
        """Count a job this worker ended (or put back) and how long it ran."""
        self.jobs.labels(status).inc()
        self.job_duration.observe(max(0.0, seconds))

    def serve(self, settings: Settings, ready: Callable[[], None]) -> None:
        """Answer scrapes on SLOTQ_WORKER_METRICS_PORT (0: not at all), and ``/readyz`` (200 while
        ``ready()`` returns, else 503 with the service's error envelope), from a thread of its own."""
        if not settings.worker_metrics_port:
            return
        try:
            server = make_server(settings.worker_metrics_host, settings.worker_metrics_port,
                                 _with_readiness(make_wsgi_app(self.registry), ready), _Server, _Quiet)
            threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        except OSError as exc:
            # Metrics are not worth a worker: run without them rather than not at all.
            log.warning("no metrics on %s:%d: %s", settings.worker_metrics_host, settings.worker_metrics_port,
                        exc)


def _with_readiness(metrics: Any, ready: Callable[[], None]) -> Any:
    """The metrics app, with ``/readyz`` beside it: Redis and the result store answer."""
    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != "/readyz":
            return metrics(environ, start_response)
        body: dict[str, Any] = {"status": "ready"}
        status = "200 OK"
        try:
            ready()
        except Exception as exc:  # any failure means not ready; say which
            status = "503 Service Unavailable"
            body = {"error": {"code": getattr(exc, "code", "unavailable"), "message": str(exc)}}
        start_response(status, [("Content-Type", "application/json")])
        return [json.dumps(body).encode()]
    return app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress does not hold the worker's exit


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not worth a log line each."""


class DeviceCollector(Collector):
    """Read when scraped: the worker's device, its busy time and duty cycle, and CUDA memory."""

    def __init__(self, device: torch.device, device_time: DeviceTime, settings: Settings, worker_name: str
                 ) -> None:
        self.device, self.time, self.worker_name = device, device_time, worker_name
        first = settings.served_models[0]
        self.model, self.checkpoint = first, settings.source_of(first)
        self.started = time.perf_counter()

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        device = self.device
        info = GaugeMetricFamily("slotq_worker_info", "The worker's name, model (and what it loaded) "
                                 "and device.", labels=["worker", "model", "checkpoint", "device"])
        info.add_metric([self.worker_name, self.model, self.checkpoint, str(device)], 1)
        yield info
        yield CounterMetricFamily("slotq_gpu_busy_seconds", "Time the GPU section ran, in all.",
                                  value=self.time.busy_s)
        yield GaugeMetricFamily("slotq_worker_duty_cycle", f"Share of the last {DUTY_WINDOW_S:.0f} s the "
                                "GPU section ran.", value=self.duty_cycle())
        if device.type == "cuda":
            yield GaugeMetricFamily("slotq_cuda_memory_allocated_bytes", "Device memory held by tensors now.",
                                    value=torch.cuda.memory_allocated(device))
            peak = torch.cuda.max_memory_allocated(device)
            yield GaugeMetricFamily("slotq_cuda_memory_peak_bytes", "The most device memory tensors held "
                                    "during the last execution.", value=peak)
            yield GaugeMetricFamily("slotq_cuda_memory_reserved_bytes", "Device memory the caching allocator "
                                    "holds.", value=torch.cuda.memory_reserved(device))

    def duty_cycle(self) -> float:
        """The share of the recent window (or of the time since start, when shorter) spent in GPU sections."""
        now = time.perf_counter()
        since = max(now - DUTY_WINDOW_S, self.started)
        sections = list(self.time.sections)
        if (running := self.time.running_since) is not None:  # a long job counts while it runs
            sections.append((running, now))
        busy = sum(min(end, now) - max(began, since) for began, end in sections if end > since)
        return min(1.0, busy / (now - since)) if now > since else 0.0
