"""Bodies and headers a client sends, on every surface (api/bodies.py): nested without end, numbers
JSON has not, auth bytes that are not ASCII, a chunked body past the limit. Each is a 4xx in the
surface's envelope, never a 500, and leaves nothing in Redis."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from redis import Redis

from api import bodies
from shared.contract.settings import Settings
from tests.conftest import Process, app_client, box_mask, data_url, raw_request, start_image

KEY = "sk-alice"
BEARER = {"Authorization": f"Bearer {KEY}"}
BASIC = {"Authorization": "Basic " + base64.b64encode(f"user:{KEY}".encode()).decode()}
PNG = data_url(start_image(64, 64, 0)).split(",", 1)[1]
MASK = data_url(box_mask(64, 64)).split(",", 1)[1]
NON_FINITE = ["NaN", "-NaN", "Infinity", "-Infinity", "1e400", "-2E999"]
BODIES = hsettings(max_examples=60, deadline=None, database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                          HealthCheck.data_too_large])


@pytest.fixture
def keyed(settings: Settings) -> Iterator[FlaskClient]:
    """The API in-process, keys on: every surface authenticates, then reads its body."""
    yield from app_client(settings.model_copy(update={"api_keys": {KEY: "alice"}, "max_body_bytes": 1 << 20}))


def nested(depth: int, opening: str, closing: str) -> str:
    return opening * depth + closing * depth


def send(client: FlaskClient, surface: str, field: str, value: str) -> Any:
    """One request of ``surface`` whose ``field`` carries ``value`` as written (JSON text)."""
    if surface == "native":
        return client.post("/v1/jobs", data=f'{{"prompt": "x", "{field}": {value}}}',
                           content_type="application/json", headers=BEARER)
    if surface == "openai":
        return client.post("/v1/images/generations", data=f'{{"prompt": "x", "{field}": {value}}}',
                           content_type="application/json", headers=BEARER)
    if surface == "openai-edit":
        body, content_type = multipart({"prompt": "x", field: value}, base64.b64decode(PNG))
        return client.post("/v1/images/edits", data=body, content_type=content_type, headers=BEARER)
    body = f'{{"prompt": "x", "init_images": ["{PNG}"], "mask": "{MASK}", "steps": 1, "{field}": {value}}}'
    return client.post("/sdapi/v1/img2img", data=body, content_type="application/json", headers=BASIC)


def multipart(fields: dict[str, str], image: bytes) -> tuple[bytes, str]:
    """A multipart/form-data body in memory (the test client's own spools a large one to a file it
    leaves open)."""
    boundary = "slotq-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
             for name, value in fields.items()]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="in.png"\r\n'
                 "Content-Type: image/png\r\n\r\n".encode() + image + f"\r\n--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


# Per surface, fields that take a number, and fields that take JSON of some depth.
NUMBER_FIELDS = {"native": ["guidance_scale", "strength", "seed"], "openai": ["guidance_scale", "seed", "n"],
                 "openai-edit": ["guidance_scale", "strength"], "a1111": ["mask_blur", "cfg_scale", "seed"]}
JSON_FIELDS = {"native": ["prompt", "loras"], "openai": ["prompt", "loras"], "openai-edit": ["loras"],
               "a1111": ["override_settings", "alwayson_scripts", "prompt"]}


def refused(response: Any, surface: str) -> None:
    """A 4xx in the surface's envelope: an object whose error names a code."""
    assert 400 <= response.status_code < 500, (response.status_code, response.get_data()[:300])
    answer = response.get_json()
    code = answer["code"] if surface == "a1111" else answer["error"]["code"]
    assert isinstance(code, str) and code != "internal_error", answer


def unchanged(redis: Redis) -> Callable[[], None]:
    """A check that Redis holds the keys it holds now, and no more."""
    before = set(redis.keys())
    return lambda: assert_no_new(before, set(redis.keys()))


def assert_no_new(before: set[bytes], after: set[bytes]) -> None:
    assert after - before == set(), sorted(after - before)[:5]


@BODIES
@given(data=st.data(), depth=st.integers(bodies.MAX_DEPTH + 1, 200_000),
       brackets=st.sampled_from(["[]", "{}"]))
