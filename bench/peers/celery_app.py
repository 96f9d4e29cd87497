"""The Celery peer's app, as Flask's "Background Tasks with Celery" pattern has it: a Flask app that
enqueues ``render`` and answers polls, a Celery app configured from it, and the task the worker runs
on the pipeline it loaded once.

    celery -A bench.peers.celery_app worker --pool solo --concurrency 1 --prefetch-multiplier 1
    gunicorn --worker-class gthread --threads 4 bench.peers.celery_app:flask_app

Both read their configuration from the environment, as Flask's ``from_prefixed_env`` does:
``FLASK_CELERY__broker_url``, ``FLASK_CELERY__result_backend``, ``FLASK_PIPELINE__cache_dir``,
``FLASK_PIPELINE__threads``.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from celery import Celery, shared_task  # type: ignore[import-untyped]
from celery.result import AsyncResult  # type: ignore[import-untyped]
from celery.signals import worker_process_init  # type: ignore[import-untyped]
from flask import Blueprint, Flask, Response, request
from werkzeug.exceptions import BadRequest, NotFound

from bench.peers import pipeline

jobs = Blueprint("jobs", __name__, url_prefix="/jobs")
_pipe: Any = None  # the worker's pipeline, loaded once as its process starts


def create_app() -> Flask:
    """The Flask app with its Celery app on ``app.extensions["celery"]``."""
    app = Flask(__name__)
    app.config.from_mapping(
        CELERY={
            "broker_url": "redis://localhost",
            "result_backend": "redis://localhost",
            # A render takes seconds: ack it once it ran, so the worker reserves only the task it
            # runs (Celery's Optimizing guide, "Reserve one task at a time"); a render is idempotent.
            "task_acks_late": True,
            "broker_connection_retry_on_startup": True,  # Celery 5.3+ warns unless it is said
        },
        PIPELINE={"cache_dir": "models", "threads": 1},
    )
    # FLASK_CELERY__broker_url=... and the like override the defaults above.
    app.config.from_prefixed_env()
    celery_init_app(app)
    app.register_blueprint(jobs)
    return app


def celery_init_app(app: Flask) -> Celery:
    """The Celery app, configured from the Flask app's ``CELERY`` and made the default for tasks."""
    celery = Celery(app.name)
    celery.config_from_object(app.config["CELERY"])
    celery.set_default()
    app.extensions["celery"] = celery
    return celery


@worker_process_init.connect
def load_pipeline(**_: object) -> None:
    """Load the pipeline in the worker's process before it takes a task (the solo pool sends it too)."""
    global _pipe
    settings = flask_app.config["PIPELINE"]
    _pipe = pipeline.load(Path(settings["cache_dir"]), int(settings["threads"]))


@shared_task(ignore_result=False)
def render(side: int, steps: int, seed: int) -> str:
    """One image; its PNG base64-encoded, as the JSON result backend carries text only."""
    if _pipe is None:  # Celery logs a signal handler's error and starts the worker all the same
        raise RuntimeError("the pipeline did not load; see the worker's log")
    return base64.b64encode(pipeline.render(_pipe, side, steps, [seed])[0]).decode("ascii")


@jobs.post("")
def submit() -> tuple[dict[str, str], int]:
    body = request.get_json(silent=True) or {}
    try:
        side, steps, seed = (int(body[name]) for name in ("side", "steps", "seed"))
    except (KeyError, TypeError, ValueError):
        raise BadRequest("side, steps and seed must be integers") from None
    return {"id": render.delay(side, steps, seed).id}, 202


@jobs.get("/<task_id>")
def status(task_id: str) -> dict[str, str]:
    return {"status": AsyncResult(task_id).state}


@jobs.get("/<task_id>/image")
def image(task_id: str) -> Response:
    result = AsyncResult(task_id)
    if not result.successful():
        raise NotFound(f"no image: the task is {result.state}")
    return Response(base64.b64decode(result.result), mimetype="image/png")


@jobs.delete("/<task_id>")
def cancel(task_id: str) -> tuple[str, int]:
    AsyncResult(task_id).revoke()
    return "", 204


# The entry points of gunicorn and ``celery -A`` (Flask's example keeps these in make_celery.py).
flask_app = create_app()
celery_app = flask_app.extensions["celery"]
