"""The Flask application factory and the one place where errors become HTTP responses."""

from __future__ import annotations

import logging
import threading

import redis
from flask import Flask, Response, g, jsonify
from werkzeug.exceptions import HTTPException

from api import observability
from api.jobs import Jobs
from api.longpoll import Waits
from api.metrics import ApiMetrics
from api.page import page, secured
from api.routes import authenticate, bp
from api.streams import Streams
from shared.contract.errors import (
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceError,
    UnauthorizedError,
    UnavailableError,
)
from shared.contract.settings import Settings, get_settings
from shared.contract.tenants import policies
from shared.store.connection import connect, job_queue

log = logging.getLogger(__name__)

HTTP_ERRORS: dict[int, type[ServiceError]] = {
    404: NotFoundError,
    405: MethodNotAllowedError,
    413: PayloadTooLargeError,
}


def create_app(settings: Settings | None = None) -> Flask:
    """Build the API for these settings (the environment's by default)."""
    settings = settings or get_settings()
    app = Flask(__name__, static_folder=None)  # the page's blueprint serves api/static/ at /ui/
    # "/v1/jobs/%2Fabc" must be an unknown id (404), not a redirect to another id's URL.
    app.url_map.merge_slashes = False
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions["slotq.settings"] = settings
    queue = app.extensions["slotq.queue"] = job_queue(connect(settings), settings)
    draining = app.extensions["slotq.draining"] = threading.Event()  # set by the server on SIGTERM
    waits = app.extensions["slotq.waits"] = Waits.for_settings(queue.connection, settings, draining)
    app.extensions["slotq.jobs"] = Jobs(queue, settings, waits)
    app.extensions["slotq.streams"] = Streams(queue, waits, settings.max_streams)
    app.extensions["slotq.keys"] = policies(settings)
    if app.extensions["slotq.keys"]:  # an open service reads no key, and sets no tenant
        app.before_request(authenticate)
    observability.install(app, ApiMetrics(settings, queue))
    app.register_blueprint(bp)
    app.register_blueprint(page)
    app.wsgi_app = secured(app.wsgi_app)  # type: ignore[method-assign,assignment]
    app.register_error_handler(ServiceError, error_response)
    app.register_error_handler(redis.ConnectionError, redis_unavailable)
    app.register_error_handler(redis.TimeoutError, redis_unavailable)
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(Exception, internal_error)
    return app


def error_response(error: ServiceError) -> tuple[Response, int]:
    """The JSON envelope for a service error, with ``Retry-After`` where it applies."""
    g.error_code = error.code  # for the admission metrics
    response = jsonify(error.to_dict())
    if error.retry_after is not None:
        response.headers["Retry-After"] = str(error.retry_after)
    if isinstance(error, UnauthorizedError):
        response.headers["WWW-Authenticate"] = 'Bearer realm="slotq"'

    return response, error.status


def redis_unavailable(error: Exception) -> tuple[Response, int]:
    """Redis is down or slow: a quick 503 the client can retry, never a hang."""
    log.warning("redis unavailable: %s", error)
    return error_response(UnavailableError(retry_after=2))


def http_error(error: HTTPException) -> tuple[Response, int]:
    """Werkzeug's own errors (unknown route, wrong method, body too large) in our envelope."""
    status = error.code or 500
    service_error = HTTP_ERRORS.get(status)
    if service_error is None:
        service_error = type("HTTPError", (ServiceError,), {"status": status, "code": "http_error"})
        response, status = error_response(service_error(error.description))
    else:
        response, status = error_response(service_error())
    # Werkzeug's headers stay: a 405's Allow lists the methods the resource has (RFC 9110, 15.5.6).
    for name, value in error.get_headers():
        if name.lower() != "content-type":
            response.headers[name] = value
    return response, status


def internal_error(error: Exception) -> tuple[Response, int]:
    """Anything unexpected: logged with its traceback here, never sent to the client."""
    log.exception("unhandled error", exc_info=error)
    return error_response(ServiceError())
