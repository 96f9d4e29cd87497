"""Fuzzing the HTTP contract: hypothesis on bodies and ids in-process, schemathesis on the served
OpenAPI document against a real gunicorn API. Each runs against a real Redis, in a database of its own."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jsonschema_rs
import pytest
import requests
import schemathesis
from flask.testing import FlaskClient
from hypothesis import HealthCheck, event, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from redis import Redis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.app import create_app
from api.openapi import ERROR_CODES, openapi_document
from shared.jobs import MAX_SEED, JobRequest, JobStatus, JobView
from shared.settings import Settings
from tests.conftest import Process, app_client

FUZZ_DB, SCHEMATHESIS_DB = 2, 3
# The id pattern as the README promises it, written independently of shared/queue.py: whole string.
VALID_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
FIELDS = sorted(JobRequest.model_fields)
# No example database: it would write .hypothesis/ into the working tree; failures print a seed.
FUZZ = hsettings(max_examples=400, deadline=None, database=None, print_blob=True,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.large_base_example])


# --- fixtures ------------------------------------------------------------------------------------

def _db_url(redis_url: str, db: int) -> str:
    return redis_url.removesuffix("/0") + f"/{db}"


@pytest.fixture(scope="module")
def fuzz_settings(redis_url: str, model_cache: Path) -> Iterator[Settings]:
    """A database and queue of their own, a cap no fuzz run reaches, and room for 100k-deep JSON."""
    url = _db_url(redis_url, FUZZ_DB)
    with Redis.from_url(url) as connection:
        connection.flushdb()
        yield Settings(redis_url=url, queue_name="fuzz", queue_capacity=1_000_000, cache_dir=model_cache,
                       max_side=1024, max_steps=100, max_body_bytes=262_144)
        connection.flushdb()


@pytest.fixture(scope="module")
def fuzz_client(fuzz_settings: Settings) -> Iterator[FlaskClient]:
    """The API in-process, for the whole module (hypothesis reruns a test body many times)."""
    yield from app_client(fuzz_settings)


@pytest.fixture(scope="module")
def document(fuzz_settings: Settings) -> dict[str, Any]:
    """The OpenAPI document of the fuzzed app."""
    return openapi_document(fuzz_settings)


@pytest.fixture(scope="module")
def validators(document: dict[str, Any]) -> dict[str, jsonschema_rs.Validator]:
    """JSON Schema validators for the document's component schemas, references resolved."""
    return {name: jsonschema_rs.validator_for({"$ref": f"#/components/schemas/{name}",
                                               "components": document["components"]})
            for name in document["components"]["schemas"]}


# --- strategies ----------------------------------------------------------------------------------

WEIRD_TEXT = ["", " ", "\x00", "a\x00b", "\r\n", "\u202e\u200b\ufeff", "𝕱𝖔𝖝 🦊", "\U0010ffff", "ǅ̈̈̈",
              "x" * 2000, "x" * 2001, "é" * 2001, "null", "NaN", "1e999", "rq:job:*", "../../etc/passwd", "%00"]
texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=40) | st.sampled_from(WEIRD_TEXT)
ints = (st.integers() | st.integers(min_value=-(10**300), max_value=10**300)
        | st.sampled_from([0, -1, 1, 8, 63, 64, 1024, 1032, 4096, 2**31, MAX_SEED, MAX_SEED + 1, 2**63, 2**64]))
scalars = st.none() | st.booleans() | ints | st.floats() | texts
keys = st.sampled_from(FIELDS) | texts
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(keys, inner, max_size=5), max_leaves=12)


