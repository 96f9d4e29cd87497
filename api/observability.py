"""Around every request: its id (X-Request-ID), one log line, and its latency and outcome in the metrics."""

from __future__ import annotations

import logging
import time

from flask import Flask, Response, current_app, g, request

from api.metrics import ApiMetrics
from shared.contract import logs

log = logging.getLogger("slotq.requests")
SUBMIT_ENDPOINT = "slotq.submit_job"
QUIET_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})  # probes and scrapes: debug level only


def install(app: Flask, metrics: ApiMetrics) -> None:
    """Register the hooks on this app."""
    app.extensions["slotq.metrics"] = metrics
    app.before_request(begin_request)
    app.after_request(end_request)


def begin_request() -> None:
    """Take the caller's request id (or mint one) and start the clock."""
    g.request_id = logs.accept_request_id(request.headers.get("X-Request-ID"))
    g.request_id_token = logs.request_id.set(g.request_id)
    g.began = time.perf_counter()


def end_request(response: Response) -> Response:
    """Return the request id, and count and log the answer."""
    seconds = time.perf_counter() - g.get("began", time.perf_counter())
    response.headers["X-Request-ID"] = g.get("request_id", "")
    metrics: ApiMetrics = current_app.extensions["slotq.metrics"]
    route = request.url_rule.rule if request.url_rule else "unmatched"  # never the raw path: ids
    metrics.latency.labels(request.method, route, str(response.status_code)).observe(seconds)
    if request.endpoint == SUBMIT_ENDPOINT:
        metrics.admission(g.get("error_code") or g.get("admission") or "admitted")
    level = logging.DEBUG if route in QUIET_ROUTES else logging.INFO
    log.log(level, "%s %s %d %.1f ms", request.method, request.path, response.status_code, 1000 * seconds,
             extra={"method": request.method, "route": route, "status": response.status_code,
                    "duration_ms": round(1000 * seconds, 2)})
    if (token := g.pop("request_id_token", None)) is not None:
        logs.request_id.reset(token)
    return response
