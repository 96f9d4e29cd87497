"""A client of the slotq HTTP API, on the standard library only (no Flask, redis, pydantic or torch).

    from slotq.client import Client, QueueFullError
    client = Client("http://127.0.0.1:8000", api_key="key-web", retries=3)
    view = client.wait(client.submit("a red fox", width=256, height=256, steps=8)["id"])
    png = client.image_bytes(view["id"])
    edit = client.submit("a red fox in snow", image=data_url("fox.png"), strength=0.6)

Every error answer raises a subclass of ``APIError`` (``.status``, ``.code``, ``.message``,
``.retry_after`` in seconds or None, ``.details``), chosen by the answer's ``code``, else by its status:

    class                 codes                                                     status
    InvalidRequestError   invalid_request, invalid_image, invalid_json,             400, 405, 413, 415, 422
                          payload_too_large, unsupported_media_type, method_not_allowed
    UnauthorizedError     unauthorized                                              401
    ForbiddenError        priority_not_allowed                                      403
    NotFoundError         not_found                                                 404
    ConflictError         already_finished, not_ready, idempotency_conflict         409
    GoneError             expired                                                   410
    QueueFullError        queue_full, tenant_queue_full, deadline_unmeetable
    RateLimitedError      rate_limited                                              429
    UnavailableError      unavailable, draining, unreachable                        502, 503, 504
    ServerError           internal_error                                            other 5xx

``unreachable`` means no answer came at all (connection refused or reset, a timeout); it reads as
status 503 so that one check covers both. Any other answer raises ``APIError`` itself.

Retries: a refused submit (``QueueFullError``, ``RateLimitedError``, ``UnavailableError``) is sent
again after its ``Retry-After``, or after an exponential backoff from 0.5 s where there is none, at
most ``retries`` times and never pausing more than ``max_retry_wait`` at once. Every submit carries
an ``Idempotency-Key`` (a new uuid4 per call unless given), so a retried POST that had landed
answers the same job instead of queueing a second one. Reads are retried on ``UnavailableError``
only, and a cancel only on a 503 answer: a cancel that got no answer may have landed, and sent
again it would answer 409 for a job it canceled itself.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

TERMINAL = {"succeeded", "failed", "canceled", "expired"}
LONG_POLL_S = 30  # the service holds a ?wait request at most 60 s
STREAM_SILENCE_S = 45.0  # an event stream silent this long (no event, no keep-alive comment) is broken
MAX_PREFER_WAIT_S = 60
BACKOFF_S = 0.5


class APIError(Exception):
    """An error answer from the service, with its stable code."""

    def __init__(self, status: int, code: str, message: str, retry_after: float | None = None,
                 details: list[dict[str, Any]] | None = None) -> None:
        # Each detail on a line of its own: the field and the reason ("width: must be a multiple of 8 ...").
        said = "".join(f"\n  {'.'.join(map(str, detail.get('loc') or ['body']))}: {detail.get('msg', '')}"
                       for detail in details or [])
        super().__init__(f"{status} {code}: {message}{said}")
        self.status, self.code, self.message = status, code, message
        self.retry_after, self.details = retry_after, details


class InvalidRequestError(APIError):
    """The request itself is wrong (400, 405, 413, 415, 422); ``details`` says where for 422."""


class UnauthorizedError(APIError):
    """No valid API key was sent (401)."""


class ForbiddenError(APIError):
    """The key may not do this, e.g. use this priority (403)."""


class NotFoundError(APIError):
    """No such job or image, or another tenant's (404)."""


class ConflictError(APIError):
    """The job's state forbids this: already finished, no image yet, or a reused idempotency key (409)."""


class GoneError(APIError):
    """The job's record or images have expired (410)."""


class QueueFullError(APIError):
    """The line, or this tenant's share of it, is full, or too long for the job's deadline (429);
    retry after ``retry_after``."""


class RateLimitedError(APIError):
    """The key is over its rate (429); retry after ``retry_after``."""


class UnavailableError(APIError):
    """The service cannot serve now: Redis down, shutting down, or no answer at all (503)."""


class ServerError(APIError):
    """The service failed on its side (500)."""


