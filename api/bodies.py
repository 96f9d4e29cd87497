"""Request bodies, read with bounds (and the Idempotency-Key header, checked): every surface parses
JSON bodies and JSON form fields with ``loads``, so that what a client sends is a 4xx of that
surface, never a crash of the request; and a body sent without a length (chunked) is read here, so
that one over SLOTQ_MAX_BODY_BYTES is a 413 as a body with a ``Content-Length`` is (werkzeug alone
cuts it at the limit, and the cut body then reads as malformed).

- Nesting: a document nested deeper than ``MAX_DEPTH`` is refused (no request of any surface nests
  more than a few levels), before code that walks it recursively can meet Python's recursion limit.
- Numbers: ``NaN``, ``Infinity`` and a literal too large for a float (``1e400``) are refused: JSON
  has none of them, and Python's parser would hand them on as non-finite floats.
"""

from __future__ import annotations

import io
import json
import math
from typing import Any

from flask import current_app, request

from shared.contract.errors import (
    InvalidJSONError,
    InvalidRequestError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)
from shared.contract.jobs import MAX_IDEMPOTENCY_KEY

MAX_DEPTH = 64


def json_body() -> Any:
    """The request's JSON body for the native API: ``UnsupportedMediaTypeError`` for another media type,
    ``InvalidJSONError`` for what does not parse."""
    if request.mimetype != "application/json":
        raise UnsupportedMediaTypeError()
    try:
        return loads(request.get_data(cache=False))
    except ValueError as exc:
        raise InvalidJSONError(f"The request body is not valid JSON: {exc}.") from None


def loads(data: bytes | str) -> Any:
    """The JSON document in ``data``, or ``ValueError`` saying what is wrong with it."""
    try:
        document = json.loads(data, parse_constant=_refused_constant, parse_float=_finite_float)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels") from None
    if _depth(document) > MAX_DEPTH:
        raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
    return document


def _refused_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise ValueError(f"{text[:20]} is too large a number")
    return number


def _depth(document: Any) -> int:
    """How deep arrays and objects nest in a parsed document (a scalar: 0), without recursion."""
    deepest, pending = 0, [(document, 1)]
    while pending:
        value, depth = pending.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth < MAX_DEPTH + 1:
            pending.extend((child, depth + 1) for child in children)
    return deepest


def buffer_unsized() -> None:
    """Before a request: a body without ``Content-Length`` read whole here, at most the app's
    ``MAX_CONTENT_LENGTH`` (``PayloadTooLargeError`` past it), and handed on as a sized one."""
    environ = request.environ
    if environ.get("CONTENT_LENGTH") or "chunked" not in environ.get("HTTP_TRANSFER_ENCODING", "").lower():
        return
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    data = environ["wsgi.input"].read(limit + 1)  # one byte past the limit tells that there is more
    if len(data) > limit:
        raise PayloadTooLargeError()
    environ["wsgi.input"], environ["wsgi.input_terminated"] = io.BytesIO(data), True


def idempotency_key() -> str | None:
    """The request's Idempotency-Key header, which makes a retried submit replay the job it admitted;
    one too long or with control characters is refused."""
    key = request.headers.get("Idempotency-Key")
    if key is not None and not (0 < len(key) <= MAX_IDEMPOTENCY_KEY and key.isprintable()):
        message = f"must be 1 to {MAX_IDEMPOTENCY_KEY} printable characters"
        raise InvalidRequestError(details=[{"loc": ["header", "Idempotency-Key"], "msg": message}])
    return key
