"""Video jobs: a clip through slotq against the same pipeline called in a loop; what step checkpoints
cost a clip, and what they save it when its worker dies.

    python -m bench.video [--rounds 3] [--clips 4] [--size 128] [--frames 17] [--steps 20]

The tiny Wan model (float32, one torch thread), a redis-server of its own.

- **Service**: ``--clips`` clips posted at once through the API (in-process) to a real ``slotq worker``
  and waited for, admission to the last MP4, against the same pipeline called once a clip in this
  process (the baseline), with and without encoding each clip's MP4 (worker/video.py). The service
  also pays for its line, its records, its finishing process and the store.
- **Cost**: one clip with no checkpoints (the baseline), then with one saved after every step (the most
  the worker ever saves), as the worker saves them (``resuming.dump_call``,
  ``Results.save_checkpoint``). Their difference over the steps is one save's time; at the default
  SLOTQ_CHECKPOINT_EVERY_S a clip saves once a minute, so its share of a clip's time is one save's
  time over 60 s (the goal: at most 2 %).
- **Crash**: the clip's worker dies after its checkpoint at half its steps; the time from its next
  attempt's start to its clip, from step 0 (no checkpoints: the baseline) and from the checkpoint
  (read, loaded, the rest of the schedule). The resumed clip must equal the uninterrupted one.

Rounds alternate which way runs first; the median of the paired rounds counts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from bench.stats import median, ratios

MODEL, SEED, FPS, GOAL = "tiny-wan", 11, 8, 0.02
DEFAULT_EVERY_S = 60.0


def paired(rounds: int, ways: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """Each way's seconds in each round, the order alternating round by round."""
    names = list(ways)
    times: dict[str, list[float]] = {name: [] for name in names}
    for number in range(rounds):
        for name in names if number % 2 == 0 else reversed(names):
            times[name].append(ways[name]())
    return times


