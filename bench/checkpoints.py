"""What step checkpoints cost a running job, and what they save it when its worker dies.

    python -m bench.checkpoints [--rounds 3] [--size 256] [--steps 40] [--whole-only]

In-process: the tiny SD model (float32), ``dpmpp_2m`` (a multistep sampler, whose past predictions
are in each checkpoint), worker/stepping.py's loop, and the result store on a redis-server of its
own, saved and read as the worker does (``SteppingLoop.state_of``, ``resuming.dump``,
``Results.save_checkpoint``; ``Results.checkpoint``, ``resuming.resume``).

- **Cost**: one job from step 0 to its image without checkpoints (the baseline), then with one after
  every step, the most the worker ever saves. Their difference over the steps is one save's time;
  at the default SLOTQ_CHECKPOINT_EVERY_S a job saves once a minute, so its share of the job's time
  is one save's time over 60 s (the goal: at most 2 %).
- **Crash**: the job's worker dies after its checkpoint at half its steps; the time from its next
  attempt's start to its image, from step 0 (no checkpoints: the baseline) and from the checkpoint
  (read, loaded, its prompt encoded again). The resumed image must equal the
  uninterrupted one, byte for byte.

Then the same for a job the loop does not run, a whole pipeline call (worker/whole_calls.py): a hires
job with a LoRA, its first pass at ``--size``, its second at twice that, at denoise 0.5 (``ImagePipeline``'s
``generate_batch`` with ``resuming.dump_call``; ``load_call`` and ``resume``), its crash in the middle
of its second pass, whose resume skips the first pass.

Rounds alternate which way runs first; the median of the paired rounds counts.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.stats import median, ratios

SAMPLER, SEED, GOAL = "dpmpp_2m", 11, 0.02
DEFAULT_EVERY_S = 60.0


def run(loop: Any, request: Any, save: Any = None, resume_from: Any = None) -> tuple[float, np.ndarray]:
    """Seconds from admission to the image, saving after each step with ``save`` (where given) and
    resuming from ``resume_from`` (a job and its stored checkpoint, where given)."""
    from worker import resuming

    started = time.perf_counter()
    flights = loop.admit_all(request)
    if resume_from is not None:
        job, found = resume_from
        flights = resuming.resume(loop, job, request, flights, found)
        assert flights[0].step, "the checkpoint did not resume"
    while loop.running:
        loop.step()
        if save is not None and loop.running:
            save(flights)
    (image,) = loop.decode(flights)
    return time.perf_counter() - started, image


def stopped_at(loop: Any, request: Any, steps: int) -> list[Any]:
    """The job's flights after ``steps`` steps, out of the loop: a cancel lets go of their prompt's
    embeddings only, so their state can still be read, as a checkpoint of that step."""
    flights = loop.admit_all(request)
    for _ in range(steps):
        loop.step()
    for flight in flights:
        loop.cancel(flight)
    return flights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--whole-only", action="store_true", help="only the whole pipeline call's part")
    args = parser.parse_args(argv)
    same = args.whole_only or loop_part(args)
    return 0 if whole_call_part(args) and same else 1


def loop_part(args: argparse.Namespace) -> bool:
    """The step-level loop's job; whether its resumed image equals the uninterrupted one."""

    import torch
    from diffusers import DiffusionPipeline
    from redis import Redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from shared.contract.jobs import JobRequest
    from shared.contract.settings import Settings
    from shared.store import results
    from slotq.localredis import running_redis
    from worker import resuming
    from worker.samplers import Samplers
    from worker.stepping import SteppingLoop
    from worker.tiny.model import ensure_tiny_model

    torch.set_num_threads(1)
    request = JobRequest(prompt="a lighthouse on a cliff", width=args.size, height=args.size,
                         steps=args.steps, seed=SEED, scheduler=SAMPLER)
    with tempfile.TemporaryDirectory() as folder, running_redis(Path(folder)) as url:
        pipe = DiffusionPipeline.from_pretrained(ensure_tiny_model(Path(folder) / "models", "tiny"),
                                                 dtype=torch.float32)
        pipe.set_progress_bar_config(disable=True)
        loop = SteppingLoop(pipe, Samplers(pipe.scheduler))
        settings = Settings(redis_url=url)
        store = results.of(settings)
        connection = Redis.from_url(url)
        job = Job.create("worker.tasks.generate", kwargs={"request": request.model_dump(mode="json")},
                         connection=connection, id="bench-checkpoints", serializer=JSONSerializer)
        job.save()
        print_of = resuming.fingerprint(job, type(pipe).__name__)

        def save(flights: list[Any]) -> None:
            data = resuming.dump(print_of, [loop.state_of(flight) for flight in flights])
            store.save_checkpoint(job, flights[0].step, data)

        run(loop, request)  # untimed: the first calls at this size
        plain, saving, from_zero, resumed, sizes = [], [], [], [], []
        same = True
        for number in range(args.rounds):
            ways = {"plain": lambda: run(loop, request), "saving": lambda: run(loop, request, save)}
            times = {}
            for name in (("plain", "saving") if number % 2 == 0 else ("saving", "plain")):
                times[name], _ = ways[name]()
            plain.append(times["plain"])
            saving.append(times["saving"])
            sizes.append(len(connection.hget(f"slotq:checkpoint:{job.id}", "data") or b""))

            half = args.steps // 2
            checkpointed = stopped_at(loop, request, half)
            save(checkpointed)
            again = {}
            for name in (("zero", "resumed") if number % 2 == 0 else ("resumed", "zero")):
                found = store.checkpoint(job) if name == "resumed" else None
                again[name] = run(loop, request, resume_from=(job, found) if found else None)
            from_zero.append(again["zero"][0])
            resumed.append(again["resumed"][0])
            same = same and np.array_equal(again["zero"][1], again["resumed"][1])
        connection.close()

    title = (f"Step checkpoints: tiny SD {args.size}x{args.size}, {args.steps} steps, {SAMPLER}, one torch "
             f"thread, the Redis store; {args.rounds} paired round(s), medians")
    report(title, Timings(plain, saving, from_zero, resumed, sizes), args.steps - 1,
           f"step {args.steps // 2}", same)
    return same


