"""What serving several models costs a worker: loading a single file, switching, and a mixed line.

    python -m bench.models [--rounds 5] [--line-rounds 3] [--jobs 40] [--size 64] [--steps 2]

A folder of two models, the tiny SD and the tiny SDXL written as single files in the A1111 layout
(worker/tiny/checkpoints.py), each loaded with its layout from SLOTQ_CHECKPOINT_CONFIGS:

- **load**: ``load_pipeline`` of each single file into a ready pipeline (its one-step warm-up
  included), against loading the diffusers folder it was written from (the baseline), the two
  interleaved in each of ``--rounds`` rounds;
- **switch**: the time ``Models.use()`` takes to make the other model current, with both on the
  device (SLOTQ_MODEL_CACHE=2) against loading it from disk (SLOTQ_MODEL_CACHE=1, no host cache,
  the baseline) and, where CUDA is available, moving it back from host memory (SLOTQ_MODEL_CACHE=1,
  SLOTQ_HOST_MODEL_CACHE=2); on the CPU the device is host memory, so that row is n/a. Then the
  full ``gc.collect()`` that each load from disk runs (worker/models.py), alone in this process;
- **line**: a real ``slotq worker`` serving both (SLOTQ_WORKER_MODELS=*, SLOTQ_MODEL_CACHE=1)
  started on a queued line of ``--jobs`` jobs alternating between them, with
  SLOTQ_AFFINITY_MAX_SKIP=8 against 0 (the baseline), in ``--line-rounds`` paired rounds (each
  round runs both, in alternating order): images/s from the first job's start to the last one's
  end, and the switches (jobs whose ``model_load.source`` is not ``device``).

The pipelines run at one torch thread: the figures are loads and switches, and one thread keeps a
small CPU machine's runs steady and spares each worker its thread calibration.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.stats import median, paired_ratio
from shared.contract.jobs import JobStatus
from shared.contract.settings import Settings

MODELS = {"sd": ("tiny", "sd"), "xl": ("tiny-sdxl", "sdxl")}  # name in the folder: (tiny model, family)
POLL_S = 0.1


@dataclass(frozen=True)
class Folder:
    """The benchmark's models: the single files' folder, their configs, and the diffusers folders."""

    cache: Path
    models_dir: Path
    configs: dict[str, str]
    sources: dict[str, Path]  # name -> the diffusers folder its single file was written from

    def settings(self, **overrides: Any) -> Settings:
        """Settings serving both single files, at one torch thread, with ``overrides``."""
        return Settings(cache_dir=self.cache, models_dir=self.models_dir, checkpoint_configs=self.configs,
                        model_names=["sd"], worker_models=["*"], torch_threads=1, **overrides)


def write_folder(scratch: Path) -> Folder:
    """Build the tiny models and write each as a single file into a models folder, with its configs."""
    from worker.tiny.checkpoints import write_checkpoint, write_configs
    from worker.tiny.model import ensure_tiny_model

    cache, configs, sources = scratch / "cache", {}, {}
    for name, (tiny, family) in MODELS.items():
        sources[name] = ensure_tiny_model(cache, tiny)
        write_checkpoint(sources[name], scratch / "models" / f"{name}.safetensors")
        configs[family] = str(write_configs(sources[name], scratch / f"{family}-configs"))
    return Folder(cache, scratch / "models", configs, sources)


def report(rounds: int = 5, line_rounds: int = 3, jobs: int = 40, size: int = 64, steps: int = 2
           ) -> list[str]:
    """The three tables: loading a single file, switching between two models, and the mixed line."""
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        folder = write_folder(Path(scratch))
        lines = load_lines(folder, rounds)
        gc.collect()
        lines += ["", *switch_lines(folder, rounds)]
        gc.collect()
        lines += ["", *line_lines(folder, Path(scratch), line_rounds, jobs, size, steps)]
    return lines


def load_lines(folder: Folder, rounds: int) -> list[str]:
    """Seconds to a ready pipeline from each single file and from its diffusers folder, interleaved."""
    from worker.pipeline import load_pipeline

    settings = folder.settings()
    first = load_pipeline(settings)  # untimed: the first load imports and warms what the others share
    lines = [f"load into a ready pipeline (load_pipeline, its one-step warm-up included) on {first.device}, "
             f"{first.pipe.dtype}; median of {rounds} interleaved rounds",
             f"{'':34}{'s':>8}{'x folder':>10}"]
    threads = first.threads
    del first
    for name, (_, family) in MODELS.items():
        as_folder = settings.model_copy(update={"model": str(folder.sources[name])})
        single, whole = [], []
        for _ in range(rounds):
            single.append(seconds(load_pipeline, settings, name, threads))
            whole.append(seconds(load_pipeline, as_folder, "default", threads))
        lines += [f"{f'{family} diffusers folder (baseline)':34}{median(whole):>8.3f}{1:>9.2f}x",
                  f"{f'{family} single file':34}{median(single):>8.3f}{paired_ratio(single, whole):>9.2f}x"]
    return lines


def seconds(action: Callable[..., object], *args: Any) -> float:
    """The wall time of one call; what it made is dropped before the next."""
    began = time.perf_counter()
    action(*args)
    took = time.perf_counter() - began
    gc.collect()
    return took


def switch_lines(folder: Folder, rounds: int) -> list[str]:
    """Milliseconds ``Models.use()`` takes to make the other model current, each way, interleaved:
    two switches a way a round (to xl, back to sd)."""
    from worker.models import Models
    from worker.pipeline import load_pipeline, resolve_device

    base = folder.settings()
    on_cuda = resolve_device(base.device).type == "cuda"
    ways = {"from disk, cache 1 (baseline)": ("disk", {"model_cache": 1, "host_model_cache": 0}),
            "on the device, cache 2": ("device", {"model_cache": 2, "host_model_cache": 0})}
    if on_cuda:
        ways["from host memory, cache 1"] = ("host", {"model_cache": 1, "host_model_cache": 2})
    held = {}
    for label, (_, update) in ways.items():
        settings = base.model_copy(update=update)
        held[label] = Models(settings, load_pipeline(settings))
        held[label].use("xl")  # untimed: the second model goes where this way keeps it
    times: dict[str, list[float]] = {label: [] for label in ways}
    for _ in range(rounds):
        for model in ("sd", "xl"):
            for label, (source, _) in ways.items():
                times[label].append(switch_seconds(held[label], model, source))
    baseline = median(times[next(iter(ways))])
    lines = [f"switch to the other model (Models.use, SLOTQ_MODEL_CACHE as said), median of {2 * rounds}",
             f"{'':34}{'ms':>10}{'x disk':>10}",
             *(f"{label:34}{1000 * median(took):>10.3f}{median(took) / baseline:>9.4f}x"
               for label, took in times.items())]
    if not on_cuda:
        lines.append(f"{'from host memory, cache 1':34}{'n/a':>10}  (on the CPU the device is host memory)")
    collect = median(seconds(gc.collect) for _ in range(rounds))
    lines.append(f"(a load from disk runs a full gc.collect() to free the model it replaces: "
                 f"{1000 * collect:.1f} ms in this process)")
    return lines


def switch_seconds(models: Any, model: str, source: str) -> float:
    """The seconds one ``use`` takes, checked to have come from ``source``."""
    import torch

    began = time.perf_counter()
    switch = models.use(model)
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # a copy from host memory may still be under way
    took = time.perf_counter() - began
    if switch.source != source:
        raise RuntimeError(f"{model} came from {switch.source}, not {source}")
    gc.collect()
    return took


@dataclass(frozen=True)
class LineRun:
    """One run of the alternating line: images a second, switches, and how many came from disk."""

    rate: float
    switches: int
    from_disk: int


def line_lines(folder: Folder, scratch: Path, rounds: int, jobs: int, size: int, steps: int) -> list[str]:
    """The alternating line run by a real worker, affinity off (the baseline) and on, in paired rounds."""
    from slotq.localredis import running_redis

    runs: dict[int, list[LineRun]] = {8: [], 0: []}
    with running_redis(scratch / "redis") as url:
        settings = folder.settings(redis_url=url, queue_name="bench", queue_capacity=max(100, jobs),
                                   drain_s=0, model_cache=1, log_level="WARNING")
        for round_ in range(rounds):
            for skip in (8, 0) if round_ % 2 == 0 else (0, 8):  # each goes first in every other round
                update = {"affinity_max_skip": skip, "worker_name": f"bench-{round_}-{skip}"}
                runs[skip].append(line_run(settings.model_copy(update=update), scratch, jobs, size, steps))
    on, off = runs[8], runs[0]
    ratios = [mine.rate / base.rate for mine, base in zip(on, off, strict=True)]
    lines = [f"line: {jobs} jobs alternating sd / xl, {size}x{size}, {steps} steps, queued before a real "
             f"slotq worker starts (SLOTQ_WORKER_MODELS=*, SLOTQ_MODEL_CACHE=1); {rounds} paired "
             "round(s), medians; images/s from the first start to the last end",
             f"{'':38}{'switches':>10}{'from disk':>11}{'img/s':>8}{'x off':>8}"]
    for label, taken, ratio in (("affinity off, max skip 0 (baseline)", off, 1.0),
                                ("affinity on, max skip 8", on, median(ratios))):
        lines.append(f"{label:38}{median(run.switches for run in taken):>10g}"
                     f"{median(run.from_disk for run in taken):>11g}"
                     f"{median(run.rate for run in taken):>8.2f}{ratio:>7.2f}x")
    lines.append("img/s on ÷ off by round: " + " ".join(f"{ratio:.2f}" for ratio in ratios))
    return lines


def line_run(settings: Settings, scratch: Path, jobs: int, size: int, steps: int) -> LineRun:
    """Queue the alternating line on an empty Redis, start a worker on it, and follow every job to its end."""
    from redis import Redis

    from api import state
    from api.app import create_app
    from slotq.harness import start_worker

    with Redis.from_url(settings.redis_url) as connection:
        connection.flushdb()
    app = create_app(settings)
    client = app.test_client()
    try:
        ids = [queued(client, {"prompt": "a lighthouse", "model": list(MODELS)[index % 2], "seed": index,
                               "width": size, "height": size, "steps": steps}) for index in range(jobs)]
        worker = start_worker(settings, scratch / f"{settings.worker_name}.log", wait=False)
        try:
            views = [finished(client, worker, job_id, time.monotonic() + 600) for job_id in ids]
        finally:
            if worker.stop() != 0:
                raise RuntimeError(f"the worker exited with {worker.popen.returncode}:\n"
                                   f"{worker.output()[-3000:]}")
    finally:
        state.close(app)
    began = min(datetime.fromisoformat(view["started_at"]) for view in views)
    ended = max(datetime.fromisoformat(view["finished_at"]) for view in views)
    sources = [view["model_load"]["source"] for view in views]
    return LineRun(jobs / (ended - began).total_seconds(), sum(source != "device" for source in sources),
                   sources.count("disk"))


def queued(client: Any, body: dict[str, Any]) -> str:
    """POST one job in-process; its id (any answer but 202 raises)."""
    answer = client.post("/v1/jobs", json=body)
    if answer.status_code != 202:
        raise RuntimeError(f"POST /v1/jobs answered {answer.status_code}: {answer.get_data(as_text=True)}")
    return str(answer.get_json()["id"])


def finished(client: Any, worker: Any, job_id: str, deadline: float) -> dict[str, Any]:
    """Poll one job until it succeeds; its view (a failure, a dead worker or the deadline raises)."""
    while True:
        view: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").get_json()
        if view["status"] == "succeeded":
            return view
        if JobStatus(view["status"]).is_terminal:
            raise RuntimeError(f"job {job_id} ended {view['status']}: {view.get('error')}")
        worker.check_running("the worker")
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} still {view['status']} at the deadline")
        time.sleep(POLL_S)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the loads and the switches")
    parser.add_argument("--line-rounds", type=int, default=3, help="paired rounds of the alternating line")
    parser.add_argument("--jobs", type=int, default=40, help="the alternating line's length")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    print("\n".join(report(args.rounds, args.line_rounds, args.jobs, args.size, args.steps)))


if __name__ == "__main__":
    main()
