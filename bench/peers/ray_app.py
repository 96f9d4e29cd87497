"""The Ray Serve application of ``bench.peers``: one replica of the tiny SD pipeline behind Serve's own
HTTP proxy, requests batched with ``@serve.batch``. ``python -m bench.peers.ray_app --port P --cache DIR
--threads N --max-batch B`` starts a local Ray, runs the app until SIGINT or SIGTERM, and shuts Ray down.

POST / with JSON ``{"side", "steps", "seed"}``: the PNG (image/png). Over ``max_queued_requests``
waiting at the proxy, Serve itself answers 503.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from collections import defaultdict
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.schema import LoggingConfig
from starlette.requests import Request
from starlette.responses import Response

from bench.peers import pipeline

DEPLOYMENT = "TinySD"  # the replica's process title carries it
Job = tuple[int, int, int]  # side, steps, seed
QUIET = LoggingConfig(log_level="WARNING", enable_access_log=False)


@serve.deployment(name=DEPLOYMENT, num_replicas=1, logging_config=QUIET)
class TinySD:
    """The one model replica: a request is one job; a batch is rendered one shape at a time."""

    def __init__(self, cache_dir: str, threads: int, max_batch: int, pid_file: str | None) -> None:
        self.pipe = pipeline.load(Path(cache_dir), threads)
        # Serve's batching guide: the decorator's arguments are fixed at class definition; set them
        # from the command line in the constructor.
        self.render_batch.set_max_batch_size(max_batch)  # type: ignore[attr-defined]  # not in its stub
        if pid_file:
            Path(pid_file).write_text(str(os.getpid()))

    async def __call__(self, request: Request) -> Response:
        body = await request.json()
        job = (int(body["side"]), int(body["steps"]), int(body["seed"]))
        return Response(await self.render_batch(job), media_type="image/png")

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def render_batch(self, jobs: list[Job]) -> list[bytes]:
        # Serve's asyncio guide: a blocking model call in an async batch handler goes to a thread,
        # so the replica's loop keeps taking requests (and cancellations) while the batch runs.
        return await asyncio.to_thread(self.render_groups, jobs)

    def render_groups(self, jobs: list[Job]) -> list[bytes]:
        """One diffusers call per (side, steps) in the batch; the PNGs in the batch's order."""
        groups: defaultdict[tuple[int, int], list[int]] = defaultdict(list)
        for index, (side, steps, _) in enumerate(jobs):
            groups[side, steps].append(index)
        pngs = [b""] * len(jobs)
        for (side, steps), indexes in groups.items():
            rendered = pipeline.render(self.pipe, side, steps, [jobs[index][2] for index in indexes])
            for index, png in zip(indexes, rendered, strict=True):
                pngs[index] = png
        return pngs


def app(cache_dir: Path, threads: int, max_batch: int, pid_file: Path | None = None) -> Any:
    """The application, with the admission limits Serve's docs give for a batching model replica."""
    # max_ongoing_requests: the batch decorator warns unless it is >= max_batch_size *
    # max_concurrent_batches (one batch at a time on one model), and the asyncio guide's batched
    # model keeps it at twice max_batch_size, so the next batch forms while one runs.
    # max_queued_requests: requests waiting at the proxy beyond it get a 503 (the default, -1, never
    # refuses); the docs give no rule, so the value of their backpressure example, 64.
    limited = TinySD.options(  # type: ignore[attr-defined]  # serve.deployment's stub returns the class
        max_ongoing_requests=2 * max_batch, max_queued_requests=64)
    return limited.bind(str(cache_dir), threads, max_batch, str(pid_file) if pid_file else None)


def serve_forever(port: int, temp_dir: Path, application: Any) -> None:
    """A local Ray on every core, Serve's proxy on 127.0.0.1:``port``, until interrupted."""
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level=logging.WARNING,
             log_to_driver=False, _temp_dir=str(temp_dir))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=QUIET)
        serve.run(application, blocking=True)
    except KeyboardInterrupt:
        pass  # SIGINT, or SIGTERM (below): a normal stop
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--cache", type=Path, required=True, help="the tiny model's cache folder")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the replica")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--pid-file", type=Path, default=None,
                        help="where the replica writes its PID once its model is loaded")
    parser.add_argument("--temp-dir", type=Path, default=Path("/tmp/ray"),
                        help="Ray's session folder (its sockets' paths must stay short)")
    args = parser.parse_args()
    # A supervisor's SIGTERM stops Serve and Ray as Ctrl-C does, not by killing the driver alone.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    pid_file = args.pid_file.resolve() if args.pid_file else None
    serve_forever(args.port, args.temp_dir.resolve(),
                  app(args.cache.resolve(), args.threads, args.max_batch, pid_file))


if __name__ == "__main__":
    main()