@pytest.mark.parametrize("surface", sorted(JSON_FIELDS))
def test_a_field_nested_past_the_bound_is_a_4xx(keyed: FlaskClient, redis: Redis, surface: str, data: Any,
                                                depth: int, brackets: str) -> None:
    field = data.draw(st.sampled_from(JSON_FIELDS[surface]))
    check = unchanged(redis)
    value = nested(depth, "[", "]") if brackets == "[]" else '{"a": ' * depth + "1" + "}" * depth
    refused(send(keyed, surface, field, value), surface)
    check()


@BODIES
@given(data=st.data(), number=st.sampled_from(NON_FINITE))
@pytest.mark.parametrize("surface", sorted(NUMBER_FIELDS))
def test_a_number_json_has_not_is_a_4xx(keyed: FlaskClient, redis: Redis, surface: str, data: Any,
                                        number: str) -> None:
    field = data.draw(st.sampled_from(NUMBER_FIELDS[surface]))
    check = unchanged(redis)
    refused(send(keyed, surface, field, number), surface)
    check()


@pytest.mark.parametrize("blur", ["1e308", "999999999999999999999", "-1", "257"])
def test_a1111_mask_blur_out_of_range_is_a_4xx(keyed: FlaskClient, redis: Redis, blur: str) -> None:
    check = unchanged(redis)
    response = send(keyed, "a1111", "mask_blur", blur)
    refused(response, "a1111")
    assert response.get_json()["errors"][0]["loc"] == ["mask_blur"]
    check()


@pytest.mark.parametrize("header", [b"Basic \xff\xfe", b"Basic \xc3\xa9t\xc3\xa9", b"Basic !!!", b"Basic"])
def test_a1111_basic_credentials_that_are_not_ascii_base64_are_a_401(keyed: FlaskClient, redis: Redis,
                                                                      header: bytes) -> None:
    check = unchanged(redis)
    response = keyed.post("/sdapi/v1/txt2img", data="{}", content_type="application/json",
                          headers={"Authorization": header.decode("latin-1")})
    assert response.status_code == 401 and response.get_json()["code"] == "unauthorized", response.get_data()
    check()


@BODIES
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_loads_refuses_anything_but_json_with_a_value_error(data: bytes | str) -> None:
    try:
        bodies.loads(data)
    except ValueError:
        pass


SCALARS = (st.none() | st.booleans() | st.integers() | st.text(max_size=5)
           | st.floats(allow_nan=False, allow_infinity=False))
JSON = st.recursive(SCALARS, lambda children: st.lists(children, max_size=3)
                    | st.dictionaries(st.text(max_size=3), children, max_size=3), max_leaves=20)


@BODIES
@given(JSON)
def test_loads_reads_what_json_writes(document: Any) -> None:
    assert bodies.loads(json.dumps(document)) == document


@pytest.mark.parametrize("depth", [bodies.MAX_DEPTH, bodies.MAX_DEPTH + 1])
def test_the_depth_bound_is_exact(depth: int) -> None:
    text = nested(depth, "[", "]")
    if depth > bodies.MAX_DEPTH:
        with pytest.raises(ValueError, match="nested deeper"):
            bodies.loads(text)
    else:
        assert bodies.loads(text) is not None


def chunked(port: int, path: str, body: bytes, headers: str) -> tuple[int, bytes]:
    """A POST whose body is sent chunked (no Content-Length), through a raw socket; its status and body."""
    request = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{headers}"
               "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    status, _, content = raw_request(port, request + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
    return status, content


def test_a_chunked_body_over_the_limit_is_a_413_on_every_surface(start_api: Callable[..., Process],
                                                                  settings: Settings, redis: Redis) -> None:
    api = start_api(settings.model_copy(update={"max_body_bytes": 4096}))
    check = unchanged(redis)
    large = json.dumps({"prompt": "x" * 5000}).encode()
    for path in ("/v1/jobs", "/v1/images/generations", "/sdapi/v1/txt2img"):
        status, content = chunked(api.port, path, large, "")
        assert status == 413, (path, content[:300])
        assert "payload_too_large" in content.decode(), content[:300]
    check()
    # Within the limit, a chunked body is read as any other.
    status, content = chunked(api.port, "/v1/jobs", json.dumps({"prompt": "small", "steps": 2}).encode(), "")
    assert status == 202, content[:300]
