"""Logging for both processes: readable text or JSON lines, each line with the request and job it is about.

The ids travel in context variables: the API sets the request id for the duration of a request,
the worker sets the job id and the job's request id while it runs or finishes that job, and every
log line written meanwhile carries them, whichever module writes it.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from pythonjsonlogger.json import JsonFormatter

from shared.contract.settings import Settings

PROMPT_CARRIERS = ("kwargs", "arguments")  # the extras RQ adds to a failed job's log record
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")  # what a proxy or tracer may send, nothing else
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(ids)s: %(message)s"
JSON_FIELDS = ["levelname", "name", "message", "component", "request_id", "job_id"]

request_id: ContextVar[str | None] = ContextVar("request_id", default=None)
job_id: ContextVar[str | None] = ContextVar("job_id", default=None)


def accept_request_id(sent: str | None) -> str:
    """The client's X-Request-ID when it is a sane token, else a new one."""
    if sent and REQUEST_ID.match(sent):
        return sent
    return os.urandom(16).hex()  # as random as uuid4().hex, without building a UUID


@contextmanager
def about_job(job: str, request: str | None) -> Iterator[None]:
    """Tag every log line written inside with this job and the request that submitted it."""
    tokens = job_id.set(job), request_id.set(request)
    try:
        yield
    finally:
        job_id.reset(tokens[0])
        request_id.reset(tokens[1])


class ContextFilter(logging.Filter):
    """Adds the component, the current request id and job id to each record."""

    def __init__(self, component: str, text: bool, prompts: bool) -> None:
        super().__init__()
        self.component, self.text, self.prompts = component, text, prompts

    def filter(self, record: logging.LogRecord) -> bool:
        record.component = self.component
        if not self.prompts:  # a JSON line would print every extra, a job's arguments included
            for name in PROMPT_CARRIERS:
                if hasattr(record, name):
                    setattr(record, name, "<withheld>")
        # Attributes a LogRecord takes for the formatter (logging sets extras the same way).
        record.request_id, record.job_id = request_id.get(), job_id.get()
        if self.text:  # the ids as one bracketed field of the line, only when there are any
            ids = [f"{name}={value}" for name, value in (("request", request_id.get()),
                                                         ("job", job_id.get())) if value]
            record.ids = f" [{' '.join(ids)}]" if ids else ""
        return True


class TextFormatter(logging.Formatter):
    """The text format, each second's timestamp formatted once: ``time.strftime`` was two fifths of
    formatting a line, and an API process writes one or two lines a request."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._second, self._stamp = -1, ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        second = int(record.created)
        if second != self._second:  # the handler's lock is held: one line at a time
            self._second = second
            self._stamp = time.strftime(self.default_time_format, self.converter(second))
        return f"{self._stamp},{int(record.msecs):03d}"  # logging's default_msec_format, "%s,%03d"


def configure(settings: Settings, component: str) -> None:
    """Send this process's logs to stderr in the configured format (SLOTQ_LOG_FORMAT)."""
    # No caller, thread or process lookups for each record: no format here prints them (the
    # logging HOWTO's "Optimization"); a seventh of the cost of each line.
    logging._srcfile = None  # the documented switch
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    handler = logging.StreamHandler()
    text = settings.log_format == "text"
    handler.addFilter(ContextFilter(component, text, settings.log_prompts))
    if not text:
        renamed = {"levelname": "level", "name": "logger"}
        handler.setFormatter(JsonFormatter(JSON_FIELDS, rename_fields=renamed, timestamp="time"))
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(settings.log_level)


def prompt_for_log(settings: Settings, prompt: str) -> str:
    """The prompt as it may appear in an info-level log line: withheld unless SLOTQ_LOG_PROMPTS is on."""
    return repr(prompt) if settings.log_prompts else f"<{len(prompt)} characters withheld>"