def whole_call_part(args: argparse.Namespace) -> bool:
    """A hires job with a LoRA as a whole pipeline call; whether its resumed image equals the
    uninterrupted one."""
    import torch
    from redis import Redis
    from rq.job import Job
    from rq.serializers import JSONSerializer

    from shared.contract.jobs import JobRequest
    from shared.contract.settings import Settings
    from shared.store import results
    from slotq.localredis import running_redis
    from worker import resuming
    from worker.pipeline import load_pipeline
    from worker.tiny.loras import ensure_tiny_loras

    torch.set_num_threads(1)
    request = JobRequest.model_validate({
        "prompt": "a lighthouse on a cliff", "width": args.size, "height": args.size,
        "steps": args.steps, "seed": SEED, "scheduler": SAMPLER, "loras": [{"name": "ink", "scale": 0.8}],
        "hires": {"scale": 2, "steps": args.steps}})
    crash_at = request.first_steps_run + request.hires_steps_run // 2
    with tempfile.TemporaryDirectory() as folder, running_redis(Path(folder)) as url:
        cache = Path(folder) / "models"
        settings = Settings(redis_url=url, model="tiny", cache_dir=cache, device="cpu", torch_threads=1,
                            lora_dir=ensure_tiny_loras(cache, "tiny"))
        loaded, store, connection = load_pipeline(settings), results.of(settings), Redis.from_url(url)
        job = Job.create("worker.tasks.generate", kwargs={"request": request.model_dump(mode="json")},
                         connection=connection, id="bench-whole-call", serializer=JSONSerializer)
        job.save()
        print_of = resuming.fingerprint(job, type(loaded.pipe).__name__)
        sampler = type(loaded.samplers.get(request.scheduler)).__name__

        def save(step: int, latents: Any, generators: Any, state: Any) -> None:
            if step < request.steps_run:
                data = resuming.dump_call(print_of, step, latents, generators, state)
                store.save_checkpoint(job, step, data)

        def crash(step: int, latents: Any, generators: Any, state: Any) -> None:
            if step == crash_at:
                save(step, latents, generators, state)

        def attempt(keep: Any = None, resumed: bool = False) -> tuple[float, np.ndarray]:
            started = time.perf_counter()
            resume = None
            if resumed:
                found = store.checkpoint(job)
                assert found is not None, "no checkpoint"
                resume = resuming.load_call(found[1], print_of, request.num_images, sampler)
            (images,) = loaded.generate_batch([request], checkpoint=keep, resume=resume)
            assert isinstance(images, list)
            return time.perf_counter() - started, np.asarray(images[0])

        attempt()  # untimed: the first calls at these sizes
        plain, saving, from_zero, resumed, sizes = [], [], [], [], []
        same = True
        for number in range(args.rounds):
            order = ("plain", "saving") if number % 2 == 0 else ("saving", "plain")
            times = {name: attempt(save if name == "saving" else None)[0] for name in order}
            plain.append(times["plain"])
            saving.append(times["saving"])
            sizes.append(len(connection.hget(f"slotq:checkpoint:{job.id}", "data") or b""))
            attempt(crash)  # the attempt that dies after its checkpoint at crash_at
            order = ("zero", "resumed") if number % 2 == 0 else ("resumed", "zero")
            again = {name: attempt(resumed=name == "resumed") for name in order}
            from_zero.append(again["zero"][0])
            resumed.append(again["resumed"][0])
            same = same and np.array_equal(again["zero"][1], again["resumed"][1])
        connection.close()

    title = (f"\nA whole pipeline call: a hires job with a LoRA, tiny SD {args.size} px "
             f"({request.first_steps_run} steps) then {2 * args.size} px ({request.hires_steps_run} steps), "
             f"{SAMPLER}, one torch thread, the Redis store; {args.rounds} paired round(s), medians")
    report(title, Timings(plain, saving, from_zero, resumed, sizes), request.steps_run - 1,
           f"step {crash_at} (the second pass's middle)", same)
    return same


