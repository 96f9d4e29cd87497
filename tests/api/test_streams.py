"""GET /v1/jobs/<id>/events: a job's events as server-sent events, resumable, bounded, tenant-scoped."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from flask.testing import FlaskClient
from redis import Redis
from rq.job import Job
from rq.serializers import JSONSerializer

from api import streams
from shared.contract import keys
from shared.contract.settings import Settings
from shared.store import events, waiting
from tests.conftest import app_client, post_job

KEYS = {"key-a": "alice", "key-c": "carol"}
DEADLINE_S = 30.0


class Reader:
    """Reads a stream's frames on a thread of its own: (id, event, data) each, comments as
    (None, ":", text); the stream's end as None."""

    def __init__(self, response: Any) -> None:
        self.response, self.frames = response, queue.Queue()
        self.leaving = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        buffer = ""
        try:
            for chunk in self.response.response:
                buffer += chunk.decode() if isinstance(chunk, bytes) else chunk
                while "\n\n" in buffer:
                    block, buffer = buffer.split("\n\n", 1)
                    self.frames.put(parse(block))
                if self.leaving.is_set():
                    break  # as a server sees a client gone: at its next write
        finally:
            self.response.close()  # on this thread, as the WSGI server does
            self.frames.put(None)

    def next(self, skip: tuple[str, ...] = ("retry", ":")) -> tuple[str | None, str, Any] | None:
        """The next frame that is an event (retry lines and comments skipped unless asked for)."""
        while True:
            frame = self.frames.get(timeout=DEADLINE_S)
            if frame is None or frame[1] not in skip:
                return frame

    def close(self) -> None:
        """Hang up, and wait until the server side has let the stream go."""
        self.leaving.set()
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive()


def parse(block: str) -> tuple[str | None, str, Any]:
    fields: dict[str, str] = {}
    for line in block.split("\n"):
        if line.startswith(":"):
            return None, ":", line[1:].strip()
        name, _, value = line.partition(": ")
        fields[name] = value
    if "retry" in fields:
        return None, "retry", fields["retry"]
    return fields.get("id"), fields["event"], json.loads(fields["data"])


def open_stream(client: FlaskClient, job_id: str, key: str | None = None, last: str | None = None) -> Reader:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if last:
        headers["Last-Event-ID"] = last
    response = client.get(f"/v1/jobs/{job_id}/events", headers=headers, buffered=False)
    assert response.status_code == 200, response.get_data()
    assert response.mimetype == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-store" and response.headers["X-Accel-Buffering"] == "no"
    return Reader(response)


