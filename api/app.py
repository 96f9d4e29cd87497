"""The Flask application factory and the one place where errors become HTTP responses."""

from __future__ import annotations

from flask import Flask, Response, g, jsonify
from werkzeug.exceptions import HTTPException
from werkzeug.middleware.proxy_fix import ProxyFix

from api import bodies, observability, state
from api.admin import bp as admin_bp
from api.compat.a1111.views import bp as a1111_bp
from api.compat.a1111.views import controlnet_bp
from api.compat.comfyui.socket import bp as comfyui_bp
from api.compat.openai_images import bp as openai_bp
from api.compat.openai_videos import bp as openai_videos_bp
from api.errors import as_service_error
from api.page import page, secured
from api.routes import authenticate, bp
from shared.contract.errors import ServiceError, UnauthorizedError
from shared.contract.settings import Settings, get_settings

# The compatibility surfaces (api/compat/): OpenAI Images, AUTOMATIC1111 and its ControlNet extension,
# ComfyUI (its routes and, registered on the same blueprint, its websocket).
SURFACES = (openai_bp, openai_videos_bp, a1111_bp, controlnet_bp, comfyui_bp)


def create_app(settings: Settings | None = None) -> Flask:
    """Build the API for these settings (the environment's by default)."""
    settings = settings or get_settings()
    app = Flask(__name__, static_folder=None)  # the page's blueprint serves api/static/ at /ui/
    # "/v1/jobs/%2Fabc" must be an unknown id (404), not a redirect to another id's URL.
    app.url_map.merge_slashes = False
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    state.install(app, settings)  # its Redis connection, queue, jobs, waits, streams, keys and metrics
    app.before_request(bodies.buffer_unsized)  # a chunked body is bounded as a sized one is
    if state.key_policies(app):  # an open service reads no key, and sets no tenant
        app.before_request(authenticate)
    observability.install(app)
    app.register_blueprint(bp)
    app.register_blueprint(admin_bp)  # the operators' routes, behind SLOTQ_ADMIN_KEYS
    app.register_blueprint(page)
    app.wsgi_app = secured(app.wsgi_app)  # type: ignore[method-assign,assignment]
    if settings.trusted_proxies:  # X-Forwarded-For/-Proto/-Host from that many proxies, else ignored
        hops = settings.trusted_proxies
        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=hops, x_proto=hops, x_host=hops)  # type: ignore[method-assign]
    app.register_error_handler(ServiceError, error_response)
    app.register_error_handler(HTTPException, http_error)
    app.register_error_handler(Exception, other_error)
    for surface in SURFACES:  # each renders its own errors, in its clients' envelope
        app.register_blueprint(surface)
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


def http_error(error: HTTPException) -> tuple[Response, int]:
    """Werkzeug's own errors (unknown route, wrong method, body too large) in our envelope."""
    response, status = error_response(as_service_error(error))
    # Werkzeug's headers stay: a 405's Allow lists the methods the resource has (RFC 9110, 15.5.6).
    for name, value in error.get_headers():
        if name.lower() != "content-type":
            response.headers[name] = value
    return response, status


def other_error(error: Exception) -> tuple[Response, int]:
    """Redis down or slow, or anything unexpected (see ``api/errors.py``)."""
    return error_response(as_service_error(error))