@dataclass
class Timings:
    """Each round's seconds: a job without and with a checkpoint after every step, the attempt after a
    crash from step 0 and from the checkpoint; and a checkpoint's bytes."""

    plain: list[float]
    saving: list[float]
    from_zero: list[float]
    resumed: list[float]
    sizes: list[int]


def report(title: str, runs: Timings, saves: int, checkpoint: str, same: bool) -> None:
    """Print a part's tables: what a save costs, and what a resume saves."""
    per_save = max(0.0, median([(s - p) / saves for s, p in zip(runs.saving, runs.plain, strict=True)]))
    share = per_save / DEFAULT_EVERY_S
    print(title)
    print(f"{'':44}{'job ms':>10}{'ratio':>9}")
    print(f"{'no checkpoints (baseline)':44}{1000 * median(runs.plain):>10.1f}{1.0:>9.2f}x")
    print(f"{'a checkpoint after every step':44}{1000 * median(runs.saving):>10.1f}"
          f"{median(ratios(runs.saving, runs.plain)):>9.2f}x")
    print(f"one save: {1000 * per_save:.2f} ms ({median(runs.sizes) / 1024:.0f} KiB); at the default "
          f"interval ({DEFAULT_EVERY_S:.0f} s) {100 * share:.3f} % of a job's time: goal <= "
          f"{100 * GOAL:.0f} % {'met' if share <= GOAL else 'missed'}")
    print(f"The attempt after a crash, the last checkpoint at {checkpoint}: its start to its image")
    print(f"{'':44}{'ms':>10}{'ratio':>9}")
    print(f"{'from step 0 (baseline)':44}{1000 * median(runs.from_zero):>10.1f}{1.0:>9.2f}x")
    print(f"{'from the checkpoint':44}{1000 * median(runs.resumed):>10.1f}"
          f"{median(ratios(runs.resumed, runs.from_zero)):>9.2f}x")
    print(f"images: the resumed image {'equals' if same else 'DIFFERS FROM'} the uninterrupted one, "
          "byte for byte")


if __name__ == "__main__":
    raise SystemExit(main())
