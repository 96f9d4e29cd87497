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
    context = g._get_current_object()  # one proxy lookup, not eight
    asked = request._get_current_object()  # type: ignore[attr-defined]
    response.headers["X-Request-ID"] = context.get("request_id", "")
    metrics: ApiMetrics = current_app.extensions["slotq.metrics"]
    route = asked.url_rule.rule if asked.url_rule else "unmatched"  # never the raw path: ids
    method, status = asked.method, response.status_code
    metrics.observe(method, route, status, seconds)
    if asked.endpoint == SUBMIT_ENDPOINT:
        metrics.admission(context.get("error_code") or context.get("admission") or "admitted")
    level = logging.DEBUG if route in QUIET_ROUTES else logging.INFO
    if log.isEnabledFor(level):
        # An admission's line begins with what was admitted: one line a submit, not two.
        about = context.get("about")
        log.log(level, "%s%s %s %d %.1f ms", f"{about}; " if about else "", method, asked.path, status,
                1000 * seconds, extra={"method": method, "route": route, "status": status,
                                       "duration_ms": round(1000 * seconds, 2)})
    if (token := context.pop("request_id_token", None)) is not None:
        logs.request_id.reset(token)
    return response
