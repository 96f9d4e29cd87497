"""Serve the API with gunicorn: several processes, each with threads, none of them Flask's dev server."""

from __future__ import annotations

import atexit
import json
import logging
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from flask import Flask
from gunicorn import util as gunicorn_util
from gunicorn.app.base import BaseApplication

from api import metrics, state
from api.app import create_app
from shared.contract import logs
from shared.contract.errors import HeadersTooLargeError, MalformedRequestError, ServiceError, UriTooLongError
from shared.contract.settings import Settings, get_settings


class APIServer(BaseApplication):
    """gunicorn configured from code, so ``slotq api`` needs no config file."""

    def __init__(self, settings: Settings, options: dict[str, Any],
                 factory: Callable[[Settings], Flask] = create_app) -> None:
        self.settings = settings
        self.options = options
        self.factory = factory
        super().__init__()

    def load_config(self) -> None:
        for key, value in self.options.items():
            self.cfg.set(key, value)

    def load(self) -> Flask:
        return self.factory(self.settings)


def stop_on_early_sigterm(server: Any, worker: Any) -> None:
    """gunicorn hook, in a worker just forked: a SIGTERM before the worker sets its own handlers
    stops it. Until then the handler is the arbiter's, copied by the fork, which only queues the
    signal for an arbiter loop this process never runs: the signal was lost, and the worker (a
    gevent one patches modules first, for a few hundred ms) served on until the graceful timeout."""

    def stop(signum: int, frame: FrameType | None) -> None:
        worker.alive = False  # read by the worker's loop, which then ends at once

    signal.signal(signal.SIGTERM, stop)


def drain_on_sigterm(worker: Any) -> None:
    """gunicorn hook: on SIGTERM, answer /readyz with 503 for SLOTQ_DRAIN_S, then stop gracefully."""
    # The pause lets a load balancer see "not ready" and stop sending new requests before this
    # process stops accepting them; requests in flight always complete.
    app: Flask = worker.wsgi
    settings = state.settings(app)

    def drain(signum: int, frame: FrameType | None) -> None:
        state.draining(app).set()
        if settings.api_worker_class == "gevent":
            # A signal handler runs in gevent's event loop, where nothing may block (starting a
            # thread waits for it): the stop is scheduled as a greenlet instead.
            import gevent  # type: ignore[import-untyped]  # gevent ships no stubs

            gevent.spawn_later(settings.drain_s, worker.handle_exit, signum, frame)
            return
        timer = threading.Timer(settings.drain_s, worker.handle_exit, args=(signum, frame))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, drain)


def serve(host: str | None = None, port: int | None = None, settings: Settings | None = None,
          factory: Callable[[Settings], Flask] = create_app) -> None:
    """Run the API (or, for benchmarks, another app) until SIGTERM or SIGINT; requests in flight finish."""
    settings = settings or get_settings()
    settings = settings.model_copy(update={"metrics_dir": _metrics_dir(settings)})
    options = {
        "bind": f"{host or settings.api_host}:{port or settings.api_port}",
        "workers": settings.api_workers,
        "threads": settings.api_threads,
        "worker_class": settings.api_worker_class,
        "worker_connections": 1000,  # gevent's: requests in progress per process, streams included
        "timeout": 30,
        # No gunicorn access log: the app logs each request itself, with its request id. (A
        # logconfig_dict would switch it on: gunicorn then builds each request's log atoms.)
        "accesslog": None,
        "loglevel": settings.log_level.lower(),
        "child_exit": lambda server, worker: metrics.process_exited(worker.pid),
        # gunicorn sets up its logging when it starts; ours goes on top, before any worker forks.
        "on_starting": lambda server: _configure_logging(settings),
        # gunicorn 27 opens a control socket under ~/.gunicorn by default, which clashes when
        # several API processes share a machine; slotq does not use it.
        "control_socket_disable": True,
        "post_fork": stop_on_early_sigterm,
        "post_worker_init": drain_on_sigterm,
        # Room for the drain pause plus the slowest request.
        "graceful_timeout": int(settings.drain_s) + 20,
    }
    json_error_pages()
    APIServer(settings, options, factory).run()


def json_error_pages() -> None:
    """gunicorn answers a request it cannot parse (a request line past its limit: 414; headers past
    theirs: 431; malformed HTTP: 400) before the app sees it, with an HTML page: answer those in the
    service's JSON envelope instead, as every other error. gunicorn writes each through
    ``gunicorn.util.write_error``, which this replaces in the process."""

    def write_error(sock: Any, status_int: int, reason: str, mesg: str) -> None:
        error = ERROR_PAGES.get(status_int, MalformedRequestError if status_int < 500 else ServiceError)
        envelope = error(f"{error.message} ({mesg})" if mesg else None).to_dict()
        body = json.dumps(envelope).encode()
        head = (f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1")
        gunicorn_util.write_nonblock(sock, head + body)

    gunicorn_util.write_error = write_error


ERROR_PAGES: dict[int, type[ServiceError]] = {400: MalformedRequestError, 414: UriTooLongError,
                                              431: HeadersTooLargeError}


def _configure_logging(settings: Settings) -> None:
    """This process's logging, with gunicorn's own messages through the same handler and format."""
    logs.configure(settings, "api")
    gunicorn_log = logging.getLogger("gunicorn.error")
    gunicorn_log.handlers.clear()
    gunicorn_log.propagate = True


def _metrics_dir(settings: Settings) -> Path:
    """Where the API's processes count their metrics: SLOTQ_METRICS_DIR, or a directory of this run."""
    path = settings.metrics_dir
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="slotq-metrics-"))
        atexit.register(shutil.rmtree, path, ignore_errors=True)
    metrics.use_multiprocess_dir(path)
    return path
