"""API keys and the tenants they stand for: who may submit, and under which limits."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from shared.contract.errors import PriorityNotAllowedError, UnauthorizedError
from shared.contract.jobs import PRIORITIES, JobRequest, Priority
from shared.contract.settings import KeyPolicy, Settings


@dataclass(frozen=True)
class Tenant:
    """The caller of one request, with the limits that apply to it."""

    name: str
    rate: float | None = None
    burst: float | None = None
    max_queued: int | None = None
    priorities: tuple[Priority, ...] = PRIORITIES

    def prioritised(self, request: JobRequest) -> JobRequest:
        """The request with the priority it runs at, or ``PriorityNotAllowedError``.

        A request that names no priority runs at normal, or at the first priority the key lists
        when normal is not among them (a batch key limited to low needs not say so each time).
        """
        if "priority" not in request.model_fields_set and request.priority not in self.priorities:
            return request.model_copy(update={"priority": self.priorities[0]})
        if request.priority not in self.priorities:
            allowed = ", ".join(self.priorities)
            raise PriorityNotAllowedError(f"This API key may use priority {allowed}, not {request.priority}.")
        return request


def policies(settings: Settings) -> dict[str, KeyPolicy]:
    """Every configured key with its policy; empty in single-user mode."""
    return {key: KeyPolicy(tenant=value) if isinstance(value, str) else value
            for key, value in (settings.api_keys or {}).items()}


def priorities_of(table: dict[str, KeyPolicy], tenant: str) -> tuple[Priority, ...]:
    """The classes a tenant's keys may use, all its keys together; every class for a tenant no key
    names (an open service's jobs)."""
    allowed = [name for policy in table.values() if policy.tenant == tenant
               for name in (policy.priorities or PRIORITIES)]
    return tuple(dict.fromkeys(allowed)) or PRIORITIES


def authenticate(table: dict[str, KeyPolicy], settings: Settings, authorization: str | None) -> Tenant | None:
    """The tenant behind an ``Authorization: Bearer`` header; None when the service is open."""
    if not table:
        return None
    scheme, _, presented = (authorization or "").partition(" ")
    return tenant_of_key(table, settings, presented.strip() if scheme.lower() == "bearer" else None)


def tenant_of_key(table: dict[str, KeyPolicy], settings: Settings, presented: str | None) -> Tenant:
    """The tenant of an API key however it was sent, or ``UnauthorizedError``."""
    match: KeyPolicy | None = None
    # Compare against every key, in constant time each, so timing reveals neither key nor count.
    for key, policy in table.items():
        if hmac.compare_digest(key.encode(), (presented or "").encode()) and presented is not None:
            match = policy
    if match is None:
        raise UnauthorizedError()
    return Tenant(name=match.tenant,
                  rate=match.rate if match.rate is not None else settings.tenant_rate,
                  burst=match.burst if match.burst is not None else settings.tenant_burst,
                  max_queued=match.max_queued if match.max_queued is not None else settings.tenant_max_queued,
                  priorities=tuple(dict.fromkeys(match.priorities or PRIORITIES)))