def valid_requests(settings: Settings) -> st.SearchStrategy[dict[str, Any]]:
    """Requests the README says must be admitted, with any subset of the optional fields."""
    side = st.integers(8, settings.max_side // 8).map(lambda n: n * 8)
    text = st.text(st.characters(exclude_categories=["Cs"]), max_size=2000)
    return st.fixed_dictionaries(
        {"prompt": text.filter(bool) | st.sampled_from(["a", "x" * 2000, "\x00", "𝕱"])},
        optional={"negative_prompt": st.none() | text, "width": side, "height": side,
                  "steps": st.integers(1, settings.max_steps),
                  "guidance_scale": st.floats(0, 30) | st.integers(0, 30),
                  "seed": st.none() | st.integers(0, MAX_SEED), "num_images": st.integers(1, 4)})


def near_valid(settings: Settings) -> st.SearchStrategy[dict[str, Any]]:
    """A valid request with one field removed or replaced (by junk, or a value near a limit)."""
    limit = max(settings.max_side, settings.max_steps)
    values = json_values | st.integers(-8, 2 * limit) | st.floats(-1, 31) | st.sampled_from(
        [settings.max_side + 8, settings.max_steps + 1, 2000 * "y", "z" * 2001, 512.0, "512", True])

    @st.composite
    def mutate(draw: st.DrawFn) -> dict[str, Any]:
        body = dict(draw(valid_requests(settings)))
        key = draw(st.sampled_from(FIELDS) | texts)
        if key in body and draw(st.booleans()):
            del body[key]
        else:
            body[key] = draw(values)
        return body

    return mutate()


# --- helpers -------------------------------------------------------------------------------------

def post(client: FlaskClient, body: bytes | str, content_type: str | None = "application/json") -> Any:
    """POST raw bytes to /v1/jobs."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    return client.post("/v1/jobs", data=body, headers=headers)


def assert_error(response: Any, validators: dict[str, jsonschema_rs.Validator]) -> str:
    """A non-2xx answer is the documented envelope with a code its status may carry; the code."""
    assert response.mimetype == "application/json", (response.status_code, response.data[:300])
    body = json.loads(response.data)
    validators["Error"].validate(body)
    code = body["error"]["code"]
    assert code in ERROR_CODES[response.status_code], (response.status_code, body)
    if response.status_code in (429, 503):
        assert int(response.headers["Retry-After"]) >= 1
    return code


def assert_admitted(response: Any, sent: dict[str, Any], settings: Settings,
                    validators: dict[str, jsonschema_rs.Validator]) -> None:
    """A 202 is a documented JobView whose request keeps every limit and echoes what was sent."""
    view = json.loads(response.data)
    validators["JobView"].validate(view)
    assert response.headers["Location"] == f"/v1/jobs/{view['id']}"
    assert view["status"] == JobStatus.QUEUED
    request = view["request"]
    for side in ("width", "height"):
        assert request[side] % 8 == 0 and 64 <= request[side] <= settings.max_side
    assert 1 <= request["steps"] <= settings.max_steps and 1 <= request["num_images"] <= 4
    assert 0 <= request["guidance_scale"] <= 30 and 0 <= request["seed"] <= MAX_SEED
    assert 1 <= len(request["prompt"]) <= 2000
    for key, value in sent.items():
        assert request[key] == value or (key, value) == ("seed", None), (key, value, request)


def has_float(value: Any) -> bool:
    """Whether a JSON value holds a float anywhere (JSON Schema's integer admits 8.0; strict pydantic not)."""
    if isinstance(value, dict):
        return any(has_float(item) for item in value.values())
    if isinstance(value, list):
        return any(has_float(item) for item in value)
    return isinstance(value, float)


def check_submit(client: FlaskClient, body: Any, settings: Settings,
                 validators: dict[str, jsonschema_rs.Validator], ensure_ascii: bool = True) -> int:
    """POST a JSON value; it is admitted exactly when the documented schema says it is valid."""
    response = post(client, json.dumps(body, ensure_ascii=ensure_ascii))  # NaN and Infinity included
    event(f"status {response.status_code}")
    assert response.status_code in (202, 422), (response.status_code, response.data[:300])
    if response.status_code == 202:
        assert_admitted(response, body, settings, validators)
        return 202
    assert assert_error(response, validators) == "invalid_request"
    # The converse, where JSON Schema and strict pydantic agree: a body without floats.
    if not has_float(body):
        assert not validators["JobRequest"].is_valid(body), body
    return 422


# --- a) request bodies ---------------------------------------------------------------------------

def test_openapi_document_is_served_with_live_limits(fuzz_client: FlaskClient, fuzz_settings: Settings,
                                                     redis_url: str) -> None:
    response = fuzz_client.get("/openapi.json")
    assert response.status_code == 200
    document = response.get_json()
    assert re.fullmatch(r"3\.1\.\d+", document["openapi"])
    schemathesis.openapi.from_dict(document).validate()  # against the OpenAPI 3.1 meta-schema
    body = document["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    request = document["components"]["schemas"][body["$ref"].rsplit("/", 1)[-1]]
    assert request["properties"]["width"]["maximum"] == fuzz_settings.max_side
    assert request["additionalProperties"] is False and set(request["properties"]) == set(FIELDS)
    schemas = document["components"]["schemas"]
    assert set(schemas["JobView"]["properties"]) == set(JobView.model_fields)
    assert schemas["JobStatus"]["enum"] == [status.value for status in JobStatus]
    other = Settings(redis_url=_db_url(redis_url, FUZZ_DB), queue_name="fuzz", max_side=256, max_steps=7)
    fields = openapi_document(other)["components"]["schemas"]["JobRequest"]["properties"]
    assert (fields["height"]["maximum"], fields["steps"]["maximum"]) == (256, 7)


def test_every_route_is_documented(fuzz_client: FlaskClient, document: dict[str, Any]) -> None:
    def template(path: str) -> str:
        return re.sub(r"<(?:\w+:)?\w+>|\{\w+\}", "{}", path)

    documented = {(template(path), method.upper()) for path, item in document["paths"].items()
                  for method in item if method != "parameters"}
    routes = {(template(rule.rule), method) for rule in fuzz_client.application.url_map.iter_rules()
              if rule.endpoint != "static" for method in rule.methods - {"HEAD", "OPTIONS"}}
    assert routes == documented


@FUZZ
@given(body=json_values | st.dictionaries(keys, json_values, max_size=9), ascii_only=st.booleans())
def test_any_json_body_is_admitted_or_refused_with_422(fuzz_client: FlaskClient, fuzz_settings: Settings,
                                                       validators: dict[str, Any], body: Any,
                                                       ascii_only: bool) -> None:
    check_submit(fuzz_client, body, fuzz_settings, validators, ascii_only)


@FUZZ
@given(data=st.data())
def test_valid_and_near_valid_requests(fuzz_client: FlaskClient, fuzz_settings: Settings,
                                       validators: dict[str, Any], data: st.DataObject) -> None:
    valid = data.draw(valid_requests(fuzz_settings), label="valid")
    assert check_submit(fuzz_client, valid, fuzz_settings, validators) == 202
    check_submit(fuzz_client, data.draw(near_valid(fuzz_settings), label="mutated"), fuzz_settings, validators)


ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-be", "utf-32", "latin-1", "cp1252", "cp500", "shift_jis"]
MEDIA_TYPES = ["application/json", "application/json; charset=latin-1", "Application/JSON", "text/plain",
               "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/jsonx",
               "application/merge-patch+json", "", None]


@st.composite
def raw_bodies(draw: st.DrawFn) -> bytes:
    """Bytes that are rarely a request: noise, JSON in odd encodings, truncated or deeply nested JSON."""
    text = json.dumps(draw(json_values | st.dictionaries(keys, json_values, max_size=6)))
    kind = draw(st.sampled_from(["binary", "encoded", "truncated", "nested"]))
    if kind == "binary":
        return draw(st.binary(max_size=4096))
    if kind == "encoded":
        return text.replace("\\", "").encode(draw(st.sampled_from(ENCODINGS)), errors="replace")
    if kind == "truncated":
        return text.encode()[: draw(st.integers(0, len(text)))]
    depth = draw(st.integers(1, 1000) | st.integers(1, 100_000))
    opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}"), ('{"prompt":[', "]}")]))
    tail = closer * depth if draw(st.booleans()) else ""
    return (opener * depth + tail).encode()


