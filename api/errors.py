"""Any exception a request raises, as one of the service's typed errors (``shared/contract/errors.py``).

Each API renders these in its own envelope: the native one in ``api/app.py``, the compatibility
surfaces in theirs (``api/compat/``).
"""

from __future__ import annotations

import logging

import redis
from werkzeug.exceptions import HTTPException

from shared.contract.errors import (
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceError,
    UnavailableError,
)

log = logging.getLogger(__name__)

HTTP_ERRORS: dict[int, type[ServiceError]] = {
    404: NotFoundError,
    405: MethodNotAllowedError,
    413: PayloadTooLargeError,
}


def as_service_error(error: Exception) -> ServiceError:
    """The typed error a request's exception stands for: Redis down or slow is a quick 503 the client
    can retry, never a hang; werkzeug's own (unknown route, wrong method, body too large) keep their
    status; anything unexpected is logged with its traceback here and never sent to the client."""
    if isinstance(error, ServiceError):
        return error
    if isinstance(error, redis.ConnectionError | redis.TimeoutError):
        log.warning("redis unavailable: %s", error)
        return UnavailableError(retry_after=2)
    if isinstance(error, HTTPException):
        status = error.code or 500
        known = HTTP_ERRORS.get(status)
        if known is not None:
            return known()
        return type("HTTPError", (ServiceError,), {"status": status, "code": "http_error"})(error.description)
    log.exception("unhandled error", exc_info=error)
    return ServiceError()
