"""A caller's standing choices, kept per tenant: the model its jobs run on when they name none.

A choice of one tenant never changes another's, nor what a worker holds: it only names the model
that this tenant's later requests ask for (the A1111 surface's ``POST /sdapi/v1/options`` sets it).
"""

from __future__ import annotations

from redis import Redis

from shared.contract import keys
from shared.contract.settings import Settings
from shared.contract.tenants import Tenant

MODEL = "model"


def chosen_model(connection: Redis, settings: Settings, tenant: Tenant | None) -> str | None:
    """The model this caller chose, where it is still one the service offers."""
    name = connection.hget(_key(settings, tenant), MODEL)
    chosen = name.decode() if isinstance(name, bytes) else None
    return chosen if chosen in settings.offered_models else None


def choose_model(connection: Redis, settings: Settings, tenant: Tenant | None, name: str) -> None:
    """Make ``name`` (one of SLOTQ_MODEL_NAMES) this caller's model."""
    assert name in settings.offered_models, name
    connection.hset(_key(settings, tenant), MODEL, name)


def _key(settings: Settings, tenant: Tenant | None) -> str:
    return keys.preferences_key(settings.queue_name, tenant.name if tenant else "")
