"""api/state.py: what ``create_app`` installs on the app, read through one accessor each."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from flask import Flask

from api import state
from api.app import create_app
from api.jobs import Jobs
from api.longpoll import Waits
from api.metrics import ApiMetrics
from api.streams import Streams
from shared.contract.settings import Settings
from shared.contract.tenants import Tenant

KEY = "state-test-key"


@pytest.fixture
def app(settings: Settings) -> Iterator[Flask]:
    """The API with one API key, its Redis connection closed afterwards."""
    built = create_app(settings.model_copy(update={"api_keys": {KEY: "alice"}}))
    yield built
    state.queue(built).connection.close()


def test_install_builds_one_of_each_on_one_connection(app: Flask) -> None:
    jobs, queue = state.jobs(app), state.queue(app)
    assert isinstance(jobs, Jobs) and jobs.queue is queue and jobs.settings is state.settings(app)
    assert isinstance(state.waits(app), Waits) and jobs.waits is state.waits(app)
    assert isinstance(state.streams(app), Streams) and isinstance(state.metrics(app), ApiMetrics)
    assert isinstance(state.draining(app), threading.Event) and not state.draining(app).is_set()
    assert set(state.key_policies(app)) == {KEY} and state.key_policies(app)[KEY].tenant == "alice"


def test_the_keys_keep_their_names(app: Flask) -> None:
    # Tests and benchmarks (bench/admission.py builds a bare app with two of them) use these names.
    named = {"slotq.settings": state.settings, "slotq.queue": state.queue, "slotq.draining": state.draining,
             "slotq.waits": state.waits, "slotq.jobs": state.jobs, "slotq.streams": state.streams,
             "slotq.keys": state.key_policies, "slotq.metrics": state.metrics}
    assert {name: app.extensions[name] for name in named} == {name: read(app) for name, read in named.items()}


def test_without_an_app_the_accessors_read_the_current_one(app: Flask, settings: Settings) -> None:
    other = create_app(settings)
    try:
        with other.app_context():
            assert state.settings() is state.settings(other) is not state.settings(app)
            assert state.jobs() is state.jobs(other) and state.key_policies() == {}
        with app.app_context():
            assert state.jobs() is state.jobs(app) and state.draining() is state.draining(app)
    finally:
        state.queue(other).connection.close()


def test_a_request_has_no_tenant_until_one_is_set(app: Flask) -> None:
    alice = Tenant("alice")
    with app.test_request_context("/v1/queue"):
        assert state.tenant() is None
        state.set_tenant(alice)
        assert state.tenant() is alice
    with app.test_request_context("/v1/queue"):
        assert state.tenant() is None  # each request names its own


def test_a_key_names_the_requests_tenant(app: Flask) -> None:
    seen: list[Tenant | None] = []
    app.after_request(lambda response: seen.append(state.tenant()) or response)
    client = app.test_client()
    assert client.get("/v1/queue", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/sdapi/v1/options", auth=("any", KEY)).status_code == 200
    assert [tenant.name if tenant else None for tenant in seen] == ["alice", "alice"]
    assert client.get("/v1/queue").status_code == 401 and client.get("/healthz").status_code == 200
    assert seen[-1] is None  # an unauthenticated route sets none


def test_close_stops_the_listener_then_closes_the_connections(settings: Settings) -> None:
    """An app closed while a request waits on a job: the request answers, the listener thread ends
    and nothing stays subscribed (before, the listener subscribed again on a fresh connection that
    nothing closed, which the garbage collector later found open)."""
    from concurrent.futures import ThreadPoolExecutor

    from redis import Redis

    from shared.contract import keys
    from tests.conftest import post_job, wait_for

    chosen = settings.model_copy(update={"queue_name": "state-close"})  # a channel no other app hears
    app, redis = create_app(chosen), Redis.from_url(chosen.redis_url)
    try:
        job_id = post_job(app.test_client()).get_json()["id"]
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(app.test_client().get, f"/v1/jobs/{job_id}?wait=20")
            wait_for(lambda: state.waits(app).waiting == 1, timeout=10, what="the held request")
            wait_for(lambda: redis.pubsub_numsub(keys.events_channel("state-close"))[0][1] == 1, timeout=10,
                     what="the listener")
            listener = state.waits(app)._last_listener
            state.close(app)
            held.result(timeout=5).close()
        assert listener is not None and not listener.is_alive()
        assert redis.pubsub_numsub(keys.events_channel("state-close"))[0][1] == 0
    finally:
        redis.close()
