"""Webhooks: signed deliveries to a real receiver, retries, the SSRF guards at admission and delivery."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from flask.testing import FlaskClient
from redis import Redis
from rq.job import Job
from rq.utils import utcparse
from standardwebhooks import Webhook, WebhookVerificationError

from shared.contract import keys
from shared.contract.errors import WebhookRefusedError, WebhookSignatureError
from shared.contract.settings import Settings
from shared.contract.webhooks import Entry, allowance, signed_headers, signing_key, verify
from shared.store import endings, waiting
from shared.store.connection import connect, job_queue, text
from tests.conftest import (
    Process,
    app_client,
    data_url,
    own_database,
    post_job,
    running_worker,
    start_image,
    wait_for,
    wait_for_status,
    waiting_ids,
)
from worker.webhooks import Sender, pin

SECRET = "a-plain-secret-of-the-operator"
WHSEC = "whsec_" + base64.b64encode(b"twenty-four random bytes").decode()
LOOPBACK = ["127.0.0.1/32"]
WEBHOOK_DB = 6
WORKER_MAX_STEPS = 10  # lower than the API's: a job with more steps is a real failing job

# The README's verification snippet, word for word: it must accept what the worker sends.
README_SNIPPET = '''
import base64, hashlib, hmac, time

def verify(secret: str, body: bytes, headers) -> None:
    """Raise ValueError unless `body` was signed with `secret` less than 5 minutes ago."""
    key = base64.b64decode(secret[6:]) if secret.startswith("whsec_") else secret.encode()
    msg_id, stamp = headers["webhook-id"], headers["webhook-timestamp"]
    if abs(time.time() - int(stamp)) > 300:
        raise ValueError("stale or future timestamp")
    mac = hmac.new(key, f"{msg_id}.{stamp}.".encode() + body, hashlib.sha256).digest()
    expected = "v1," + base64.b64encode(mac).decode()
    if not any(hmac.compare_digest(expected.encode(), sig.encode())
               for sig in headers["webhook-signature"].split()):
        raise ValueError("bad signature")
'''


@dataclass(frozen=True)
class Delivery:
    """One POST the receiver got, with its headers' names in lower case, and what it answered."""

    path: str
    headers: dict[str, str]
    body: bytes
    answered: int

    @property
    def payload(self) -> Any:
        return json.loads(self.body)


class Receiver:
    """A real HTTP server on loopback that records every POST; the first ``failures`` get a 500."""

    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []
        self.failures = 0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/hooks/slotq"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the name http.server calls)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                headers = {name.lower(): value for name, value in self.headers.items()}
                status = receiver._answer(self.path, headers, body)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def _answer(self, path: str, headers: dict[str, str], body: bytes) -> int:
        with self._lock:
            status = 500 if self.failures > 0 else 204
            self.failures -= 1
            self.deliveries.append(Delivery(path, headers, body, status))
            return status

    def wait(self, count: int, timeout: float = 30) -> list[Delivery]:
        """The deliveries, once there are at least ``count``."""
        wait_for(lambda: len(self.deliveries) >= count, timeout, what=f"{count} webhook deliveries")
        with self._lock:
            return list(self.deliveries)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(10)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


@pytest.fixture
def hook_settings(settings: Settings) -> Settings:
    """The test database with webhooks on; its queue has no worker, only the test's own senders."""
    return settings.model_copy(update={"queue_name": "webhook-tests", "webhook_secret": SECRET,
                                       "webhook_allow": LOOPBACK})


