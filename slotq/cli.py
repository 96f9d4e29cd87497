"""The ``slotq`` command: run the API, a worker, everything at once, submit a job, or operate a worker."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any, TextIO

from shared.contract.models import SCHEDULERS
from shared.contract.settings import load_settings

if TYPE_CHECKING:
    from slotq.client import Client


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

    worker = commands.add_parser("worker", help="run one single-slot GPU worker, or operate a running one")
    worker.add_argument("--burst", action="store_true", help="quit when the queue is empty")
    worker.set_defaults(run=_run_worker)
    operations = worker.add_subparsers(metavar="ACTION")
    for action, about in [("release", "let go of the device, claim nothing (for --hold-s, or until resume)"),
                          ("resume", "end a hold: claim again"),
                          ("drain", "finish the running job, claim nothing more and exit (--stay: wait)")]:
        operation = operations.add_parser(action, help=about)
        operation.add_argument("name", help="the worker's name (GET /v1/admin/workers lists them)")
        operation.add_argument("--url", default="http://127.0.0.1:8000", help="the service's base URL")
        operation.add_argument("--admin-key", default=os.environ.get("SLOTQ_ADMIN_KEY"),
                               help="one of SLOTQ_ADMIN_KEYS (default: $SLOTQ_ADMIN_KEY)")
        operation.set_defaults(run=_operate_worker, action=action)
    operations.choices["release"].add_argument("--hold-s", type=float, help="seconds to stay free")
    operations.choices["drain"].add_argument("--stay", action="store_true",
                                             help="stay, claiming nothing, until resumed")

    dev = commands.add_parser("dev", help="run Redis (if needed), the API and a worker together")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, help="port of the API (default: SLOTQ_API_PORT)")
    dev.set_defaults(run=_run_dev)

    submit = commands.add_parser("submit", help="submit a job to a running service")
    submit.add_argument("prompt")
    submit.add_argument("--url", default="http://127.0.0.1:8000", help="the service's base URL")
    submit.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    submit.add_argument("--wait", action="store_true",
                        help="wait for the job to end, showing its queue position and step progress")
    submit.add_argument("-o", "--output", help="save the first image here (implies --wait)")
    submit.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default: 600)")
    submit.add_argument("--model", help="the model to run on, by name (default: the service's first)")
    submit.add_argument("--lora", action="append", type=_lora, metavar="NAME[:SCALE]",
                        help="a LoRA adapter, at a scale (default 1); repeat for several")
    submit.add_argument("--priority", choices=["high", "normal", "low"])
    submit.add_argument("--scheduler", choices=SCHEDULERS, help="the sampler (default: the model's own)")
    submit.add_argument("--image", metavar="FILE", help="a start image (PNG, JPEG, WebP): image-to-image")
    submit.add_argument("--mask", metavar="FILE", help="with --image: white repaints, black keeps")
    submit.add_argument("--strength", type=float, help="with --image: the share of the schedule run again")
    for name, kind in [("negative-prompt", str), ("width", int), ("height", int), ("steps", int),
                       ("guidance-scale", float), ("seed", int), ("num-images", int), ("deadline-s", float)]:
        submit.add_argument(f"--{name}", type=kind)
    submit.set_defaults(run=_run_submit)
    return parser


def _lora(text: str) -> dict[str, Any]:
    """``--lora ink`` or ``--lora ink:0.8`` as a job's adapter entry."""
    name, _, scale = text.partition(":")
    try:
        return {"name": name} | ({"scale": float(scale)} if scale else {})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: the scale after ':' must be a number") from None


def _run_api(args: argparse.Namespace) -> int:
    load_settings()  # a bad setting stops here, with the message, before the API's own start
    host = ["--host", args.host] if args.host else []
    port = ["--port", str(args.port)] if args.port else []
    return _become(["-m", "api", *host, *port])


def _run_worker(args: argparse.Namespace) -> int:
    load_settings()
    return _become(["-m", "worker", *(["--burst"] if args.burst else [])])


def _become(arguments: list[str]) -> int:
    """Replace this process with ``python ARGUMENTS``: the same pid, so signals reach the side itself.

    Each side owns its entry point (``python -m api``, ``python -m worker``); the command imports
    neither, so it stays importable without Flask or torch.
    """
    os.execv(sys.executable, [sys.executable, *arguments])
    return 1  # not reached


