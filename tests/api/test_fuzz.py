"""Fuzzing the HTTP contract: hypothesis on bodies and ids in-process, schemathesis on the served
OpenAPI document against a real gunicorn API. Each runs against a real Redis, in a database of its own."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import threading
import time
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
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from api.openapi import error_codes, openapi_document
from shared.contract.jobs import MAX_SEED, JobRequest, JobStatus, JobView
from shared.contract.models import UNET_SCHEDULERS
from shared.contract.settings import Settings
from tests.conftest import Process, app_client, box_mask, data_url, raw_request, start_image

FUZZ_DB, SCHEMATHESIS_DB = 2, 3
ERROR_CODES = error_codes()
# The id pattern as the README promises it, written independently of shared/queue.py: whole string.
VALID_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
FIELDS = sorted(JobRequest.model_fields)
INTEGER_FIELDS = ("width", "height", "steps", "seed", "num_images")
# Valid start images (PNG, JPEG, WebP; sides multiples of 8) and a mask of each one's size.
IMAGES = {data_url(start_image(w, h, seed), kind): data_url(box_mask(w, h))
          for (w, h, kind, seed) in [(64, 64, "PNG", 0), (128, 64, "JPEG", 1), (72, 80, "WEBP", 2)]}
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
              "null", "NaN", "1e999", "rq:job:*", "../../etc/passwd", "%00"]
texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=40) | st.sampled_from(WEIRD_TEXT)
long_texts = st.builds(str.__mul__, st.sampled_from(["x", "é", "🦊"]), st.sampled_from([1999, 2000, 2001]))
ints = (st.integers() | st.integers(min_value=-(10**300), max_value=10**300)
        | st.sampled_from([0, -1, 1, 8, 63, 64, 1024, 1032, 2**31, MAX_SEED, MAX_SEED + 1, 2**63, 2**64]))
scalars = st.none() | st.booleans() | ints | st.floats() | texts
keys = st.sampled_from(FIELDS) | texts
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(keys, inner, max_size=5), max_leaves=12)


def valid_requests(settings: Settings) -> st.SearchStrategy[dict[str, Any]]:
    """Requests the README says must be admitted, with any subset of the optional fields: text
    to image, or with a start image (and a mask) of the job's size."""
    return st.one_of(text_requests(settings), text_requests(settings).flatmap(with_inputs))


