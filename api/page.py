"""The web page at ``/``: static HTML, CSS and JS that call the /v1 API from the browser."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flask import Blueprint, Response, send_from_directory

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

STATIC = Path(__file__).parent / "static"
# Only this origin's files run or load. Images and a clip's MP4 are blob: URLs (fetched with the API
# key); data: is the live previews (JPEG data: URLs from the event streams), the chosen start image,
# and the empty favicon, which spares a request that would 404.
CSP = ("default-src 'self'; img-src 'self' blob: data:; media-src 'self' blob:; object-src 'none'; "
       "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")

page = Blueprint("page", __name__, static_folder=STATIC, static_url_path="/ui")


@page.get("/")
def index() -> Response:
    """The page: a prompt form, the caller's jobs as they go, and a gallery of the finished ones."""
    return send_from_directory(STATIC, "index.html", max_age=0)


SECURITY_HEADERS = [("Content-Security-Policy", CSP), ("X-Content-Type-Options", "nosniff")]


def secured(wsgi_app: WSGIApplication) -> WSGIApplication:
    """``wsgi_app`` with the security headers on every answer: nothing from another origin runs,
    and no MIME sniffing."""
    # App-wide rather than on the page alone: they keep a browser from ever rendering a JSON answer
    # as a page. Added to the WSGI answer's header list, as a middleware: no answer sets them itself,
    # and werkzeug's Headers would check each value again on every answer, a cost on the hot path.
    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            return start_response(status, headers + SECURITY_HEADERS, exc_info)

        return wsgi_app(environ, start)

    return app
