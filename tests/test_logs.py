"""Request ids and structured logs: one id follows a job from POST to PNG; prompts stay out of logs."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from flask.testing import FlaskClient

from shared.contract.settings import Settings
from tests.conftest import Process, http_post_job, post_job, wait_for, wait_for_status


def test_request_id_is_echoed_or_minted(client: FlaskClient) -> None:
    sent = client.get("/healthz", headers={"X-Request-ID": "trace-7f3a:42"})
    assert sent.headers["X-Request-ID"] == "trace-7f3a:42"
    minted = client.get("/healthz").headers["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", minted)
    # Not a token: a new id, never the header echoed into a log line or a response.
    odd = client.get("/healthz", headers={"X-Request-ID": "x" * 200}).headers["X-Request-ID"]
    assert re.fullmatch(r"[0-9a-f]{32}", odd)
    refused = post_job(client, prompt="")
    assert refused.status_code == 422 and re.fullmatch(r"[0-9a-f]{32}", refused.headers["X-Request-ID"])


def test_one_id_follows_a_job_from_post_to_png(worker: Process, worker_settings: Settings,
                                                worker_client: FlaskClient, start_api: Any) -> None:
    api: Process = start_api(worker_settings, log_format="json")
    request_id, prompt = f"follow-{uuid.uuid4().hex[:8]}", f"a secret prompt {uuid.uuid4().hex}"
    status, view, headers = http_post_job(api.url, {"prompt": prompt, "width": 64, "height": 64, "steps": 2},
                                          headers={"X-Request-ID": request_id})
    assert status == 202 and headers["X-Request-ID"] == request_id
    job_id = view["id"]

    wait_for_status(worker_client, job_id, "succeeded")

    # The API's lines are JSON objects; those about this request name it and the job.
    def api_lines() -> list[dict[str, Any]]:
        return [json.loads(line) for line in api.output().splitlines() if line.startswith("{")]

    ours = wait_for(lambda: [line for line in api_lines() if line.get("request_id") == request_id]
                    if len(api_lines()) else None, what="the API's log lines")
    messages = [line["message"] for line in ours]
    assert any(message.startswith(f"admitted job {job_id}") for message in messages), messages
    request_line = next(line for line in ours if line["logger"] == "slotq.requests")
    assert request_line["route"] == "/v1/jobs" and request_line["status"] == 202
    assert {line["component"] for line in ours} == {"api"}

    # The session's worker logs text: its lines about the job carry both ids.
    tag = f"[request={request_id} job={job_id}]"
    worker_log = wait_for(lambda: worker.output() if f"{tag}: succeeded" in worker.output() else None,
                          what="the worker's line for the job's end")
    assert f"{tag}: started: attempt 1, 64x64, 2 steps" in worker_log
    assert "Successfully completed job" in worker_log  # RQ's own line, without the job's arguments

    # No prompt text at info level, in either process.
    assert prompt not in api.output() and prompt not in worker_log
    assert f"prompt <{len(prompt)} characters withheld>" in worker_log


def test_logged_prompts_when_asked(settings: Settings, start_api: Any) -> None:
    api: Process = start_api(settings, log_prompts=True)
    status, _, _ = http_post_job(api.url, {"prompt": "a visible prompt", "width": 64, "height": 64})
    assert status == 202
    wait_for(lambda: "prompt 'a visible prompt'" in api.output(), what="the prompt in the API's log")


def test_text_lines_read_as_logging_s_own_formatter_writes_them() -> None:
    # TextFormatter formats each second's timestamp once: its lines must still be logging's own.
    import logging

    from shared.contract.logs import TEXT_FORMAT, TextFormatter

    ours, theirs = TextFormatter(), logging.Formatter(TEXT_FORMAT)
    for created in (1_800_000_000.001, 1_800_000_000.999, 1_800_000_001.5, 1_800_000_000.25):
        record = logging.LogRecord("slotq.test", logging.INFO, __file__, 1, "job %s", ("j-1",), None)
        record.created, record.msecs, record.ids = created, (created % 1) * 1000, " [request=r-1]"
        assert ours.format(record) == theirs.format(record)