def with_inputs(body: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """The request with a start image, maybe a mask, maybe a strength; its sides the image's or none."""
    @st.composite
    def build(draw: st.DrawFn) -> dict[str, Any]:
        image = draw(st.sampled_from(sorted(IMAGES)))
        changed = {key: value for key, value in body.items() if key not in ("width", "height")}
        changed["image"] = image
        if draw(st.booleans()):
            changed["mask"] = IMAGES[image]
        strength = draw(st.none() | st.floats(0.01, 1) | st.sampled_from([1, 1.0, 0.5]))
        if strength is not None:
            changed["strength"] = strength
        steps, share = int(changed.get("steps", 30)), changed.get("strength", 0.8)
        if int(steps * share) < 1:  # a schedule of which no step runs is refused: not valid
            changed["strength"] = 1.0
        return changed

    return build()


def text_requests(settings: Settings) -> st.SearchStrategy[dict[str, Any]]:
    """Text-to-image requests, with any subset of the optional fields."""
    side = integral(st.integers(8, settings.max_side // 8).map(lambda n: n * 8))
    text = st.text(st.characters(exclude_categories=["Cs"]), max_size=2000)
    return st.fixed_dictionaries(
        {"prompt": text.filter(bool) | st.sampled_from(["a", "x" * 2000, "\x00", "𝕱"])},
        optional={"negative_prompt": st.none() | text, "width": side, "height": side,
                  "steps": integral(st.integers(1, settings.max_steps)),
                  "guidance_scale": st.floats(0, 30) | st.integers(0, 30),
                  "seed": st.none() | integral(st.integers(0, MAX_SEED)),
                  "num_images": integral(st.integers(1, 4)),
                  "scheduler": st.none() | st.sampled_from(UNET_SCHEDULERS)})


def integral(numbers: st.SearchStrategy[int]) -> st.SearchStrategy[int | float]:
    """These integers, some sent as the integral number JSON Schema's integer also admits (496.0)."""
    return numbers | numbers.map(float)


def near_valid(settings: Settings) -> st.SearchStrategy[dict[str, Any]]:
    """A valid request with one field removed or replaced (by junk, or a value near a limit)."""
    limit = max(settings.max_side, settings.max_steps)
    values = json_values | long_texts | st.integers(-8, 2 * limit) | st.floats(-1, 31) | st.sampled_from(
        [settings.max_side + 8, settings.max_steps + 1, 512.0, "512", True])

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
        if key in ("image", "mask") and value is not None:  # the view shows a reference to what was sent
            assert request[key]["sha256"] == hashlib.sha256(base64.b64decode(value.split(",")[1])).hexdigest()
            continue
        if value is None and key in ("seed", "model"):  # drawn, or the default model named
            assert request[key] is not None and (key == "seed" or request[key] == settings.default_model)
            continue
        if isinstance(value, dict) and isinstance(request[key], dict):  # an object: its defaults filled in
            assert {name: request[key][name] for name in value} == value, (key, value, request)
            continue
        assert request[key] == value, (key, value, request)
    for key in INTEGER_FIELDS:
        assert type(request[key]) is int, (key, request)  # 8.0 was sent, 8 is kept


def finite(value: Any) -> bool:
    """Whether no number in a JSON value is NaN or infinite."""
    if isinstance(value, float):
        return math.isfinite(value)
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return all(finite(child) for child in children)


def check_submit(client: FlaskClient, body: Any, settings: Settings,
                 validators: dict[str, jsonschema_rs.Validator], ensure_ascii: bool = True) -> int:
    """POST a JSON value; it is admitted exactly when the documented schema says it is valid."""
    response = post(client, json.dumps(body, ensure_ascii=ensure_ascii))  # NaN and Infinity included
    event(f"status {response.status_code}")
    assert response.status_code in (202, 400, 422), (response.status_code, response.data[:300])
    if response.status_code == 400 and response.get_json()["error"]["code"] == "invalid_json":
        # NaN or Infinity, which json.dumps writes and JSON has not: refused as not JSON (api/bodies.py).
        assert not finite(body), body
        return 400
    if response.status_code == 400:
        # A valid body with a webhook, which this service (no secret) refuses: the only other 400 here.
        assert isinstance(body, dict) and body.get("webhook")
        assert assert_error(response, validators) == "webhooks_disabled"
        # ...and which its document, with webhooks off, does not offer.
        assert not validators["JobRequest"].is_valid(body), body
        return 400
    if response.status_code == 202:
        assert_admitted(response, body, settings, validators)
        validators["JobRequest"].validate(body)
        return 202
    code = assert_error(response, validators)
    if code == "invalid_image":
        # What no schema can say: that a data: URL holds a valid image of the right size.
        assert isinstance(body, dict) and any(isinstance(body.get(name), str) for name in ("image", "mask"))
        return 422
    if code == "unknown_model":
        # A name the service does not run, which the document's enumeration of them refuses too.
        assert isinstance(body, dict) and isinstance(body.get("model"), str)
        assert body["model"] not in settings.offered_models
        assert not validators["JobRequest"].is_valid(body), body
        return 422
    assert code == "invalid_request"
    # The converse: what the service refuses, the document refuses too (integral numbers like 8.0
    # included, which JSON Schema's integer admits and so does the service), but for what a product
    # of fields decides, which no schema can say: the steps that a strength leaves of a schedule, and
    # the size and steps of a hires pass.
    if not runs_no_step(body) and not hires_refused_across_fields(body, settings):
        assert not validators["JobRequest"].is_valid(body), body
    return 422


def runs_no_step(body: Any) -> bool:
    """Whether a body with a start image has a strength that leaves no step of its schedule."""
    if not isinstance(body, dict) or not body.get("image"):
        return False
    steps, strength = body.get("steps", 30), body.get("strength", 0.8)
    if not all(isinstance(value, int | float) and not isinstance(value, bool) for value in (steps, strength)):
        return False
    return 0 < strength <= 1 and int(steps * strength) < 1


def hires_refused_across_fields(body: Any, settings: Settings) -> bool:
    """Whether a body's hires pass may make a side over SLOTQ_MAX_SIDE (its sides rounded to the
    model's multiple), or run no step of its schedule."""
    hires = body.get("hires") if isinstance(body, dict) else None
    if not isinstance(hires, dict):
        return False
    scale, denoise = hires.get("scale", 2.0), hires.get("denoise", 0.5)
    steps = hires.get("steps") or body.get("steps", 30)
    sides = [body.get("width", 512), body.get("height", 512)]
    if not all(isinstance(value, int | float) and not isinstance(value, bool)
               for value in (scale, denoise, steps, *sides)):
        return False
    return max(sides) * scale > settings.max_side - 16 or int(steps * denoise) < 1


# --- a) request bodies ---------------------------------------------------------------------------

def test_openapi_document_is_served_with_live_limits(client: FlaskClient, settings: Settings) -> None:
    response = client.get("/openapi.json")
    assert response.status_code == 200
    document = response.get_json()
    assert re.fullmatch(r"3\.1\.\d+", document["openapi"])
    schemathesis.openapi.from_dict(document).validate()  # against the OpenAPI 3.1 meta-schema
    body = document["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    request = document["components"]["schemas"][body["$ref"].rsplit("/", 1)[-1]]
    assert request["properties"]["width"]["maximum"] == settings.max_side
    # Derived from the models, so a field added there is documented without touching api/openapi.py.
    assert request["additionalProperties"] is False and set(request["properties"]) == set(FIELDS)
    schemas = document["components"]["schemas"]
    assert set(schemas["JobView"]["properties"]) == set(JobView.model_fields)
    assert schemas["JobStatus"]["enum"] == [status.value for status in JobStatus]
    fields = openapi_document(settings.model_copy(update={"max_side": 256, "max_steps": 7}))[
        "components"]["schemas"]["JobRequest"]["properties"]
    assert (fields["height"]["maximum"], fields["steps"]["maximum"]) == (256, 7)


def test_webhooks_are_offered_only_where_they_are_sent(settings: Settings) -> None:
    def request_schema(document: dict[str, Any]) -> jsonschema_rs.Validator:
        return jsonschema_rs.validator_for({"$ref": "#/components/schemas/JobRequest",
                                            "components": document["components"]})

    def bad_request_codes(document: dict[str, Any]) -> list[str]:
        schema = document["paths"]["/v1/jobs"]["post"]["responses"]["400"]["content"]["application/json"]
        return schema["schema"]["allOf"][1]["properties"]["error"]["properties"]["code"]["enum"]

    body = {"prompt": "a", "webhook": "https://hooks.example.com/slotq"}
    off = openapi_document(settings)
    assert settings.webhook_secret is None and not request_schema(off).is_valid(body)
    assert request_schema(off).is_valid({"prompt": "a", "webhook": None})
    assert "webhooks_disabled" in off["components"]["schemas"]["JobRequest"]["properties"]["webhook"][
        "description"]
    assert bad_request_codes(off) == ["invalid_json", "malformed_request", "webhooks_disabled"]
    on = openapi_document(settings.model_copy(update={"webhook_secret": "s" * 32}))
    assert request_schema(on).is_valid(body)
    assert bad_request_codes(on) == ["invalid_json", "malformed_request", "webhook_not_allowed"]


def test_every_undocumented_method_gets_405_with_allow(fuzz_client: FlaskClient, document: dict[str, Any],
                                                       validators: dict[str, Any]) -> None:
    job_id = json.loads(post(fuzz_client, json.dumps({"prompt": "allow"})).data)["id"]
    assert "Allow" in document["components"]["responses"]["MethodNotAllowed"]["headers"]
    for template, item in document["paths"].items():
        if "101" in item.get("get", {}).get("responses", {}):
            continue  # a websocket (ComfyUI's /ws) answers a handshake, and any other request 400
        path = template.format(id=job_id, index=0, filename="app.js", name="image", model="default")
        documented = {method.upper() for method in item if method != "parameters"}
        allowed = documented | {"OPTIONS"} | ({"HEAD"} if "GET" in documented else set())
        options = fuzz_client.options(path)
        assert {name.strip() for name in options.headers["Allow"].split(",")} == allowed, path
        for method in {"GET", "POST", "PUT", "PATCH", "DELETE", "TRACE"} - documented:
            response = fuzz_client.open(path, method=method)
            assert response.status_code == 405, (method, path, response.status_code)
            assert assert_error(response, validators) == "method_not_allowed"
            assert {name.strip() for name in response.headers["Allow"].split(",")} == allowed, (method, path)


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
    mutated = data.draw(near_valid(fuzz_settings), label="mutated")
    check_submit(fuzz_client, mutated, fuzz_settings, validators)


def test_a_hires_pass_over_the_side_limit_is_refused_though_the_schema_admits_it(
        fuzz_client: FlaskClient, fuzz_settings: Settings, validators: dict[str, Any]) -> None:
    body = {"prompt": "0", "width": 520, "hires": {}}  # hypothesis found it: 1040 px after the pass
    assert validators["JobRequest"].is_valid(body)
    response = post(fuzz_client, json.dumps(body))
    assert response.status_code == 422 and "the hires pass makes 1040x1024" in response.get_data(as_text=True)
    assert hires_refused_across_fields(body, fuzz_settings)  # so the fuzz test's converse leaves it out


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
@given(body=raw_bodies(), media_type=st.one_of(st.just("application/json"), st.just("application/json"),
                                                st.sampled_from(MEDIA_TYPES), st.text(max_size=30)))
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


@hsettings(FUZZ, max_examples=150)
@given(data=st.data(), key=st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=260)
       | st.text(st.characters(max_codepoint=0xFF), max_size=300)
       | st.sampled_from(["", " ", "k" * 255, "k" * 256, "\t", "a\x7fb", "\xa0"]))
def test_idempotency_keys(fuzz_client: FlaskClient, fuzz_settings: Settings, validators: dict[str, Any],
                          data: st.DataObject, key: str) -> None:
    body = data.draw(valid_requests(fuzz_settings))
    with Redis.from_url(fuzz_settings.redis_url) as connection:
        connection.flushdb()  # each example starts with no key remembered
    headers = {"Content-Type": "application/json", "Idempotency-Key": key}
    try:
        first = fuzz_client.post("/v1/jobs", data=json.dumps(body), headers=headers)
    except ValueError:  # werkzeug refuses a header value with a newline before sending it
        return
    event(f"status {first.status_code}")
    assert first.status_code in (202, 200, 422), (first.status_code, first.data[:300])
    if first.status_code == 422:
        assert assert_error(first, validators) == "invalid_request"
        return
    again = fuzz_client.post("/v1/jobs", data=json.dumps(body), headers=headers)
    assert again.status_code == 200 and again.get_json()["id"] == first.get_json()["id"]
    validators["JobView"].validate(again.get_json())
    other = {**body, "num_images": 2 if body.get("num_images", 1) == 1 else 1}
    changed = fuzz_client.post("/v1/jobs", data=json.dumps(other), headers=headers)
    assert changed.status_code == 409 and assert_error(changed, validators) == "idempotency_conflict"


# --- b) ids --------------------------------------------------------------------------------------

NASTY_IDS = ["..", ".", "../x", "..%2fx", "*", "?", "[a-z]*", "rq:job:foo", "rq:queue:fuzz", "slotq:cancel:x",
             "a b", "a\tb", "\x00", "a\x00", "%00", "%", "%zz", "%252e%252e", "é", "𝕱𝖔𝖝", "\u202e", "-" * 65,
             "x" * 10_000, "id\r\nSet-Cookie: x=1", "{id}", "<script>", "\\", "\n", "\nabc", " abc", "abc "]


ids = (st.text(st.characters(exclude_categories=["Cs"]), max_size=80) | st.sampled_from(NASTY_IDS)
       | st.from_regex(VALID_ID, fullmatch=True)
       | st.text("abc-_%/.:*?#\n\r\t \\", max_size=20)
       | st.integers(65, 20_000).map(lambda n: "a" * n))


def id_requests(client: FlaskClient, job_id: str) -> list[Any]:
    """GET, DELETE and the first image of a job, with the id percent-encoded in the path."""
    path = "/v1/jobs/" + quote(job_id, safe="")
    return [client.get(path), client.delete(path), client.get(path + "/images/0")]


class RedisMonitor:
    """Every command Redis runs on one database, via MONITOR, between two markers."""

    def __init__(self, url: str, db: int) -> None:
        self.url, self.db, self.commands = url, db, list[str]()
        self.thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        with Redis.from_url(self.url) as client, client.monitor() as monitor:
            for command in monitor.listen():
                if command["db"] == self.db:
                    self.commands.append(command["command"])
                if command["command"] == "ECHO monitor-stop":
                    return

    def __enter__(self) -> RedisMonitor:
        self.thread.start()
        with Redis.from_url(self.url) as connection:
            while "ECHO monitor-start" not in self.commands:
                connection.echo("monitor-start")
                time.sleep(0.01)
        return self

    def __exit__(self, *_: object) -> None:
        with Redis.from_url(self.url) as connection:
            connection.echo("monitor-stop")
        self.thread.join(10)
        assert not self.thread.is_alive()
        start = self.commands.index("ECHO monitor-start")
        markers = ("ECHO monitor-start", "ECHO monitor-stop")
        self.commands = [command for command in self.commands[start:] if command not in markers]


def test_fuzzed_ids_are_not_found_and_touch_only_their_own_key(fuzz_client: FlaskClient,
                                                               fuzz_settings: Settings,
                                                               validators: dict[str, Any]) -> None:
    sent: set[str] = set()

    @FUZZ
    @given(job_id=ids)
    def lookups(job_id: str) -> None:
        sent.add(job_id)
        for response in id_requests(fuzz_client, job_id):
            event(f"status {response.status_code}")
            assert response.status_code == 404, (job_id, response.status_code, response.data[:300])
            assert assert_error(response, validators) == "not_found"

    with RedisMonitor(fuzz_settings.redis_url, FUZZ_DB) as monitor:
        lookups()
    # A malformed id never reaches Redis; a well-formed one reads its own job record (and, when there is
    # none, whether that id was ever issued) and nothing else.
    well_formed = [job_id for job_id in sent if VALID_ID.fullmatch(job_id)]
    allowed = {key for job_id in well_formed for key in (f"rq:job:{job_id}", f"slotq:issued:{job_id}")}
    for command in monitor.commands:
        name, *keys_touched = command.split(" ")
        connection_setup = name in ("PING", "SELECT", "HELLO", "CLIENT", "AUTH")
        assert connection_setup or (len(keys_touched) == 1 and keys_touched[0] in allowed), command
    assert len(sent) >= 300 and any(not VALID_ID.fullmatch(job_id) for job_id in sent)


def test_lookalike_keys_are_never_read(fuzz_client: FlaskClient, fuzz_settings: Settings,
                                       validators: dict[str, Any]) -> None:
    real = json.loads(post(fuzz_client, json.dumps({"prompt": "original"})).data)["id"]
    with Redis.from_url(fuzz_settings.redis_url) as connection:
        record = connection.dump(f"rq:job:{real}")
        planted = [job_id for job_id in NASTY_IDS if not VALID_ID.fullmatch(job_id)]
        planted += [real + "/x", real + " ", real.upper() + "*"]
        for job_id in planted:  # a real job's record, under a key that only a malformed id could name
            connection.restore(f"rq:job:{job_id}", 0, record, replace=True)
        before = {key: connection.dump(key) for key in connection.keys("*")}
        for job_id in planted:
            for response in id_requests(fuzz_client, job_id):
                assert response.status_code == 404, (job_id, response.status_code, response.data[:300])
                assert assert_error(response, validators) == "not_found"
        # Nothing was written (no cancel flag, no status change): not the planted records, not the real one.
        assert {key: connection.dump(key) for key in connection.keys("*")} == before


@pytest.mark.parametrize("path", ["%zz", "%", "%2e%2e%2fx", "..%252f..%252f", "%00", "%C0%AE%C0%AE", "%FF%FE",
                                  "%E2%80%AE", "*", "rq:job:x", "a%20b", "%0d%0aX-Injected:%201"])
def test_raw_percent_encoded_ids_are_not_found(fuzz_client: FlaskClient, path: str,
                                               validators: dict[str, Any]) -> None:
    for response in (fuzz_client.get(f"/v1/jobs/{path}"), fuzz_client.delete(f"/v1/jobs/{path}"),
                     fuzz_client.get(f"/v1/jobs/{path}/images/0")):
        assert response.status_code == 404, (path, response.status_code, response.data[:300])
        assert assert_error(response, validators) == "not_found"
        assert "X-Injected" not in response.headers


def test_an_id_with_a_slash_at_an_end_is_not_redirected(fuzz_client: FlaskClient) -> None:
    statuses = [fuzz_client.delete("/v1/jobs/%2Fabc").status_code,
                fuzz_client.get("/v1/jobs/abc%2F/images/0").status_code]
    assert statuses == [404, 404]


def test_an_id_with_a_final_newline_is_not_found(fuzz_client: FlaskClient) -> None:
    assert [response.status_code for response in id_requests(fuzz_client, "abc\n")] == [404, 404, 404]


def test_a_query_parameter_that_takes_one_value_given_twice_is_refused(fuzz_client: FlaskClient,
                                                                       validators: dict[str, Any]) -> None:
    job_id = fuzz_client.post("/v1/jobs", json={"prompt": "a"}).get_json()["id"]
    for path in (f"/v1/jobs/{job_id}?wait=1&wait=2", "/v1/jobs?limit=1&limit=2", "/v1/jobs?cursor=a&cursor=b",
                 f"/v1/jobs/{job_id}/events?last_event_id=1-0&last_event_id=2-0"):
        response = fuzz_client.get(path)
        assert response.status_code == 422, (path, response.status_code)
        assert assert_error(response, validators) == "invalid_request"
        assert response.get_json()["error"]["details"][0]["msg"] == "must be given at most once"
    assert fuzz_client.get("/v1/jobs?status=queued&status=running").status_code == 200  # a list: repeated


def test_what_the_web_server_refuses_before_the_app_is_answered_in_the_envelope(
        start_api: Callable[..., Process], settings: Settings, document: dict[str, Any]) -> None:
    api = start_api(settings)
    long_line = b"GET /v1/jobs/" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    large_header = b"GET /v1/queue HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n"
    for request, status, code in [(long_line, 414, "uri_too_long"), (large_header, 431, "headers_too_large"),
                                  (b"NOT HTTP AT ALL\r\n\r\n", 400, "malformed_request")]:
        answered, headers, body = raw_request(api.port, request)
        assert (answered, headers["content-type"]) == (status, "application/json"), body[:300]
        envelope = json.loads(body)
        assert envelope["error"]["code"] == code and envelope["error"]["message"]
        # Documented for every operation, with the code it answers.
        for operations in document["paths"].values():
            for method, operation in operations.items():
                if method != "parameters" and status != 400 and not operation.get("tags"):
                    schema = operation["responses"][str(status)]["content"]["application/json"]["schema"]
                    assert schema["allOf"][1]["properties"]["error"]["properties"]["code"]["enum"] == [code]


# --- c) schemathesis against a real gunicorn API, from the document it serves --------------------

# The acceptance checks too: what the document offers is admitted (496.0 for an integer; no webhook
# where none is sent), and what it refuses is refused.
COMPAT_TAGS = "^(OpenAI Images|OpenAI Videos|AUTOMATIC1111|ComfyUI)$"
SCHEMATHESIS_MAX_SIDE = Settings().max_side  # the API below runs with the default
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance, positive_data_acceptance,
          negative_data_rejection]


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_and_no_drift_from_the_document(
        start_api: Callable[..., Process], redis_url: str, model_cache: Path) -> None:
    # A small cap, so that 429 (and its Retry-After) is reached and checked too.
    settings = Settings(redis_url=_db_url(redis_url, SCHEMATHESIS_DB), queue_name="schemathesis",
                        queue_capacity=10, cache_dir=model_cache, drain_s=0)
    with Redis.from_url(settings.redis_url) as connection:
        connection.flushdb()
        api = start_api(settings)
        # The compatibility surfaces answer when a job ends (no worker here), take fields they do not
        # apply and refuse what their clients' servers refuse (ComfyUI a graph it cannot run, whatever
        # its JSON schema), as their clients expect: their tests use real clients (tests/api/compat/).
        schema = schemathesis.openapi.from_url(api.url + "/openapi.json").exclude(tag_regex=COMPAT_TAGS)
        session = requests.Session()
        real = [session.post(api.url + "/v1/jobs", json={"prompt": "real"}).json()["id"] for _ in range(3)]
        on_real_jobs = [schema[path][method].as_strategy(path_parameters={"id": job_id})
                        for path, method in [("/v1/jobs/{id}", "GET"), ("/v1/jobs/{id}", "DELETE"),
                                             ("/v1/jobs/{id}/images/{index}", "GET")] for job_id in real]
        cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE),
                          schema.as_strategy(GenerationMode.NEGATIVE), *on_real_jobs)
        seen: dict[str, int] = {}

        @hsettings(FUZZ, max_examples=500)
        @given(case=cases)
        def run(case: schemathesis.Case) -> None:
            _short_wait(case)
            _fit_inputs(case)
            response = case.call_and_validate(session=session, checks=CHECKS)
            label = f"{case.method} {case.path} {response.status_code}"
            seen[label] = seen.get(label, 0) + 1

        try:
            run()
        finally:
            session.close()
            connection.flushdb()
    print("schemathesis answers:", dict(sorted(seen.items())))
    assert any(label.startswith("POST /v1/jobs 202") for label in seen)


