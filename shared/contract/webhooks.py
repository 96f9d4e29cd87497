"""Webhooks: the outbox entries, the admission check on targets, and Standard Webhooks signing.

A job whose request names a ``webhook`` gets one delivery per event it asks for: ``job.started``
when a worker starts it, ``job.completed`` when it ends (succeeded, failed, canceled or expired).
Whoever changes the job's status adds the delivery to the queue's outbox (shared/store/outbox.py)
in the same round trip as the change; workers send it off the GPU path (``worker/webhooks.py``),
signed as the Standard Webhooks specification describes.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import json
import re
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from shared.contract.errors import WebhookNotAllowedError, WebhooksDisabledError, WebhookSignatureError
from shared.contract.jobs import JobRequest, WebhookEvent
from shared.contract.settings import Settings

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
SECRET_PREFIX = "whsec_"
TOLERANCE_S = 300
# What inet_aton (and so getaddrinfo) also reads as IPv4: "127.1", "2130706433", "0x7f.0.0.1".
LEGACY_IPV4 = re.compile(r"[0-9a-fx.]+")

@dataclass(frozen=True)
class Entry:
    """One pending delivery: stable id, job, event type, when it was first due, failed tries so far."""

    id: str
    job: str
    event: str
    first: float
    attempt: int = 0

    def encode(self) -> str:
        """The compact JSON that is the outbox member."""
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def decode(cls, raw: bytes | str) -> Entry:
        """An outbox member read back; ValueError when it is not one."""
        try:
            return cls(**json.loads(raw))
        except (TypeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not an outbox entry: {raw!r}") from exc


def started_id(job_id: str, attempt: int) -> str:
    """The ``webhook-id`` of a start's delivery: derived, not drawn, so that a receiver that dedupes
    on it sees a repeat as one message. Each start of a job is an event of its own."""
    # Starts only: every end is written by a script, which derives its id (lua/lib/outbox.lua).
    name = f"{job_id} job.started" + (f" {attempt}" if attempt else "")
    return "msg_" + hashlib.sha1(name.encode(), usedforsecurity=False).hexdigest()[:32]


def wants(request: Mapping[str, Any], event: WebhookEvent) -> bool:
    """Whether a stored request asks for deliveries of this event."""
    return bool(request.get("webhook")) and event in request.get("webhook_events", ())


# --- which targets a webhook may reach ----------------------------------------------------------

@dataclass(frozen=True)
class Allowance:
    """Hosts and networks a webhook may target although they are not on the public internet."""

    hosts: frozenset[str]
    networks: tuple[IPNetwork, ...]

    def permits_host(self, host: str) -> bool:
        """Whether the host name itself is on the list."""
        return _name(host) in self.hosts

    def permits(self, address: IPAddress) -> bool:
        """Whether the address (or the IPv4 address it embeds) is in a listed network."""
        mapped = _embedded_ipv4(address)
        return any(candidate in network for network in self.networks
                   for candidate in (address, mapped) if candidate is not None)


@lru_cache(maxsize=8)
def _allowance(entries: tuple[str, ...]) -> Allowance:
    hosts, networks = set(), []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            hosts.add(_name(entry))
    return Allowance(frozenset(hosts), tuple(networks))


def allowance(entries: Iterable[str]) -> Allowance:
    """The allow-list (``SLOTQ_WEBHOOK_ALLOW``): each entry a CIDR network, an address, or a host name."""
    return _allowance(tuple(entries))


def blocked(address: IPAddress) -> bool:
    """Whether an address is off the public internet: loopback, private, link-local, unspecified,
    shared, multicast or reserved, also when an IPv6 address embeds such an IPv4 one."""
    embedded = _embedded_ipv4(address)
    if embedded is not None and blocked(embedded):
        return True
    return not address.is_global or address.is_multicast or address.is_reserved


def ip_literal(host: str) -> IPAddress | None:
    """The address a host names literally, as a resolver would read it; None for a name."""
    host = _name(host)
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if LEGACY_IPV4.fullmatch(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def is_local_name(host: str) -> bool:
    """``localhost`` and its subdomains, which resolve to loopback by convention (RFC 6761)."""
    name = _name(host)
    return name == "localhost" or name.endswith(".localhost")


def check_target(settings: Settings, request: JobRequest) -> None:
    """At admission, without a DNS lookup: refuse a webhook this service will not send."""
    if request.webhook is None:
        return
    if settings.webhook_secret is None:
        raise WebhooksDisabledError()
    host = urlsplit(request.webhook).hostname or ""
    allowed = allowance(settings.webhook_allow)
    if allowed.permits_host(host):
        return
    address = ip_literal(host)
    if is_local_name(host) or (address is not None and blocked(address) and not allowed.permits(address)):
        raise WebhookNotAllowedError()


def _name(host: str) -> str:
    return host.strip().lower().removesuffix(".")


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    if isinstance(address, ipaddress.IPv6Address):
        return address.ipv4_mapped or address.sixtofour
    return None


# --- signing (Standard Webhooks) -----------------------------------------------------------------

def signing_key(secret: str) -> bytes:
    """The HMAC key: a ``whsec_`` secret's base64 payload, or the UTF-8 bytes of any other secret."""
    if secret.startswith(SECRET_PREFIX):
        # Padding added as the reference library does, so both derive the same key.
        return base64.b64decode(secret.removeprefix(SECRET_PREFIX) + "==")
    return secret.encode()


def signature(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """``v1,`` and the base64 HMAC-SHA256 of ``{id}.{timestamp}.{body}``."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def signed_headers(key: bytes, msg_id: str, body: bytes, timestamp: int | None = None) -> dict[str, str]:
    """The three Standard Webhooks headers of one delivery attempt."""
    timestamp = int(time.time()) if timestamp is None else timestamp
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": signature(key, msg_id, timestamp, body)}


def verify(secret: str, body: bytes, headers: Mapping[str, str], tolerance_s: float = TOLERANCE_S) -> Any:
    """The delivery's JSON payload, or ``WebhookSignatureError`` if it is not signed with this secret."""
    found = {name.lower(): value for name, value in headers.items()}
    msg_id, stamp = found.get("webhook-id", ""), found.get("webhook-timestamp", "")
    if not (msg_id and stamp.isascii() and stamp.isdigit()) or abs(time.time() - int(stamp)) > tolerance_s:
        raise WebhookSignatureError("missing headers, or a timestamp outside the tolerance")
    expected = signature(signing_key(secret), msg_id, int(stamp), body)
    offered = found.get("webhook-signature", "").split()
    if not any(hmac.compare_digest(expected.encode(), candidate.encode()) for candidate in offered):
        raise WebhookSignatureError("no matching signature")
    return json.loads(body)