@pytest.fixture
def hook_client(hook_settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(hook_settings)


@pytest.fixture
def start_sender(hook_settings: Settings) -> Iterator[Callable[..., Sender]]:
    """Start webhook senders in this process, fast-polling and with short backoffs."""
    started: list[Sender] = []
    connection = connect(hook_settings)

    def start(settings: Settings = hook_settings, **options: Any) -> Sender:
        queue = job_queue(connection, settings)
        sender = Sender(queue, settings, poll_s=0.05, backoff_s=0.05, **options)
        sender.start()
        started.append(sender)
        return sender

    yield start
    for sender in started:
        sender.close()
    connection.close()


def submit(client: FlaskClient, url: str, **body: Any) -> str:
    response = post_job(client, webhook=url, **body)
    assert response.status_code == 202, response.get_json()
    return str(response.get_json()["id"])


def outbox_empty(redis: Redis, settings: Settings) -> bool:
    return redis.zcard(keys.webhooks_key(settings.queue_name)) == 0


def assert_signed(delivery: Delivery, secret: str) -> None:
    """Both the reference library and our own helper accept the delivery."""
    reference = Webhook(secret if secret.startswith("whsec_") else secret.encode())
    assert reference.verify(delivery.body, delivery.headers) == delivery.payload
    assert verify(secret, delivery.body, delivery.headers) == delivery.payload
    assert delivery.headers["content-type"] == "application/json"
    assert delivery.headers["webhook-id"].startswith("msg_")


# --- the real worker ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def worker_hook_settings(redis_url: str, model_cache: Path) -> Settings:
    url = own_database(redis_url, WEBHOOK_DB)
    return Settings(redis_url=url, queue_name="webhook-worker-tests", queue_capacity=10,
                    cache_dir=model_cache, drain_s=0, webhook_secret=WHSEC, webhook_allow=LOOPBACK)


@pytest.fixture(scope="module")
def hook_worker(worker_hook_settings: Settings,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    yield from running_worker(worker_hook_settings, tmp_path_factory, "webhooks",
                              webhook_allow=json.dumps(LOOPBACK), max_steps=WORKER_MAX_STEPS)


@pytest.fixture
def worker_hook_client(hook_worker: Process, worker_hook_settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(worker_hook_settings)


def test_a_job_announces_its_start_and_its_end_signed(worker_hook_client: FlaskClient,
                                                      receiver: Receiver) -> None:
    job_id = submit(worker_hook_client, receiver.url, width=64, height=64, steps=2,
                    webhook_events=["started", "completed"])
    done = wait_for_status(worker_hook_client, job_id, "succeeded", "failed")
    started, completed = receiver.wait(2)
    assert [started.payload["type"], completed.payload["type"]] == ["job.started", "job.completed"]
    assert started.payload["data"]["id"] == completed.payload["data"]["id"] == job_id
    assert completed.payload["data"]["status"] == "succeeded" and done["status"] == "succeeded"
    assert completed.payload["data"]["images"] == [f"/v1/jobs/{job_id}/images/0"]
    assert started.headers["webhook-id"] != completed.headers["webhook-id"]
    assert started.path == "/hooks/slotq" and started.headers["host"] == f"127.0.0.1:{receiver.port}"
    for delivery in (started, completed):
        assert_signed(delivery, WHSEC)
        assert delivery.payload["timestamp"].endswith("Z")
    with pytest.raises(WebhookVerificationError):
        Webhook(WHSEC).verify(completed.body + b" ", completed.headers)


def test_a_failed_job_that_asks_for_its_end_only_gets_one_delivery(
        worker_hook_client: FlaskClient, worker_hook_settings: Settings, receiver: Receiver) -> None:
    # More steps than the worker allows: the job starts, then fails the worker's re-validation.
    job_id = submit(worker_hook_client, receiver.url, width=64, height=64, steps=WORKER_MAX_STEPS + 1)
    wait_for_status(worker_hook_client, job_id, "failed")
    [completed] = receiver.wait(1)
    with Redis.from_url(worker_hook_settings.redis_url) as redis:
        wait_for(lambda: outbox_empty(redis, worker_hook_settings), what="the outbox to empty")
    assert len(receiver.deliveries) == 1
    assert completed.payload["type"] == "job.completed" and completed.payload["data"]["id"] == job_id
    assert completed.payload["data"]["status"] == "failed"
    assert completed.payload["data"]["error"]["code"] == "invalid_request"
    assert_signed(completed, WHSEC)


# --- endings outside the worker's run, and retries (senders in this process) ---------------------

def test_a_job_canceled_while_waiting_completes_as_canceled(
        hook_client: FlaskClient, hook_settings: Settings, start_sender: Callable[..., Sender],
        receiver: Receiver, redis: Redis) -> None:
    start_sender()
    job_id = submit(hook_client, receiver.url, webhook_events=["started", "completed"])
    assert hook_client.delete(f"/v1/jobs/{job_id}").status_code == 200
    [delivery] = receiver.wait(1)
    wait_for(lambda: outbox_empty(redis, hook_settings), what="the outbox to empty")
    assert len(receiver.deliveries) == 1  # it never started
    assert delivery.payload["type"] == "job.completed"
    assert delivery.payload["data"]["id"] == job_id and delivery.payload["data"]["status"] == "canceled"
    assert_signed(delivery, SECRET)


def test_a_job_expired_in_the_line_completes_as_expired(
        hook_client: FlaskClient, start_sender: Callable[..., Sender], receiver: Receiver) -> None:
    start_sender()
    job_id = submit(hook_client, receiver.url, deadline_s=0.2)
    # Reading a job past its deadline runs the expiry script, which queues the delivery itself.
    wait_for(lambda: hook_client.get(f"/v1/jobs/{job_id}").get_json()["status"] == "expired",
             what="the job to expire")
    [delivery] = receiver.wait(1)
    assert delivery.payload["type"] == "job.completed"
    assert delivery.payload["data"]["id"] == job_id and delivery.payload["data"]["status"] == "expired"
    assert_signed(delivery, SECRET)


def end_record(redis: Redis, settings: Settings, job_id: str) -> dict[str, Any]:
    """What an end left of a job: its hash's status, meta fields and TTL (in minutes), its final
    event and the TTLs of its log and inputs, and its outbox entry."""
    job_key, log_key, inputs_key = Job.key_for(job_id), keys.log_key(job_id), keys.inputs_key(job_id)
    meta = json.loads(redis.hget(job_key, "meta") or b"{}")
    [entry] = [Entry.decode(raw) for raw in redis.zrange(keys.webhooks_key(settings.queue_name), 0, -1)
               if Entry.decode(raw).job == job_id]
    return {"status": redis.hget(job_key, "status"), "meta": sorted(meta), "expired": meta.get("expired"),
            "ended_at": utcparse(text(redis.hget(job_key, "ended_at") or b"")).year,
            "ttl": round(redis.ttl(job_key) / 60), "inputs_ttl": round(redis.ttl(inputs_key) / 60),
            "log_ttl": round(redis.ttl(log_key) / 60), "last_event": redis.xrevrange(log_key, count=1)[0][1],
            "webhook": (entry.event, entry.attempt, entry.id.startswith("msg_"), len(entry.id))}


@pytest.fixture
def ending_settings(hook_settings: Settings) -> Settings:
    """Webhooks on, with record and image TTLs of their own."""
    return hook_settings.model_copy(update={"record_ttl_s": 50_000, "result_ttl_s": 4_000})


@pytest.fixture
def ending_client(ending_settings: Settings) -> Iterator[FlaskClient]:
    yield from app_client(ending_settings)


def test_an_end_written_from_python_leaves_what_the_expiry_in_the_line_leaves(
        ending_client: FlaskClient, ending_settings: Settings, receiver: Receiver, redis: Redis) -> None:
    # One job expires at its claim (Python's end_job), the other in the line (lib/expiry.lua's
    # script): both ends are lib/ending.lua's writes, so the two records read alike.
    settings, claims = ending_settings, keys.claims_key("ending-test")
    queue = job_queue(connect(settings), settings)
    image = data_url(start_image(64, 64))
    at_claim, in_line = [submit(ending_client, receiver.url, image=image, deadline_s=0.3) for _ in range(2)]
    claimed = waiting.claim(redis, settings.line, claims)
    assert claimed is not None and claimed.job_id == at_claim
    wait_for(lambda: waiting.expire_due(queue, settings, settings.line)
             and waiting.position(redis, settings.line, in_line) is None, what="the expiry in the line")
    job = Job(at_claim, connection=queue.connection, serializer=queue.serializer)
    job.restore(claimed.record)
    endings.expire_claimed(job, queue, settings, claims)
    python, lua = end_record(redis, settings, at_claim), end_record(redis, settings, in_line)
    assert python == lua
    assert lua["status"] == b"canceled" and lua["expired"] is True and lua["ended_at"] >= 2025
    assert (lua["ttl"], lua["inputs_ttl"], lua["log_ttl"]) == (833, 67, 67)  # 50 000 s, 4 000 s
    assert lua["last_event"] == {b"event": b"expired"} and lua["webhook"] == ("job.completed", 0, True, 36)
    assert redis.hget(keys.ended_key(settings.queue_name), "expired") == b"2"
    assert redis.llen(claims) == 0
    queue.connection.close()


def test_a_failing_receiver_is_retried_with_the_same_message_id(
        hook_client: FlaskClient, hook_settings: Settings, start_sender: Callable[..., Sender],
        receiver: Receiver, redis: Redis) -> None:
    receiver.failures = 2
    start_sender()
    job_id = submit(hook_client, receiver.url)
    hook_client.delete(f"/v1/jobs/{job_id}")
    deliveries = receiver.wait(3)
    wait_for(lambda: outbox_empty(redis, hook_settings), what="the outbox to empty")
    assert [delivery.answered for delivery in receiver.deliveries] == [500, 500, 204]
    assert len({delivery.headers["webhook-id"] for delivery in deliveries}) == 1
    for delivery in deliveries:
        assert_signed(delivery, SECRET)  # each attempt signed afresh


def test_a_receiver_that_never_answers_2xx_is_dropped_after_the_retry_window(
        hook_client: FlaskClient, hook_settings: Settings, start_sender: Callable[..., Sender],
        receiver: Receiver, redis: Redis) -> None:
    receiver.failures = 1_000
    start_sender(hook_settings.model_copy(update={"webhook_retry_s": 0.3}))
    hook_client.delete(f"/v1/jobs/{submit(hook_client, receiver.url)}")
    wait_for(lambda: outbox_empty(redis, hook_settings), what="the delivery to be dropped")
    tries = len(receiver.deliveries)
    assert 2 <= tries < 20  # retried with growing delays, then given up


def test_a_name_that_resolves_to_loopback_is_refused_at_delivery(
        hook_client: FlaskClient, hook_settings: Settings, start_sender: Callable[..., Sender],
        receiver: Receiver, redis: Redis) -> None:
    # Admitted: a name is not looked up at admission. Its sender has no allow-list, and the name
    # resolves to loopback, so nothing is sent and the delivery is dropped, not retried.
    rebinding = {"hook.test": ["127.0.0.1"]}
    start_sender(hook_settings.model_copy(update={"webhook_allow": []}),
                 resolver=lambda host, port: rebinding[host])
    hook_client.delete(f"/v1/jobs/{submit(hook_client, f'http://hook.test:{receiver.port}/x')}")
    wait_for(lambda: outbox_empty(redis, hook_settings), what="the delivery to be dropped")
    assert receiver.deliveries == []


def test_a_delivery_goes_to_the_checked_address_with_the_host_name(
        hook_client: FlaskClient, start_sender: Callable[..., Sender], receiver: Receiver) -> None:
    # The resolver is asked once; the connection goes to its answer, the Host header names the host.
    asked: list[str] = []
    start_sender(resolver=lambda host, port: asked.append(host) or ["127.0.0.1"])
    hook_client.delete(f"/v1/jobs/{submit(hook_client, f'http://hook.test:{receiver.port}/x?y=1')}")
    [delivery] = receiver.wait(1)
    assert asked == ["hook.test"]
    assert delivery.headers["host"] == f"hook.test:{receiver.port}" and delivery.path == "/x?y=1"


# --- admission ---------------------------------------------------------------------------------

@pytest.fixture
def strict_client(settings: Settings) -> Iterator[FlaskClient]:
    """The API with webhooks on and the default empty allow-list."""
    yield from app_client(settings.model_copy(update={"webhook_secret": SECRET}))


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000/", "http://127.1/", "http://2130706433/", "http://0x7f.0.0.1/",
    "http://localhost/", "http://api.localhost./", "http://LOCALHOST:99/", "http://[::1]/",
    "http://[::ffff:127.0.0.1]/", "http://10.1.2.3/", "https://192.168.0.1/", "http://172.16.5.4/",
    "http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/", "http://[fc00::1]/",
    "http://0.0.0.0/", "http://100.64.0.1/", "http://224.0.0.1/", "http://[ff02::1]/",
])
def test_admission_refuses_local_and_private_targets(strict_client: FlaskClient, settings: Settings,
                                                      redis: Redis, url: str) -> None:
    response = post_job(strict_client, webhook=url)
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "webhook_not_allowed"
    assert waiting_ids(redis, settings) == []  # refused before the admission script


@pytest.mark.parametrize("url", ["https://hooks.example.com/slotq", "http://93.184.215.14:8080/x",
                                 "https://[2606:4700::1]/", "http://hook.test/"])
def test_admission_takes_public_addresses_and_any_name(strict_client: FlaskClient, url: str) -> None:
    assert post_job(strict_client, webhook=url).status_code == 202


def test_the_allow_list_opens_its_networks_and_hosts_only(settings: Settings) -> None:
    allowing = settings.model_copy(update={"webhook_secret": SECRET,
                                           "webhook_allow": ["127.0.0.1/32", "10.0.0.0/8", "LocalHost"]})
    for client in app_client(allowing):
        for url in ("http://127.0.0.1:9/", "http://[::ffff:127.0.0.1]/", "http://10.9.8.7/",
                    "http://localhost:8000/"):
            assert post_job(client, webhook=url).status_code == 202, url
        for url in ("http://127.0.0.2/", "http://192.168.1.1/", "http://api.localhost/"):
            assert post_job(client, webhook=url).get_json()["error"]["code"] == "webhook_not_allowed", url


def test_webhooks_are_refused_without_a_secret(client: FlaskClient, settings: Settings, redis: Redis) -> None:
    response = post_job(client, webhook="https://hooks.example.com/slotq")
    assert response.status_code == 400
    assert response.get_json()["error"]["code"] == "webhooks_disabled"
    assert waiting_ids(redis, settings) == []
    assert post_job(client).status_code == 202  # a job without one is as welcome as ever


# --- the delivery-time guard and the signature, as units -----------------------------------------

def test_the_guard_checks_every_address_a_name_resolves_to() -> None:
    def answers(*addresses: str) -> Callable[[str, int], list[str]]:
        return lambda host, port: list(addresses)

    none = allowance([])
    assert pin("hook.test", 443, none, answers("93.184.215.14", "2606:4700::1")) == "93.184.215.14"
    for addresses in (["93.184.215.14", "127.0.0.1"], ["::ffff:10.0.0.1"], ["169.254.169.254"],
                      ["::1"], ["fe80::1%lo"], ["0.0.0.0"]):
        with pytest.raises(WebhookRefusedError):
            pin("hook.test", 443, none, answers(*addresses))
    with pytest.raises(WebhookRefusedError):
        pin("localhost", 80, none, answers("93.184.215.14"))  # a local name, whatever it resolves to
    assert pin("hook.test", 80, allowance(["10.0.0.0/8"]), answers("10.1.1.1")) == "10.1.1.1"
    assert pin("hook.internal", 80, allowance(["hook.internal"]), answers("10.1.1.1")) == "10.1.1.1"
    with pytest.raises(OSError):
        pin("hook.test", 80, none, answers())


@pytest.mark.parametrize("secret", [SECRET, WHSEC])
def test_signatures_follow_standard_webhooks(secret: str) -> None:
    body = b'{"type":"job.completed","data":{"id":"x"}}'
    headers = signed_headers(signing_key(secret), "msg_abc", body)
    reference = Webhook(secret if secret.startswith("whsec_") else secret.encode())
    assert reference.verify(body, headers) == json.loads(body)
    assert verify(secret, body, headers) == json.loads(body)
    snippet: dict[str, Any] = {}
    exec(README_SNIPPET, snippet)  # noqa: S102 (our own constant)
    snippet["verify"](secret, body, headers)
    for tampered_body, tampered_headers in [
            (body + b" ", headers),
            (body, {**headers, "webhook-id": "msg_other"}),
            (body, signed_headers(signing_key("another-secret-entirely"), "msg_abc", body)),
            (body, signed_headers(signing_key(secret), "msg_abc", body, int(time.time()) - 600))]:
        with pytest.raises(WebhookSignatureError):
            verify(secret, tampered_body, tampered_headers)
        with pytest.raises(ValueError):
            snippet["verify"](secret, tampered_body, tampered_headers)