ERRORS_BY_CODE: dict[str, type[APIError]] = {
    **dict.fromkeys(["invalid_request", "invalid_image", "invalid_json", "payload_too_large",
                     "unsupported_media_type", "method_not_allowed"], InvalidRequestError),
    "unauthorized": UnauthorizedError,
    "priority_not_allowed": ForbiddenError,
    "not_found": NotFoundError,
    **dict.fromkeys(["already_finished", "not_ready", "idempotency_conflict"], ConflictError),
    "expired": GoneError,
    **dict.fromkeys(["queue_full", "tenant_queue_full", "deadline_unmeetable"], QueueFullError),
    "rate_limited": RateLimitedError,
    **dict.fromkeys(["unavailable", "draining", "unreachable"], UnavailableError),
    "internal_error": ServerError,
}
ERRORS_BY_STATUS: dict[int, type[APIError]] = {
    **dict.fromkeys([400, 405, 413, 415, 422], InvalidRequestError),
    401: UnauthorizedError, 403: ForbiddenError, 404: NotFoundError, 409: ConflictError,
    410: GoneError, 429: RateLimitedError, **dict.fromkeys([502, 503, 504], UnavailableError),
}


def api_error(status: int, code: str, message: str, retry_after: float | None = None,
              details: list[dict[str, Any]] | None = None) -> APIError:
    """The typed error for an answer: by its code, else by its HTTP status."""
    kind = ERRORS_BY_CODE.get(code) or ERRORS_BY_STATUS.get(status)
    if kind is None:
        kind = ServerError if status >= 500 else APIError
    return kind(status, code, message, retry_after, details)


def _submit_retryable(error: APIError) -> bool:
    return isinstance(error, QueueFullError | RateLimitedError | UnavailableError)


def _read_retryable(error: APIError) -> bool:
    return isinstance(error, UnavailableError)


def _cancel_retryable(error: APIError) -> bool:
    return isinstance(error, UnavailableError) and error.code != "unreachable"


# The formats a job's image may be sent in, by the first bytes of their files.
MEDIA_TYPES = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg", b"RIFF": "image/webp"}


def data_url(path: str | os.PathLike[str]) -> str:
    """A PNG, JPEG or WebP file as the ``data:`` URL a job's ``image`` or ``mask`` is sent as."""
    data = Path(path).read_bytes()
    media_type = next((kind for magic, kind in MEDIA_TYPES.items() if data.startswith(magic)), None)
    if media_type is None or (media_type == "image/webp" and data[8:12] != b"WEBP"):
        raise ValueError(f"{path} is not a PNG, JPEG or WebP file")
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