# The document's `data-url` strings, drawn as valid images: a string that matches its pattern is
# rarely one, and what makes one valid (its bytes, its size) no schema says.
schemathesis.openapi.format("data-url", st.sampled_from(sorted(IMAGES)))


def _fit_inputs(case: schemathesis.Case) -> None:
    """What the document cannot say of a job with a start image or a hires pass, made true without
    touching what it checks: the job's sides are the image's, the mask is of the image's size, a
    step runs; a hires pass is for a job without an image, at a size within the limit."""
    body = case.body
    if case.meta is None or case.meta.generation.mode is not GenerationMode.POSITIVE:
        return  # a negative case stays as invalid as it was drawn
    if case.path != "/v1/jobs" or not isinstance(body, dict):
        return
    _fit_hires(body)
    if body.get("image") not in IMAGES:
        return
    for side in ("width", "height"):
        body.pop(side, None)
    if body.get("mask") in {*IMAGES, *IMAGES.values()}:
        body["mask"] = IMAGES[body["image"]]
    if runs_no_step(body):
        body["strength"] = 1.0


def _fit_hires(body: dict[str, Any]) -> None:
    """A drawn hires pass on a job with an image dropped; else its scale and denoise made to fit."""
    hires = body.get("hires")
    if not isinstance(hires, dict):
        return
    if body.get("image") is not None:
        del body["hires"]
        return
    sides = [body.get(side, 512) for side in ("width", "height")]
    hires["scale"] = min(hires.get("scale", 2.0), min(SCHEMATHESIS_MAX_SIDE / side for side in sides))
    if hires["scale"] <= 1:
        del body["hires"]
        return
    steps = hires.get("steps") or body.get("steps", 30)
    hires["denoise"] = min(1.0, max(hires.get("denoise", 0.5), 1.0 / steps + 1e-9))


def _short_wait(case: schemathesis.Case) -> None:
    """A valid ``?wait`` holds a GET on a waiting job for up to 60 s: keep the fuzzing quick."""
    wait = (case.query or {}).get("wait")
    if isinstance(wait, int | float) and not isinstance(wait, bool) and 0.2 < wait <= 60:
        case.query["wait"] = 0.2
