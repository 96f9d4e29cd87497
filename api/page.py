"""The web page at ``/``: static HTML, CSS and JS that call the /v1 API from the browser."""

from __future__ import annotations

from pathlib import Path

from flask import Blueprint, Response, send_from_directory

STATIC = Path(__file__).parent / "static"
# Only this origin's files run or load. Images are blob: URLs (fetched with the API key); data: is
# the live previews (JPEG data: URLs from the event streams), the chosen start image, and the empty
# favicon, which spares a request that would 404.
CSP = ("default-src 'self'; img-src 'self' blob: data:; object-src 'none'; base-uri 'none'; "
       "form-action 'self'; frame-ancestors 'none'")

page = Blueprint("page", __name__, static_folder=STATIC, static_url_path="/ui")


@page.get("/")
def index() -> Response:
    """The page: a prompt form, the caller's jobs as they go, and a gallery of the finished ones."""
    return send_from_directory(STATIC, "index.html", max_age=0)


SECURITY_HEADERS = (("Content-Security-Policy", CSP), ("X-Content-Type-Options", "nosniff"))


@page.after_app_request
def secure_headers(response: Response) -> Response:
    """On every answer: nothing from another origin runs, and no MIME sniffing."""
    # App-wide rather than on this blueprint alone: they keep a browser from ever rendering a JSON
    # answer as a page. Added, not set: no answer sets them itself, and a lookup of each first
    # (setdefault) was a fifth of an admission's request hooks.
    response.headers.extend(SECURITY_HEADERS)
    return response