class Client:
    """Submit jobs, follow them and fetch their images."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout: float = 10.0, *,
                 api_key: str | None = None, retries: int = 3, max_retry_wait: float = 30.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.retries, self.max_retry_wait = retries, max_retry_wait
        self.sleep = sleep  # every pause: retries and the polling of ``wait``
        self.headers = {"Accept": "application/json", "User-Agent": "slotq-client"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def submit(self, prompt: str, *, wait: float | None = None, idempotency_key: str | None = None,
               **params: Any) -> dict[str, Any]:
        """Queue a job; returns its view, a finished one if it ended within ``wait`` seconds."""
        headers = {"Idempotency-Key": idempotency_key or str(uuid.uuid4())}
        timeout = None
        if wait is not None and int(wait) >= 1:
            held = min(MAX_PREFER_WAIT_S, int(wait))
            headers["Prefer"] = f"wait={held}"
            timeout = held + self.timeout
        body = {"prompt": prompt, **params}
        return json.loads(self._send("POST", "/v1/jobs", _submit_retryable, body, headers, timeout))

    def get(self, job_id: str, wait: float | None = None) -> dict[str, Any]:
        """A job's view; with ``wait``, once its status changes or that many seconds pass."""
        if wait is None:
            return json.loads(self._send("GET", f"/v1/jobs/{job_id}", _read_retryable))
        return json.loads(self._send("GET", f"/v1/jobs/{job_id}?wait={wait:g}", _read_retryable,
                                     timeout=wait + self.timeout))

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job; returns its view (``canceled``, or still ``running`` while it stops)."""
        return json.loads(self._send("DELETE", f"/v1/jobs/{job_id}", _cancel_retryable))

    def image_bytes(self, job_id: str, index: int = 0) -> bytes:
        """The PNG bytes of one finished image."""
        return self._send("GET", f"/v1/jobs/{job_id}/images/{index}", _read_retryable)

    def input_bytes(self, job_id: str, name: str = "image") -> bytes:
        """A job's input image (``image`` or ``mask``), as it was sent."""
        return self._send("GET", f"/v1/jobs/{job_id}/inputs/{name}", _read_retryable)

    def jobs(self, *statuses: str, limit: int = 20) -> Iterator[dict[str, Any]]:
        """The caller's jobs, newest first, of these statuses (any if none), fetched a page at a time."""
        query = {"limit": str(limit), **({"status": ",".join(statuses)} if statuses else {})}
        while True:
            page = json.loads(self._send("GET", f"/v1/jobs?{urlencode(query)}", _read_retryable))
            yield from page["jobs"]
            if page["next"] is None:
                return
            query["cursor"] = page["next"]

    def models(self) -> list[dict[str, Any]]:
        """The models the service runs: family, samplers, defaults and live workers of each."""
        return json.loads(self._send("GET", "/v1/models", _read_retryable))["models"]

    def events(self, job_id: str, last_event_id: str | None = None,
               timeout: float = 600.0) -> Iterator[tuple[str, dict[str, Any]]]:
        """A job's events as (name, data) from ``GET /v1/jobs/<id>/events``, until the final one;
        a dropped connection is opened again after the last event had (``Last-Event-ID``), at most
        ``retries`` times in a row. ``TimeoutError`` once ``timeout`` seconds have passed."""
        deadline, attempt = time.monotonic() + timeout, 0
        while True:
            try:
                for event_id, name, data in self._stream(job_id, last_event_id, deadline):
                    last_event_id, attempt = event_id, 0
                    yield name, data
                    if name in TERMINAL:
                        return
                return  # 204: the final event was had already
            except UnavailableError as error:
                if attempt >= self.retries or time.monotonic() > deadline:
                    raise
                self.sleep(self._pause(error, attempt))
                attempt += 1

    def _stream(self, job_id: str, last_event_id: str | None, deadline: float
                ) -> Iterator[tuple[str, str, dict[str, Any]]]:
        headers = {**self.headers, "Accept": "text/event-stream",
                   **({"Last-Event-ID": last_event_id} if last_event_id else {})}
        request = urllib.request.Request(f"{self.base_url}/v1/jobs/{job_id}/events", headers=headers)
        try:
            # The socket's timeout outlasts the server's 15 s keep-alive comments.
            with urllib.request.urlopen(request, timeout=max(self.timeout, STREAM_SILENCE_S)) as response:
                fields: dict[str, str] = {}
                for raw in response:
                    line = raw.decode().rstrip("\r\n")
                    if line:
                        name, _, value = line.partition(":")
                        fields[name] = value.removeprefix(" ")
                    elif "data" in fields:
                        yield fields.get("id", ""), fields.get("event", "message"), json.loads(fields["data"])
                        fields = {}
                    else:
                        fields = {}
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"job {job_id} did not end in time")
        except urllib.error.HTTPError as exc:
            raise _answered_error(exc) from None
        except (OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", None) or exc
            raise UnavailableError(503, "unreachable", f"the stream from {self.base_url} broke: {reason}"
                                   ) from exc
        if response.status != 204:
            raise UnavailableError(503, "unreachable", "the stream ended before the job")

    def release_worker(self, name: str, hold_s: float | None = None) -> dict[str, Any]:
        """Have a worker let go of its device and claim nothing for ``hold_s`` seconds (None: until
        :meth:`resume_worker`); the client's key must be an admin key."""
        body = {"hold_s": hold_s} if hold_s is not None else {}
        path = f"/v1/admin/workers/{quote(name)}/release"
        return json.loads(self._send("POST", path, _read_retryable, body))

    def resume_worker(self, name: str) -> dict[str, Any]:
        """End a worker's hold: it claims again (admin key)."""
        return json.loads(self._send("POST", f"/v1/admin/workers/{quote(name)}/resume", _read_retryable, {}))

    def drain_worker(self, name: str, exit: bool = True) -> dict[str, Any]:
        """Have a worker finish its job and claim nothing more: then exit, or (``exit`` off) stay,
        held until resumed (admin key)."""
        return json.loads(self._send("POST", f"/v1/admin/workers/{quote(name)}/drain", _read_retryable,
                                     {"exit": exit}))

    def wait(self, job_id: str, timeout: float = 600.0, interval: float = 0.25,
             on_update: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Follow the job until it ends or ``timeout`` passes; returns the last view.

        Without ``on_update`` it long-polls (one request per status change); with it, it follows the
        job's event stream, so that queue position and step progress show as they change (or, from
        a service without streams or with all its streams taken, polls every ``interval`` seconds).
        """
        if on_update is not None:
            try:
                return self._follow(job_id, timeout, on_update)
            except (NotFoundError, UnavailableError) as error:
                if isinstance(error, NotFoundError) and not self._exists(job_id):
                    raise  # no such job; else a service without streams: poll it
        return self._poll(job_id, timeout, interval, on_update)

    def _follow(self, job_id: str, timeout: float, on_update: Callable[[dict[str, Any]], None]
                ) -> dict[str, Any]:
        view: dict[str, Any] = {}
        for name, data in self.events(job_id, timeout=timeout):
            if name == "progress":  # a step: the view as it stood, with this progress (and ETA, if said)
                progress = {key: data[key] for key in ("step", "total") if key in data}
                view = {**view, "status": "running", "progress": progress,
                        **({"eta_s": data["eta_s"]} if "eta_s" in data else {})}
            elif name != "preview":
                view = data
            on_update(view)
        return view

    def _exists(self, job_id: str) -> bool:
        try:
            self.get(job_id)
            return True
        except NotFoundError:
            return False

    def _poll(self, job_id: str, timeout: float, interval: float,
              on_update: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        status = None
        while True:
            asked = time.monotonic()
            hold = None if on_update else max(1, min(LONG_POLL_S, round(deadline - asked)))
            view = self.get(job_id, hold)
            if on_update:
                on_update(view)
            if view["status"] in TERMINAL:
                return view
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {view['status']} after {timeout:.0f}s")
            if hold is None:
                self.sleep(interval)
            elif view["status"] == status and time.monotonic() - asked < hold - 1:
                # Answered early and unchanged: the server's waiting threads are all taken (see README).
                self.sleep(1.0)
            status = view["status"]

    def _send(self, method: str, path: str, retryable: Callable[[APIError], bool],
              body: dict[str, Any] | None = None, headers: dict[str, str] | None = None,
              timeout: float | None = None) -> bytes:
        """One call, sent again while its error is ``retryable`` and retries remain."""
        attempt = 0
        while True:
            try:
                return self._request(method, path, body, headers or {}, timeout or self.timeout)
            except APIError as error:
                if attempt >= self.retries or not retryable(error):
                    raise
                self.sleep(self._pause(error, attempt))
                attempt += 1

    def _pause(self, error: APIError, attempt: int) -> float:
        wanted = error.retry_after if error.retry_after is not None else BACKOFF_S * 2 ** attempt
        return min(self.max_retry_wait, max(0.0, wanted))

    def _request(self, method: str, path: str, body: dict[str, Any] | None, headers: dict[str, str],
                 timeout: float) -> bytes:
        sent = {**self.headers, **headers}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            sent["Content-Type"] = "application/json"
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            raise _answered_error(exc) from None
        except (OSError, http.client.HTTPException) as exc:  # URLError, refused, reset, timed out
            reason = getattr(exc, "reason", None) or exc
            raise UnavailableError(503, "unreachable", f"no answer from {self.base_url}: {reason}") from exc


def _answered_error(exc: urllib.error.HTTPError) -> APIError:
    """The typed error for an error answer, read from its JSON envelope where it has one."""
    details = None
    try:
        error = json.loads(exc.read())["error"]
        code, message, details = error["code"], error["message"], error.get("details")
    except (ValueError, KeyError, TypeError, OSError, http.client.HTTPException):
        code, message = "http_error", str(exc.reason)
    return api_error(exc.code, code, message, _seconds(exc.headers.get("Retry-After")), details)


def _seconds(value: str | None) -> float | None:
    """``Retry-After`` as seconds; None when absent or an HTTP date (which slotq never sends)."""
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return int(seconds) if seconds is not None and seconds.is_integer() else seconds
