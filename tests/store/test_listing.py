"""GET /v1/jobs: the caller's jobs, newest first, by status, a page at a time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient
from redis import Redis
from rq.job import Job

from shared.contract import keys
from shared.contract.settings import Settings
from tests.conftest import app_client, post_job

KEYS = {"key-a": "alice", "key-c": "carol"}


@pytest.fixture
def roomy(settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(settings.model_copy(update={"queue_capacity": 50}))


@pytest.fixture
def keyed(settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(Settings(**(settings.model_dump() | {"api_keys": KEYS, "queue_capacity": 50})))


def submit(client: FlaskClient, key: str | None = None, **body: Any) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = client.post("/v1/jobs", data=json.dumps({"prompt": "a fox", **body}),
                           content_type="application/json", headers=headers)
    assert response.status_code == 202, response.get_json()
    return str(response.get_json()["id"])


def listed(client: FlaskClient, query: str = "", key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = client.get(f"/v1/jobs{query}", headers=headers)
    assert response.status_code == 200, response.get_json()
    return response.get_json()


def every_page(client: FlaskClient, query: str) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        page = listed(client, query + (f"&cursor={cursor}" if cursor else ""))
        pages.append([view["id"] for view in page["jobs"]])
        cursor = page["next"]
        if cursor is None:
            return pages
        assert len(pages) < 20, "the cursors never end"


def test_jobs_are_listed_newest_first_with_their_views(roomy: FlaskClient) -> None:
    ids = [submit(roomy) for _ in range(5)]
    page = listed(roomy)
    assert [view["id"] for view in page["jobs"]] == ids[::-1] and page["next"] is None
    # The views are the jobs' own: a waiting job with its place in the line.
    assert [view["position"] for view in page["jobs"]] == [4, 3, 2, 1, 0]
    assert page["jobs"][0] == roomy.get(f"/v1/jobs/{ids[-1]}").get_json()


def test_pages_follow_the_cursor_without_gaps_or_repeats(roomy: FlaskClient) -> None:
    ids = [submit(roomy) for _ in range(7)]
    pages = every_page(roomy, "?limit=3")
    assert [len(page) for page in pages] == [3, 3, 1]
    assert [job_id for page in pages for job_id in page] == ids[::-1]
    # A job admitted between two reads does not move the pages after the cursor.
    first = listed(roomy, "?limit=3")
    newer = submit(roomy)
    second = listed(roomy, f"?limit=3&cursor={first['next']}")
    assert [view["id"] for view in second["jobs"]] == ids[::-1][3:6] and newer not in ids
    assert listed(roomy, "?limit=1")["jobs"][0]["id"] == newer


def test_status_filters_one_or_several(roomy: FlaskClient) -> None:
    ids = [submit(roomy) for _ in range(4)]
    for job_id in ids[1:3]:
        assert roomy.delete(f"/v1/jobs/{job_id}").status_code == 200
    assert [view["id"] for view in listed(roomy, "?status=canceled")["jobs"]] == [ids[2], ids[1]]
    assert [view["id"] for view in listed(roomy, "?status=queued")["jobs"]] == [ids[3], ids[0]]
    both = [view["id"] for view in listed(roomy, "?status=queued,canceled")["jobs"]]
    repeated = [view["id"] for view in listed(roomy, "?status=queued&status=canceled")["jobs"]]
    assert both == repeated == ids[::-1]
    assert listed(roomy, "?status=succeeded") == {"jobs": [], "next": None}
    # A filter pages too: two canceled jobs, one a page.
    assert every_page(roomy, "?status=canceled&limit=1") == [[ids[2]], [ids[1]], []]  # ids[0] is below
    assert every_page(roomy, "?limit=2") == [ids[:1:-1], ids[1::-1]]  # nothing below: no empty page


def test_a_tenant_lists_only_its_own_jobs(keyed: FlaskClient) -> None:
    alices = [submit(keyed, "key-a") for _ in range(2)]
    carols = [submit(keyed, "key-c") for _ in range(3)]
    assert [view["id"] for view in listed(keyed, key="key-a")["jobs"]] == alices[::-1]
    assert [view["id"] for view in listed(keyed, key="key-c")["jobs"]] == carols[::-1]
    assert keyed.get("/v1/jobs").status_code == 401  # a key is needed to list, as for every read


def test_250_jobs_page_through_without_gaps_or_repeats_and_others_see_none(settings: Settings) -> None:
    for client in app_client(Settings(**(settings.model_dump() | {"api_keys": KEYS, "queue_capacity": 300}))):
        alices = [submit(client, "key-a", steps=1) for _ in range(250)]
        carols = [submit(client, "key-c", steps=1) for _ in range(3)]
        pages, cursor = [], None
        while True:
            page = listed(client, "?limit=100" + (f"&cursor={cursor}" if cursor else ""), key="key-a")
            pages.append([view["id"] for view in page["jobs"]])
            if (cursor := page["next"]) is None:
                break
        assert [len(page) for page in pages] == [100, 100, 50]
        assert [job_id for page in pages for job_id in page] == alices[::-1]  # each once, newest first
        assert [view["id"] for view in listed(client, "?limit=100", key="key-c")["jobs"]] == carols[::-1]


@pytest.mark.parametrize("query, loc", [("?limit=0", "limit"), ("?limit=101", "limit"), ("?limit=x", "limit"),
                                        ("?limit=-1", "limit"), ("?status=done", "status"),
                                        ("?status=queued,", "status"), ("?cursor=bm90LWEtbnVtYmVy", "cursor"),
                                        ("?cursor=%FF", "cursor"), ("?cursor=" + "1" * 17, "cursor"),
                                        ("?cursor=1e9", "cursor"), ("?cursor=inf", "cursor"),
                                        ("?cursor=-1", "cursor"), ("?cursor=", "cursor")])
def test_a_bad_query_is_refused_with_its_place(roomy: FlaskClient, query: str, loc: str) -> None:
    submit(roomy)
    response = roomy.get(f"/v1/jobs{query}")
    assert response.status_code == 422, response.get_json()
    error = response.get_json()["error"]
    assert error["code"] == "invalid_request" and error["details"][0]["loc"] == ["query", loc]


def test_jobs_whose_record_expired_drop_out(roomy: FlaskClient, redis: Redis, settings: Settings) -> None:
    ids = [submit(roomy) for _ in range(3)]
    index = keys.listed_key(settings.queue_name, "")
    redis.delete(Job.key_for(ids[1]))  # as its TTL would
    assert [view["id"] for view in listed(roomy)["jobs"]] == [ids[2], ids[0]]
    assert redis.zscore(index, ids[1]) is None and redis.zcard(index) == 2
    # Entries older than any record's TTL are trimmed at the next admission, and the set expires.
    redis.zadd(index, {"ancient": 1.0})
    submit(roomy)
    assert redis.zscore(index, "ancient") is None
    assert 0 < redis.ttl(index) <= max(settings.record_ttl_s, settings.failure_ttl_s)


def test_a_refusal_lists_nothing(settings: Settings, redis: Redis) -> None:
    for client in app_client(settings.model_copy(update={"queue_capacity": 1})):
        kept = submit(client)
        assert post_job(client).status_code == 429
        assert [view["id"] for view in listed(client)["jobs"]] == [kept]
        assert redis.zcard(keys.listed_key(settings.queue_name, "")) == 1
