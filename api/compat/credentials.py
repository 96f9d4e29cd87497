"""A caller's API key as the compatibility surfaces' clients send it: a bearer token, or the password
of HTTP Basic (AUTOMATIC1111's ``--api-auth``). Credentials that cannot be read count as none sent,
so the caller hears the surface's 401, not a server error."""

from __future__ import annotations

from flask import request
from werkzeug.datastructures import Authorization

from api import state
from shared.contract.errors import UnauthorizedError
from shared.contract.tenants import tenant_of_key


def sent() -> Authorization | None:
    """The request's credentials; None where it sent none or none that can be read."""
    try:
        return request.authorization
    except ValueError:  # Basic credentials that are not base64 of ASCII
        return None


def authenticate(key: str | None, needs_key: str) -> None:
    """Set the caller's tenant from its key, or refuse it (401) with ``needs_key``: how this surface's
    clients send one."""
    try:
        state.set_tenant(tenant_of_key(state.key_policies(), state.settings(), key or None))
    except UnauthorizedError:
        raise UnauthorizedError(needs_key) from None