@pytest.fixture(autouse=True)
def quick_keepalive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep-alives often, so that a reader that hangs up is noticed soon (at the next write)."""
    monkeypatch.setattr(streams, "KEEPALIVE_S", 0.1)


@pytest.fixture
def keyed(settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(Settings(**(settings.model_dump() | {"api_keys": KEYS})))


def submit(client: FlaskClient, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = client.post("/v1/jobs", data=json.dumps({"prompt": "a fox", "steps": 2}),
                           content_type="application/json", headers=headers)
    assert response.status_code == 202
    return str(response.get_json()["id"])


def test_a_queued_job_streams_its_place_then_its_end(client: FlaskClient) -> None:
    job_id = submit(client)
    reader = open_stream(client, job_id)
    event_id, event, view = reader.next()
    assert (event, view["id"], view["status"], view["position"]) == ("queued", job_id, "queued", 0)
    assert event_id is not None and event_id.endswith("/q0")
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
    event_id, event, view = reader.next()
    assert (event, view["status"]) == ("canceled", "canceled") and event_id.endswith("/end")
    assert reader.next() is None  # the stream ends after the final event


def test_a_client_that_reconnects_gets_what_it_missed_and_nothing_twice(client: FlaskClient) -> None:
    job_id = submit(client)
    first = open_stream(client, job_id)
    seen, _, _ = first.next()
    first.close()
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 200  # while it was away
    again = open_stream(client, job_id, last=seen)
    event_id, event, _ = again.next()
    assert event == "canceled"  # not the queued event it had already
    assert again.next() is None
    # Told the final event, EventSource is told to stop reconnecting.
    assert client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": event_id}).status_code == 204


def test_a_job_that_ended_answers_its_final_event_at_once(client: FlaskClient) -> None:
    job_id = submit(client)
    assert client.delete(f"/v1/jobs/{job_id}").status_code == 200
    reader = open_stream(client, job_id)
    events = []
    while (frame := reader.next()) is not None:
        events.append(frame[1])
    assert events == ["canceled"]  # its log, less the `queued` it has moved past


def test_positions_count_down_as_the_line_moves(client: FlaskClient, redis: Redis,
                                                settings: Settings) -> None:
    ids = [submit(client) for _ in range(3)]
    reader = open_stream(client, ids[2])
    assert reader.next()[2]["position"] == 2
    for expected in (1, 0):
        claimed = waiting.claim(redis, settings.line, keys.claims_key("stream-test"))
        assert claimed is not None  # a worker's claim moves the line up: the stream says so
        event_id, event, view = reader.next()
        assert (event, view["position"]) == ("queued", expected) and event_id.endswith(f"/q{expected}")
    reader.close()


def test_only_a_process_whose_stream_watches_a_line_hears_of_its_claims(
        client: FlaskClient, redis: Redis, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each claim changes the line: a process with no stream open must not wake for it (on a small
    # machine each wake-up of an idle process costs about a third of a millisecond).
    from api import longpoll
    from tests.conftest import wait_for

    monkeypatch.setattr(longpoll, "LINGER_S", 0.5)
    lines, jobs = keys.lines_channel(settings.queue_name), keys.events_channel(settings.queue_name)

    def listeners(channel: str) -> int:
        return int(redis.pubsub_numsub(channel)[0][1])

    wait_for(lambda: listeners(lines) == 0, timeout=5, what="an earlier test's stream's linger to pass")
    ids = [submit(client) for _ in range(2)]
    held = submit(client)  # a request waits on it all along: the listener runs
    waiter = threading.Thread(target=lambda: client.application.test_client().get(f"/v1/jobs/{held}?wait=20"))
    waiter.start()
    wait_for(lambda: listeners(jobs) == 1, timeout=5, what="the listener")
    assert listeners(lines) == 0
    reader = open_stream(client, ids[1])
    assert reader.next()[2]["position"] == 1
    assert listeners(lines) == 1  # joined before the stream's first read
    assert waiting.claim(redis, settings.line, keys.claims_key("stream-test")) is not None
    assert reader.next()[2]["position"] == 0
    reader.close()
    wait_for(lambda: listeners(lines) == 0, timeout=5, what="the lines channel left after LINGER_S")
    assert listeners(jobs) == 1 and waiter.is_alive()  # the jobs' channel stays while a request waits
    assert client.delete(f"/v1/jobs/{held}").status_code == 200
    waiter.join(10)


def test_a_job_that_ends_while_its_log_is_read_streams_what_it_logged_before_its_end(
        client: FlaskClient, redis: Redis) -> None:
    # The end lands between the stream's read of the log and its read of the record (a race seen in
    # CI: a client missed the last step's progress). The end's writes are made then, by hand.
    job_id = submit(client)
    opened = client.application.extensions["slotq.streams"]
    job = Job.fetch(job_id, connection=redis, serializer=JSONSerializer)
    real_view, ended = opened._view, threading.Event()

    def view_after_the_end(of: Job) -> Any:
        if not ended.is_set():
            ended.set()
            events.log(redis, job_id, "progress", {"step": 2, "total": 2})
            assert client.delete(f"/v1/jobs/{job_id}").status_code == 200  # logs `canceled`
        return real_view(of)

    opened._view = view_after_the_end
    frames = [parse(frame.strip("\n")) for frame in opened._pending(job, streams.Cursor())]
    assert [(event, data) for _, event, data in frames if event == "progress"] == [
        ("progress", {"step": 2, "total": 2})]
    assert frames[-1][1] == "canceled" and frames[-1][0].endswith("/end"), frames
    assert [event for _, event, _ in frames].count("canceled") == 1


def test_a_quiet_stream_sends_keepalive_comments(client: FlaskClient) -> None:
    reader = open_stream(client, submit(client))
    assert reader.next()[1] == "queued"
    assert reader.next(skip=()) == (None, ":", "keep-alive")
    reader.close()


def test_streams_are_tenant_scoped(keyed: FlaskClient) -> None:
    alices = submit(keyed, "key-a")
    open_stream(keyed, alices, key="key-a").close()  # her own: a stream
    response = keyed.get(f"/v1/jobs/{alices}/events", headers={"Authorization": "Bearer key-c"})
    assert response.status_code == 404 and response.get_json()["error"]["code"] == "not_found"


def test_streams_are_bounded_per_process(settings: Settings) -> None:
    for client in app_client(settings.model_copy(update={"max_streams": 1})):
        job_id = submit(client)
        held = open_stream(client, job_id)
        refused = client.get(f"/v1/jobs/{job_id}/events")
        assert refused.status_code == 503 and refused.get_json()["error"]["code"] == "too_many_streams"
        assert int(refused.headers["Retry-After"]) >= 1
        held.close()  # its slot comes back
        open_stream(client, job_id).close()


def test_a_tenant_holds_at_most_its_share_of_the_streams(settings: Settings) -> None:
    """Of 4 streams, one tenant holds 2 (SLOTQ_TENANT_WAIT_SHARE, one half): a third is refused 429,
    while another tenant still opens one."""
    for client in app_client(Settings(**(settings.model_dump() | {"api_keys": KEYS, "max_streams": 4}))):
        alices = [submit(client, "key-a") for _ in range(3)]
        held = [open_stream(client, job_id, key="key-a") for job_id in alices[:2]]
        refused = client.get(f"/v1/jobs/{alices[2]}/events", headers={"Authorization": "Bearer key-a"})
        assert refused.status_code == 429 and refused.get_json()["error"]["code"] == "tenant_stream_share"
        assert int(refused.headers["Retry-After"]) >= 1
        open_stream(client, submit(client, "key-c"), key="key-c").close()  # carol keeps her share
        held[0].close()  # alice's slot comes back
        open_stream(client, alices[2], key="key-a").close()
        held[1].close()


@pytest.mark.parametrize("last", ["x", "1-2/q", "1-2/end/q3", "12345678901234567890123-0"])
def test_a_malformed_last_event_id_is_refused(client: FlaskClient, last: str) -> None:
    job_id = submit(client)
    response = client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": last})
    assert response.status_code == 422
    assert response.get_json()["error"]["details"][0]["loc"] == ["header", "Last-Event-ID"]


def test_an_unknown_job_has_no_stream(client: FlaskClient) -> None:
    response = client.get("/v1/jobs/no-such-job/events")
    assert response.status_code == 404 and response.get_json()["error"]["code"] == "not_found"


def test_a_running_job_streams_its_start_progress_and_result(worker_client: FlaskClient) -> None:
    response = post_job(worker_client, steps=4, width=64, height=64)
    job_id = response.get_json()["id"]
    reader = open_stream(worker_client, job_id)
    frames = []
    while (frame := reader.next()) is not None:
        frames.append(frame)
    events = [event for _, event, _ in frames]
    # The session's worker may take it before the stream opens: then there is no `queued`.
    assert events[0] in ("queued", "started") and "started" in events and events[-1] == "succeeded"
    steps = [data["step"] for _, event, data in frames if event == "progress"]
    assert steps == sorted(steps) and steps[0] == 0 and steps[-1] == 4
    assert all(data["total"] == 4 for _, event, data in frames if event == "progress")
    assert frames[-1][2]["images"] == [f"/v1/jobs/{job_id}/images/0"]
    ids = [event_id for event_id, _, _ in frames]
    assert len(set(ids)) == len(ids)  # each event once


def test_open_streams_hold_no_thread_of_the_api(settings: Settings, start_api: Any) -> None:
    """With gevent (the default), six open streams on a process of two threads leave it answering."""
    import http.client
    from urllib.parse import urlsplit

    api = start_api(settings, api_workers=1, api_threads=2, max_streams=20, queue_capacity=20)
    port = urlsplit(api.url).port
    assert settings.api_worker_class == "gevent"
    opened = []
    for _ in range(6):
        job_id = http_submit(api.url)
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        connection.request("GET", f"/v1/jobs/{job_id}/events")
        response = connection.getresponse()
        assert response.status == 200 and response.readline() == b"retry: 1000\n"
        opened.append(connection)
    for _ in range(3):  # each answered at once, while every stream stays open
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            connection.request("GET", "/v1/queue")
            assert json.loads(connection.getresponse().read())["waiting"] == 6
        finally:
            connection.close()
    assert http_submit(api.url)
    for connection in opened:
        connection.close()


def test_many_streams_at_once_wait_for_a_redis_connection_rather_than_fail(settings: Settings,
                                                                           start_api: Any) -> None:
    """Streams opened together each want a Redis connection at the same moment: with fewer in the
    pool than streams, they wait their turn (a blocking pool), and every one gets its events."""
    import http.client
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlsplit

    api = start_api(settings, api_workers=1, max_streams=40, queue_capacity=40, redis_max_connections=3)
    port = urlsplit(api.url).port
    ids = [http_submit(api.url) for _ in range(24)]

    def first_event(job_id: str) -> str:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        try:
            connection.request("GET", f"/v1/jobs/{job_id}/events")
            response = connection.getresponse()
            assert response.status == 200, response.read()
            while not (line := response.readline().decode()).startswith("event:"):
                assert line, "the stream ended before its first event"
            return line.strip()
        finally:
            connection.close()

    with ThreadPoolExecutor(len(ids)) as pool:
        assert list(pool.map(first_event, ids)) == ["event: queued"] * len(ids)
    assert "Too many connections" not in api.output()


def http_submit(url: str) -> str:
    from tests.conftest import http_post_job

    status, body, _ = http_post_job(url, {"prompt": "a fox", "steps": 2})
    assert status == 202, body
    return str(body["id"])
