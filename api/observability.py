"""Around every request: its id (X-Request-ID), one log line, and its latency and outcome in the metrics."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from flask import Flask, Response, current_app, g, request

from api import state
from shared.contract import logs

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

log = logging.getLogger("slotq.requests")
SUBMIT_ENDPOINT = "slotq.submit_job"
QUIET_ROUTES = frozenset({"/healthz", "/readyz", "/metrics"})  # probes and scrapes: debug level only
BEGAN = "slotq.began"  # the environ key of when the request came in (time.perf_counter)


def install(app: Flask) -> None:
    """Wrap this app: each request gets its id first, and its log line and metrics last."""
    app.wsgi_app = traced(app.wsgi_app)  # type: ignore[method-assign,assignment]
    app.after_request(end_request)


def traced(wsgi_app: WSGIApplication) -> WSGIApplication:
    """``wsgi_app`` under the request's id: the caller's X-Request-ID (or a new one) is the id of
    every log line written meanwhile (``logs.request_id``) and comes back on the answer."""
    # A WSGI middleware rather than a before-request hook: the id and the clock are in place before
    # Flask's own work, and the header joins the answer's list without werkzeug's Headers checks.
    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        environ[BEGAN] = time.perf_counter()
        request_id = logs.accept_request_id(environ.get("HTTP_X_REQUEST_ID"))
        token = logs.request_id.set(request_id)

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            headers.append(("X-Request-ID", request_id))
            return start_response(status, headers, exc_info)

        try:
            return wsgi_app(environ, start)
        finally:
            logs.request_id.reset(token)

    return app


def admits_for(endpoint: str | None) -> str | None:
    """The surface whose admission a route makes (``native`` for ``POST /v1/jobs``; a compatibility
    surface's views are marked by ``api/compat/calls.admitting``), None for a route that admits none."""
    if endpoint == SUBMIT_ENDPOINT:
        return "native"
    view = current_app.view_functions.get(endpoint) if endpoint else None
    return getattr(view, "admits_for", None)


def end_request(response: Response) -> Response:
    """Count and log the answer."""
    asked = request._get_current_object()  # type: ignore[attr-defined]  # one proxy lookup, not six
    seconds = time.perf_counter() - asked.environ[BEGAN]
    metrics = state.metrics()
    route = asked.url_rule.rule if asked.url_rule else "unmatched"  # never the raw path: ids
    method, status = asked.method, response.status_code
    metrics.observe(method, route, status, seconds)
    context = g._get_current_object()
    surface = admits_for(asked.endpoint)
    if surface is not None:
        outcome = context.get("error_code") or context.get("admission") or "admitted"
        metrics.admission(outcome, surface)
    level = logging.DEBUG if route in QUIET_ROUTES else logging.INFO
    if log.isEnabledFor(level):
        # An admission's line begins with what was admitted: one line a submit, not two.
        about = context.get("about")
        log.log(level, "%s%s %s %d %.1f ms", f"{about}; " if about else "", method, asked.path, status,
                1000 * seconds, extra={"method": method, "route": route, "status": status,
                                       "duration_ms": round(1000 * seconds, 2)})
    return response
