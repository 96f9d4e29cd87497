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


@page.after_app_request
def secure_headers(response: Response) -> Response:
    """On every answer: nothing from another origin runs, and no MIME sniffing."""
    # App-wide rather than on this blueprint alone: for the JSON API they cost nothing and keep a
    # browser from ever rendering an answer as a page.
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers.setdefault("X-Content-Type-Options", "nosniff")
    return response
