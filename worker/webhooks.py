"""Sending webhooks: a thread of each worker delivers its queue's due outbox entries.

Off the GPU path: the thread only waits on the network, and its Python work per delivery (a job
fetch, one JSON dump, one HMAC) is small. Delivery is at least once: a claim moves the entry a
lease into the future before it is sent, so an entry whose sender dies is sent again after the
lease, and several workers share one outbox without sending an entry twice at once.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import cache
from urllib.parse import urlsplit

from redis.exceptions import RedisError
from rq.queue import Queue

from shared.contract import webhooks
from shared.contract.errors import ServiceError, WebhookRefusedError
from shared.contract.settings import Settings
from shared.contract.webhooks import Allowance, Entry
from shared.store import outbox, records
from shared.store.records import fetch_job

log = logging.getLogger(__name__)
Resolver = Callable[[str, int], list[str]]
POLL_S = 0.5
BACKOFF_S = 1.0
MAX_BACKOFF_S = 300.0
USER_AGENT = "slotq-webhooks/1"
CLOSE_WAIT_S = 2.0  # a stopping worker waits this long for a delivery in flight, then leaves it to the lease


def resolve(host: str, port: int) -> list[str]:
    """Every address a host name resolves to (the system resolver)."""
    return [str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def pin(host: str, port: int, allowed: Allowance, resolver: Resolver = resolve) -> str:
    """The one address to connect to, after checking every address the host resolves to."""
    addresses = resolver(host, port)
    if not addresses:
        raise OSError(f"{host} resolves to no address")
    if allowed.permits_host(host):
        return addresses[0]
    if webhooks.is_local_name(host):
        raise WebhookRefusedError(f"{host} is a local name")
    for address in addresses:
        parsed = ipaddress.ip_address(address)
        if webhooks.blocked(parsed) and not allowed.permits(parsed):
            raise WebhookRefusedError(f"{host} resolves to {address}, which webhooks may not reach")
    return addresses[0]


class PinnedHTTPConnection(http.client.HTTPConnection):
    """HTTP to the address already checked: no second lookup for DNS rebinding to answer differently."""

    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class PinnedHTTPSConnection(PinnedHTTPConnection):
    """HTTPS to the checked address, with SNI and the certificate verified for the host name."""

    default_port = http.client.HTTPS_PORT

    def connect(self) -> None:
        super().connect()
        self.sock = _tls().wrap_socket(self.sock, server_hostname=self.host)


def post(url: str, body: bytes, headers: dict[str, str], timeout: float, allowed: Allowance,
         resolver: Resolver = resolve) -> int:
    """POST once without following redirects; the status. OSError and HTTPException: try again later."""
    parts = urlsplit(url)
    https = parts.scheme == "https"
    host, port = parts.hostname or "", parts.port or (443 if https else 80)
    address = pin(host, port, allowed, resolver)
    connection = (PinnedHTTPSConnection if https else PinnedHTTPConnection)(host, port, address, timeout)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        connection.request("POST", target, body=body, headers={
            **headers, "Content-Type": "application/json", "User-Agent": USER_AGENT})
        with connection.getresponse() as response:  # its body is of no interest
            return response.status
    except (http.client.InvalidURL, UnicodeError) as exc:
        raise WebhookRefusedError(f"cannot send to this URL: {exc}") from None
    finally:
        connection.close()


class Sender:
    """The thread that delivers a queue's webhooks; ``start()`` it, ``close()`` it."""

    def __init__(self, queue: Queue, settings: Settings, *, resolver: Resolver = resolve,
                 poll_s: float = POLL_S, backoff_s: float = BACKOFF_S) -> None:
        if settings.webhook_secret is None:
            raise ValueError("webhooks need SLOTQ_WEBHOOK_SECRET")
        self.queue, self.settings = queue, settings
        self._key = webhooks.signing_key(settings.webhook_secret)
        self._allowed = webhooks.allowance(settings.webhook_allow)
        self._resolver, self._poll_s, self._backoff_s = resolver, poll_s, backoff_s
        # Long enough for a lookup and a slow answer; past it, another sender may try the entry too.
        self._lease_s = max(60.0, 4 * settings.webhook_timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="webhooks", daemon=True)

    def start(self) -> None:
        """Start delivering in the background."""
        self._thread.start()

    def close(self) -> None:
        """Stop after the delivery in progress; what is left stays in the outbox for later."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(CLOSE_WAIT_S)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.pump()
            except RedisError as exc:
                log.debug("webhook outbox unreachable: %s", exc)
            except Exception:  # a bug in one delivery must not end the deliveries of every job
                log.exception("webhook delivery failed")

    def pump(self) -> int:
        """Deliver every due entry, one at a time; how many were tried."""
        tried = 0
        while not self._stop.is_set():
            raw = outbox.take_due(self.queue.connection, self.queue.name, self._lease_s)
            if raw is None:
                break
            self._deliver(raw)
            tried += 1
        return tried

    def _deliver(self, raw: bytes) -> None:
        try:
            entry = Entry.decode(raw)
            job = fetch_job(self.queue, entry.job)
            url = str(job.kwargs["request"]["webhook"])
            body = json.dumps({"type": entry.event, "timestamp": _iso(entry.first),
                               "data": records.job_view(job).model_dump(mode="json")},
                              separators=(",", ":")).encode()
        except (ValueError, KeyError, TypeError, ServiceError) as exc:
            # Above all: the job's record has expired, so there is nothing left to tell.
            self._drop(raw, f"dropped webhook {raw[:200]!r}: {exc}")
            return
        headers = webhooks.signed_headers(self._key, entry.id, body)
        try:
            status = post(url, body, headers, self.settings.webhook_timeout_s, self._allowed, self._resolver)
        except WebhookRefusedError as exc:
            self._drop(raw, f"refused webhook {entry.id} of job {entry.job}: {exc}")
            return
        except (OSError, http.client.HTTPException) as exc:
            self._retry(raw, entry, f"{type(exc).__name__}: {exc}")
            return
        if 200 <= status < 300:
            self._drop(raw)
        else:
            self._retry(raw, entry, f"HTTP {status}")

    def _retry(self, raw: bytes, entry: Entry, why: str) -> None:
        now = time.time()
        if now - entry.first >= self.settings.webhook_retry_s:
            self._drop(raw, f"gave up on webhook {entry.id} of job {entry.job} after "
                            f"{entry.attempt + 1} attempts: {why}")
            return
        # Exponential backoff with jitter, so that the retries of a burst do not come back as one (the
        # exponent is capped: a week of retries at the ceiling would overflow a float).
        delay = min(MAX_BACKOFF_S, self._backoff_s * 2 ** min(entry.attempt, 30)) * random.uniform(0.75, 1.25)
        log.info("webhook %s of job %s failed (%s); retrying in %.1fs", entry.id, entry.job, why, delay)
        outbox.retry_later(self.queue.connection, self.queue.name, raw, entry, delay)

    def _drop(self, raw: bytes, warning: str | None = None) -> None:
        if warning:
            log.warning("%s", warning)
        outbox.drop(self.queue.connection, self.queue.name, raw)


@cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()  # verifies the certificate and that it names the host


def _iso(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