@FUZZ
@given(body=raw_bodies(), media_type=st.sampled_from(MEDIA_TYPES) | st.text(max_size=30))
def test_raw_bodies_get_a_clear_4xx(fuzz_client: FlaskClient, fuzz_settings: Settings,
                                    validators: dict[str, Any], body: bytes, media_type: str | None) -> None:
    try:
        response = post(fuzz_client, body, media_type)
    except ValueError:  # werkzeug refuses a header value with a newline before sending it
        return
    event(f"status {response.status_code}")
    assert response.status_code in (202, 400, 413, 415, 422), (response.status_code, response.data[:300])
    json_type = (media_type or "").split(";")[0].strip().lower() == "application/json"
    assert (response.status_code == 415) is not json_type
    if response.status_code != 202:
        assert_error(response, validators)


@hsettings(FUZZ, max_examples=60)
@given(size=st.integers(0, 1_048_576) | st.sampled_from([262_143, 262_144, 262_145]))
def test_body_size_limit_is_exact(fuzz_client: FlaskClient, fuzz_settings: Settings,
                                  validators: dict[str, Any], size: int) -> None:
    request = b'{"prompt": "padded", "width": 64, "height": 64}'
    body = request + b" " * max(0, size - len(request))
    response = post(fuzz_client, body)
    assert response.status_code == (413 if len(body) > fuzz_settings.max_body_bytes else 202)
    if response.status_code == 413:
        assert assert_error(response, validators) == "payload_too_large"
