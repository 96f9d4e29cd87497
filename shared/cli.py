"""The ``slotq`` command: run the API, a worker, everything at once, or submit a job."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from shared.settings import load_settings


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``slotq`` console script."""
    args = _parser().parse_args(argv)
    return int(args.run(args) or 0)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slotq", description="A GPU job service for image generation.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    api = commands.add_parser("api", help="serve the HTTP API (gunicorn)")
    api.add_argument("--host", help="address to bind (default: SLOTQ_API_HOST)")
    api.add_argument("--port", type=int, help="port to bind (default: SLOTQ_API_PORT)")
    api.set_defaults(run=_run_api)

    worker = commands.add_parser("worker", help="run one single-slot GPU worker")
    worker.add_argument("--burst", action="store_true", help="quit when the queue is empty")
    worker.set_defaults(run=_run_worker)

    dev = commands.add_parser("dev", help="run Redis (if needed), the API and a worker together")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, help="port of the API (default: SLOTQ_API_PORT)")
    dev.set_defaults(run=_run_dev)

    submit = commands.add_parser("submit", help="submit a job to a running service")
    submit.add_argument("prompt")
    submit.add_argument("--url", default="http://127.0.0.1:8000", help="the service's base URL")
    submit.add_argument("--wait", action="store_true", help="wait for the job to end")
    submit.add_argument("-o", "--output", help="save the first image here (implies --wait)")
    for name, kind in [("negative-prompt", str), ("width", int), ("height", int), ("steps", int),
                       ("guidance-scale", float), ("seed", int), ("num-images", int)]:
        submit.add_argument(f"--{name}", type=kind)
    submit.set_defaults(run=_run_submit)
    return parser


def _run_api(args: argparse.Namespace) -> int:
    from api.server import serve

    serve(args.host, args.port, load_settings())
    return 0


def _run_worker(args: argparse.Namespace) -> int:
    from worker.main import run_worker

    return run_worker(load_settings(), burst=args.burst)


def _run_dev(args: argparse.Namespace) -> int:
    from shared.devserver import run_dev

    settings = load_settings()
    return run_dev(settings, args.host, args.port or settings.api_port)


def _run_submit(args: argparse.Namespace) -> int:
    from shared.client import APIError, Client

    client = Client(args.url)
    names = ["negative_prompt", "width", "height", "steps", "guidance_scale", "seed", "num_images"]
    params: dict[str, Any] = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    try:
        view = client.submit(args.prompt, **params)
        print(f"{view['id']} queued at position {view['position']}", file=sys.stderr)
        if not (args.wait or args.output):
            print(view["id"])
            return 0
        view = client.wait(view["id"], on_update=_show_progress)
        print(file=sys.stderr)
        if view["status"] != "succeeded":
            print(f"job {view['status']}: {view.get('error')}", file=sys.stderr)
            return 1
        if args.output:
            with open(args.output, "wb") as file:
                file.write(client.image_bytes(view["id"]))
            print(f"saved {args.output}", file=sys.stderr)
        print(view["id"])
        return 0
    except APIError as exc:
        print(f"slotq: {exc}", file=sys.stderr)
        return 1


def _show_progress(view: dict[str, Any]) -> None:
    if view["status"] == "queued":
        line = f"queued, position {view['position']}"
    elif view.get("progress"):
        line = f"{view['status']}, step {view['progress']['step']}/{view['progress']['total']}"
    else:
        line = view["status"]
    print(f"\r{line:<40}", end="", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
