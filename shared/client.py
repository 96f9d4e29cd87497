"""A small client of the slotq HTTP API, on the standard library only (no Flask, no torch)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

TERMINAL = {"succeeded", "failed", "canceled", "expired"}
LONG_POLL_S = 30  # the service holds a ?wait request at most 60 s


class APIError(Exception):
    """An error answer from the service, with its stable code."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.retry_after = status, code, retry_after


class Client:
    """Submit jobs, follow them and fetch their images."""

    def __init__(self, base_url: str = "http://127.0.0.1:8000", timeout: float = 10.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def submit(self, prompt: str, **params: Any) -> dict[str, Any]:
        """Queue a job; returns its view."""
        return json.loads(self._call("POST", "/v1/jobs", {"prompt": prompt, **params}))

    def get(self, job_id: str, wait: float | None = None) -> dict[str, Any]:
        """A job's view; with ``wait``, once its status changes or that many seconds pass."""
        if wait is None:
            return json.loads(self._call("GET", f"/v1/jobs/{job_id}"))
        return json.loads(self._call("GET", f"/v1/jobs/{job_id}?wait={wait:g}", timeout=wait + self.timeout))

    def cancel(self, job_id: str) -> dict[str, Any]:
        """Cancel a job; returns its view."""
        return json.loads(self._call("DELETE", f"/v1/jobs/{job_id}"))

    def image_bytes(self, job_id: str, index: int = 0) -> bytes:
        """The PNG bytes of one finished image."""
        return self._call("GET", f"/v1/jobs/{job_id}/images/{index}")

    def wait(self, job_id: str, timeout: float = 600.0, interval: float = 0.25,
             on_update: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Follow the job until it ends or ``timeout`` passes; returns the last view.

        Without ``on_update`` it long-polls (one request per status change); with it, it polls every
        ``interval`` seconds so that step progress shows as it happens.
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            view = self.get(job_id, None if on_update else max(1, min(LONG_POLL_S, round(left))))
            if on_update:
                on_update(view)
            if view["status"] in TERMINAL:
                return view
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {view['status']} after {timeout:.0f}s")
            if on_update:
                time.sleep(interval)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
              timeout: float | None = None) -> bytes:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if body is not None else {}
        req = urllib.request.Request(self.base_url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as response:
                return response.read()
        except urllib.error.HTTPError as exc:
            raise _api_error(exc) from None


def _api_error(exc: urllib.error.HTTPError) -> APIError:
    retry_after = exc.headers.get("Retry-After")
    try:
        error = json.loads(exc.read())["error"]
        code, message = error["code"], error["message"]
    except (ValueError, KeyError, TypeError):
        code, message = "http_error", exc.reason
    return APIError(exc.code, code, message, int(retry_after) if retry_after else None)