def service_round(client: Any, body: dict[str, Any], clips: int) -> float:
    """Seconds from posting ``clips`` clips at once to the last one's MP4 read back."""
    started = time.perf_counter()
    ids = [client.post("/v1/jobs", data=json.dumps(body | {"seed": SEED + n}),
                       content_type="application/json").get_json()["id"] for n in range(clips)]
    for job_id in ids:
        while (view := client.get(f"/v1/jobs/{job_id}").get_json())["status"] in ("queued", "running"):
            time.sleep(0.005)
        assert view["status"] == "succeeded", view
        assert client.get(view["video"]).status_code == 200
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clips", type=int, default=4)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--frames", type=int, default=17)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)

    import torch
    from redis import Redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from api import state
    from api.app import create_app
    from shared.contract.jobs import JobRequest
    from shared.contract.settings import Settings
    from shared.store import results
    from slotq import harness
    from slotq.localredis import running_redis
    from worker import resuming
    from worker.pipeline import load_pipeline
    from worker.video import encode_mp4

    torch.set_num_threads(1)
    body = {"prompt": "a red fox running through snow", "width": args.size, "height": args.size,
            "frames": args.frames, "fps": FPS, "steps": args.steps, "guidance_scale": 5.0}
    request = JobRequest(**body, seed=SEED)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as folder, running_redis(Path(folder) / "redis") as url:
        scratch = Path(folder)
        settings = Settings(redis_url=url, model=MODEL, cache_dir=scratch / "models", device="cpu",
                            torch_threads=1, drain_s=0, queue_capacity=max(64, 4 * args.clips))
        pipeline = load_pipeline(settings)

        def loop(encode: bool) -> float:
            started = time.perf_counter()
            for number in range(args.clips):
                clip = pipeline.generate(request.model_copy(update={"seed": SEED + number}))
                if encode:
                    encode_mp4(clip.frames, clip.fps)  # type: ignore[union-attr]
            return time.perf_counter() - started

        worker = harness.start_worker(settings, scratch / "worker.log")
        app = create_app(settings)
        try:
            client = app.test_client()
            service_round(client, body, 1)  # untimed: the worker's first clip at this size
            loop(True)
            served = paired(args.rounds, {"loop": lambda: loop(False), "loop+mp4": lambda: loop(True),
                                          "service": lambda: service_round(client, body, args.clips)})
        finally:
            state.close(app)
            worker.stop()

        # Checkpoints, in this process, as the worker saves and reads them.
        store, connection = results.of(settings), Redis.from_url(url)
        job = Job.create("worker.tasks.generate", kwargs={"request": request.model_dump(mode="json")},
                         connection=connection, id="bench-video", serializer=JSONSerializer)
        job.save()
        print_of = resuming.fingerprint(job, type(pipeline.pipe).__name__)
        sizes: list[int] = []

        def save(step: int, latents: torch.Tensor, generators: list[torch.Generator], sampler: Any) -> None:
            data = resuming.dump_call(print_of, step, latents, generators, sampler)
            store.save_checkpoint(job, step, data)
            sizes.append(len(data))

        def timed(**extra: Any) -> tuple[float, Any]:
            started = time.perf_counter()
            (clip,) = pipeline.generate_batch([request], **extra)
            return time.perf_counter() - started, clip

        half, kept = args.steps // 2, {}

        def keep_half(step: int, latents: torch.Tensor, generators: list[torch.Generator],
                      sampler: Any) -> None:
            if step == half:
                save(step, latents, generators, sampler)

        costs = paired(args.rounds, {"plain": lambda: timed()[0],
                                     "saving": lambda: timed(checkpoint=save)[0]})
        _, uninterrupted = timed(checkpoint=keep_half)  # the checkpoint a crash at half its steps leaves
        found = store.checkpoint(job)
        assert found is not None and found[0] == half, found

        def resumed() -> float:
            started = time.perf_counter()
            stored = store.checkpoint(job)
            assert stored is not None
            resumption = resuming.load_call(stored[1], print_of, 1,
                                            type(pipeline.samplers.get(request.scheduler)).__name__)
            (clip,) = pipeline.generate_batch([request], resume=resumption)
            kept["clip"] = clip
            return time.perf_counter() - started

        crash = paired(args.rounds, {"zero": lambda: timed()[0], "resumed": resumed})
        same = np.array_equal(kept["clip"].frames, uninterrupted.frames)
        connection.close()

    print(f"Video jobs: tiny Wan {args.size}x{args.size}, {args.frames} frames, {args.steps} steps, one "
          f"torch thread; {args.rounds} paired round(s), medians")
    print(f"{args.clips} clips, posted at once, to the last MP4{'':4}{'s':>10}{'clips/s':>9}{'ratio':>8}")
    rate = {name: args.clips / median(values) for name, values in served.items()}
    for name, label in (("loop", "the pipeline in a loop (baseline)"), ("loop+mp4", "the loop, each clip "
                        "encoded as MP4"), ("service", "through slotq (API, line, worker, store)")):
        ratio = median(ratios(served[name], served["loop"])) if name != "loop" else 1.0
        print(f"{label:44}{median(served[name]):>10.2f}{rate[name]:>9.2f}{ratio:>7.2f}x")
    saves = args.steps - 1
    per_save = max(0.0, median([(s - p) / saves
                                for s, p in zip(costs["saving"], costs["plain"], strict=True)]))
    share = per_save / DEFAULT_EVERY_S
    print(f"{'a clip, no checkpoints (baseline)':44}{median(costs['plain']):>10.3f}")
    print(f"{'a clip, a checkpoint after every step':44}{median(costs['saving']):>10.3f}"
          f"{'':9}{median(ratios(costs['saving'], costs['plain'])):>7.2f}x")
    print(f"one save: {1000 * per_save:.2f} ms ({median(sizes) / 1024:.0f} KiB); at the default interval "
          f"({DEFAULT_EVERY_S:.0f} s) {100 * share:.3f} % of a clip's time: goal <= {100 * GOAL:.0f} % "
          f"{'met' if share <= GOAL else 'missed'}")
    print(f"The attempt after a crash, the last checkpoint at step {half}: its start to its clip")
    print(f"{'from step 0 (baseline)':44}{median(crash['zero']):>10.3f}")
    print(f"{'from the checkpoint':44}{median(crash['resumed']):>10.3f}{'':9}"
          f"{median(ratios(crash['resumed'], crash['zero'])):>7.2f}x")
    print(f"clips: the resumed clip {'equals' if same else 'DIFFERS FROM'} the uninterrupted one, frame for "
          "frame")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