def _operate_worker(args: argparse.Namespace) -> int:
    """``slotq worker release|resume|drain NAME``: the admin routes, from a shell."""
    from slotq.client import APIError, Client

    client = Client(args.url, api_key=args.admin_key)
    try:
        if args.action == "release":
            answer = client.release_worker(args.name, args.hold_s)
        elif args.action == "resume":
            answer = client.resume_worker(args.name)
        else:
            answer = client.drain_worker(args.name, exit=not args.stay)
    except APIError as exc:
        print(f"slotq: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(answer))
    return 0


def _run_dev(args: argparse.Namespace) -> int:
    from slotq.dev import ENV_FILE, run_dev

    settings = load_settings(env_file=ENV_FILE)
    return run_dev(settings, args.host, args.port or settings.api_port)


def _run_submit(args: argparse.Namespace) -> int:
    from slotq.client import APIError, Client, data_url

    client = Client(args.url, api_key=args.api_key)
    names = ["negative_prompt", "width", "height", "steps", "guidance_scale", "seed", "num_images",
             "deadline_s", "priority", "scheduler", "strength", "model"]
    params: dict[str, Any] = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.lora:
        params["loras"] = args.lora
    try:
        params |= {name: data_url(getattr(args, name)) for name in ("image", "mask") if getattr(args, name)}
    except (OSError, ValueError) as exc:
        print(f"slotq: {exc}", file=sys.stderr)
        return 2
    try:
        view = client.submit(args.prompt, **params)
        print(view["id"], flush=True)  # first, so that a script has the id even if waiting fails
        if args.wait or args.output:
            return _follow(client, view, args.timeout, args.output)
        return 0
    except (APIError, TimeoutError) as exc:
        print(f"slotq: {exc}", file=sys.stderr)
        return 1


def _follow(client: Client, view: dict[str, Any], timeout: float, output: str | None) -> int:
    """Show the job's position, then its progress, until it ends; save its first image to ``output``."""
    progress = Progress(sys.stderr)
    progress.show(view)
    try:
        view = client.wait(view["id"], timeout=timeout, on_update=progress.show)
    except KeyboardInterrupt:
        progress.end()
        print(f"slotq: stopped waiting; job {view['id']} goes on", file=sys.stderr)
        return 130
    finally:
        progress.end()
    if view["status"] != "succeeded":
        print(f"slotq: job {view['status']}: {view.get('error')}", file=sys.stderr)
        return 1
    if output:
        with open(output, "wb") as file:
            file.write(client.image_bytes(view["id"]))
        print(f"saved {output}", file=sys.stderr)
    return 0


class Progress:
    """A job's queue position, then its step progress, on one line of a terminal or a line per change."""

    def __init__(self, stream: TextIO, width: int = 10) -> None:
        self.stream, self.width = stream, width
        self.tty = stream.isatty()
        self.last = ""

    def show(self, view: dict[str, Any]) -> None:
        """Show the view's state, unless it shows the same as the last one."""
        line = progress_line(view, self.width)
        if line == self.last:
            return
        if self.tty:  # rewrite the line; pad to wipe the end of a longer previous one
            self.stream.write(f"\r{line:<{len(self.last)}}")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.last = line

    def end(self) -> None:
        """Finish the rewritten line, once."""
        if self.tty and self.last:
            self.stream.write("\n")
            self.stream.flush()
        self.last = ""


def progress_line(view: dict[str, Any], width: int = 10) -> str:
    """``queued: position 2, starts in ~12s``, ``running [#####.....] 5/10, ~3s left`` or the status."""
    eta = view.get("eta_s") or {}
    if view["status"] == "queued":
        line = f"queued: position {view.get('position')}"
        return line + (f", starts in {_about(eta['start'])}" if eta.get("start") is not None else "")
    progress = view.get("progress")
    if view["status"] == "running" and progress and progress.get("total"):
        step, total = progress["step"], progress["total"]
        done = width * min(step, total) // total
        line = f"running [{'#' * done}{'.' * (width - done)}] {step}/{total}"
        return line + (f", {_about(eta['finish'])} left" if eta.get("finish") is not None else "")
    return view["status"]


def _about(seconds: float) -> str:
    return "<1s" if seconds < 1 else f"~{seconds:.0f}s"


if __name__ == "__main__":
    sys.exit(main())
