"""Speed at the edges: what the service costs over the least it could cost, at admission and at the worker.

    python -m bench.edges [--quick]

Admission: ``slotq api`` against a bare Flask endpoint that does one ``LPUSH`` (the same gunicorn
configuration, over HTTP), refusals against admissions, and a deep line against a short one. Images:
the service's images/s against the least a service does (the pipeline in a loop, handing each
image's PNG to a second process) and against the plain loop. Every figure is the median of per-round
ratios to a baseline measured in the same round; each line ends with its goal, met or missed.
docs/benchmarks.md says how each is measured.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import multiprocessing
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import astuple, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families
from redis import Redis

from api.app import create_app
from bench import admission, end_to_end, memory
from bench.stats import median, percentile, ratios
from shared.contract import keys
from shared.contract.jobs import PRIORITIES, JobRequest
from shared.contract.settings import Settings
from shared.contract.tenants import Tenant
from shared.store import waiting
from shared.store.admission import enqueue_job
from shared.store.connection import connect, job_queue
from slotq.harness import Service
from slotq.localredis import free_port, running_redis

JOB = {"prompt": "bench", "width": 64, "height": 64, "steps": 4}
BODY = json.dumps(JOB)
PROCESSES, CLIENTS = 2, 32
CAPACITY = 1_000_000  # the most SLOTQ_QUEUE_CAPACITY takes: no admission run comes near it
TENANTS = [Tenant(name=f"tenant-{index}") for index in range(4)]
MODEL_A, MODEL_B = 0.05, 0.02  # a fitted job-time model (seconds, seconds a cost unit): admissions get ETAs
SHORT, DEEP = 10, 10_000  # waiting jobs: the deep line is 1,000 times the short one
LONG_JOB_S = 1.5  # the job the N jobs wait behind while they are submitted
MAX_STEPS = 100  # SLOTQ_MAX_STEPS's default, which a job's view is checked against (a longer job's fails)
LEAST_GOAL = 0.97  # of the least service's images/s
PLAIN_GOAL = 1.0  # of the plain loop's, on a GPU, where the service's other work runs beside the device's
NAME_WIDTH = 48  # a figure's name, before its value
WRK_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}
Snapshot = list[tuple[bytes, int, bytes]]
T = TypeVar("T")


@dataclass(frozen=True)
class Run:
    """What one load run measured."""

    rate: float  # requests a second
    p99: float  # seconds
    requests: int
    rejected: int  # answers other than 2xx
    errors: int = 0  # sockets that failed or timed out

    @classmethod
    def of_wrk(cls, output: str) -> Run:
        rate = re.search(r"^Requests/sec:\s+([\d.]+)", output, re.MULTILINE)
        p99 = re.search(r"^\s+99%\s+([\d.]+)(us|ms|s|m)\s*$", output, re.MULTILINE)
        total = re.search(r"^\s+(\d+) requests in", output, re.MULTILINE)
        if not (rate and p99 and total):
            raise RuntimeError(f"cannot read wrk's report:\n{output}")
        rejected = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", output)
        errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output)
        return cls(float(rate[1]), float(p99[1]) * WRK_UNITS[p99[2]], int(total[1]),
                   int(rejected[1]) if rejected else 0, sum(map(int, errors.groups())) if errors else 0)


@dataclass(frozen=True)
class Load:
    """The load generator: wrk where it is installed, else Python's keep-alive clients."""

    seconds: int
    requests: int  # a run's requests, for the Python clients
    scratch: Path
    wrk: str | None = field(default_factory=lambda: shutil.which("wrk"))

    def describe(self) -> str:
        if self.wrk:
            return f"wrk -t2 -c{CLIENTS} -d{self.seconds}s --latency"
        return (f"Python (bench.admission.load), {CLIENTS} keep-alive clients, {self.requests} requests a "
                "run: wrk was not found")

    def run(self, port: int, warm_up: bool = False) -> Run:
        """One run against the server on ``port`` (a short one to warm it up)."""
        if not self.wrk:
            count = min(self.requests, 200) if warm_up else self.requests
            times, wall, statuses = admission.load(port, count, CLIENTS, body=BODY)
            return Run(len(times) / wall, percentile(times, 0.99), len(times),
                       sum(n for status, n in statuses.items() if not 200 <= status < 300))
        script = self.scratch / "post.lua"
        script.write_text(f'wrk.method = "POST"\nwrk.body = {json.dumps(BODY)}\n'
                          'wrk.headers["Content-Type"] = "application/json"\n')
        seconds = min(self.seconds, 2) if warm_up else self.seconds
        command = [self.wrk, "-t2", f"-c{CLIENTS}", f"-d{seconds}s", "--latency", "-s", str(script),
                   f"http://127.0.0.1:{port}/v1/jobs"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60, check=True)
        return Run.of_wrk(done.stdout)


INFORMATIVE = "informative here (read on a GPU)"


def figure(name: str, ratios: list[float], detail: str, goal: str, meets: Callable[[float], bool] | None,
           digits: int = 2) -> str:
    """One figure's line: the median ratio, what it came from, every round, and its goal, met or
    missed (judged on the median as printed); ``meets`` None: a goal this machine does not judge."""
    rounds = " ".join(f"{ratio:.{digits}f}" for ratio in ratios)
    verdict = INFORMATIVE if meets is None else "met" if meets(round(median(ratios), digits)) else "missed"
    return (f"{name:{NAME_WIDTH}}{median(ratios):>6.{digits}f}  ({detail}; rounds {rounds})  "
            f"goal {goal}: {verdict}")


def goals(lines: list[str]) -> str:
    """The goals met and missed, in one line; and the figures only informative here."""
    missed = [line[:NAME_WIDTH].strip() for line in lines if line.endswith(": missed")]
    met = sum(line.endswith(": met") for line in lines)
    informative = sum(line.endswith(f": {INFORMATIVE}") for line in lines)
    return (f"goals: {met} of {met + len(missed)} met" + (f"; missed: {'; '.join(missed)}" if missed else "")
            + (f"; {informative} informative here, their goal read on a GPU" if informative else ""))


def fill(settings: Settings, count: int) -> None:
    """``count`` waiting jobs in the line, by 4 tenants at the three priorities, and the line's model."""
    connection = connect(settings)
    line = settings.line_of(settings.default_model)
    connection.hset(keys.model_key(line), mapping={"a": MODEL_A, "b": MODEL_B})
    queue = job_queue(connection, settings)
    for index in range(count):
        request = JobRequest(prompt="bench", width=64, height=64, steps=4, seed=index,
                             priority=PRIORITIES[index % len(PRIORITIES)])
        enqueue_job(queue, settings, request, tenant=TENANTS[index % len(TENANTS)])


def waiting_now(settings: Settings) -> int:
    return sum(waiting.counts(connect(settings), settings.line_of(settings.default_model)).values())


def snapshot(connection: Redis) -> Snapshot:
    """Every key of the database, dumped, with its time to live."""
    names = list(connection.scan_iter(count=1000))
    pipe = connection.pipeline(transaction=False)
    for name in names:
        pipe.pttl(name)
        pipe.dump(name)
    answers = pipe.execute()
    return [(name, max(0, ttl), value) for name, ttl, value in zip(names, answers[::2], answers[1::2],
                                                                    strict=True)]


def restore(connection: Redis, state: Snapshot) -> None:
    """The database as it was at the snapshot, nothing else."""
    connection.flushdb()
    pipe = connection.pipeline(transaction=False)
    for index, (name, ttl, value) in enumerate(state, 1):
        pipe.restore(name, ttl, value, replace=True)
        if index % 5000 == 0:
            pipe.execute()
    pipe.execute()


def script_calls(settings: Settings, refusals: int = 200) -> tuple[float, float]:
    """Script calls (EVAL/EVALSHA) and Redis commands in all per refusal, over ``refusals`` POSTs
    through the WSGI test client to a full line; Redis counts them (``INFO commandstats``)."""
    client, connection = create_app(settings).test_client(), Redis.from_url(settings.redis_url)

    def post() -> int:
        return client.post("/v1/jobs", data=BODY, content_type="application/json").status_code

    def counted() -> tuple[int, int]:
        stats = connection.info("commandstats")
        scripts = sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("evalsha", "eval"))
        commands = sum(int(value["calls"]) for name, value in stats.items() if name != "cmdstat_info")
        return scripts, commands

    assert post() == 429  # and the script is loaded
    scripts, commands = counted()
    statuses = {post() for _ in range(refusals)}
    assert statuses == {429}, statuses
    after_scripts, after_commands = counted()
    return (after_scripts - scripts) / refusals, (after_commands - commands) / refusals


def admission_lines(quick: bool, scratch: Path) -> tuple[str, list[str]]:
    """The admission figures over HTTP; their header and lines."""
    seconds, rounds, deep = (1, 1, 20 * SHORT) if quick else (8, 5, DEEP)
    load = Load(seconds, 100 if quick else 3000, scratch)
    with running_redis(scratch / "redis") as url, ExitStack() as stack:
        roomy = Settings(redis_url=url, queue_name="edges", queue_capacity=CAPACITY, cache_dir=scratch)
        full = Settings(redis_url=url, queue_name="full", queue_capacity=1, cache_dir=scratch)
        settle_s = 0 if quick else admission.SETTLE_S
        servers = {name: admission.served(settings, PROCESSES, name == "bare", scratch, "INFO", settle_s)
                   for name, settings in (("bare", roomy), ("slotq", roomy), ("refused", full))}
        ports = dict(zip(servers, enter_all(stack, list(servers.values())), strict=True))
        runs, ends = admission_rounds(load, ports, roomy, full, rounds, deep)
        Redis.from_url(url).flushdb()
        fill(full, 1)
        per_refusal, commands = script_calls(full)
    header = (f"admission: {load.describe()}, POST /v1/jobs {JOB['width']}x{JOB['height']} {JOB['steps']} "
              f"steps; gunicorn {PROCESSES} API processes x 8 threads, SLOTQ_LOG_LEVEL=INFO, each server "
              f"configured alike; {rounds} interleaved round(s)")
    return header, admission_figures(runs, ends, deep, per_refusal, commands)


def admission_rounds(load: Load, ports: dict[str, int], roomy: Settings, full: Settings, rounds: int,
                     deep: int) -> tuple[dict[str, list[Run]], dict[str, list[int]]]:
    """Each server's runs, the rounds interleaved, and the jobs waiting after each run on a filled line."""
    connection = Redis.from_url(roomy.redis_url)
    states: dict[str, Snapshot] = {}
    for name, count in (("short", SHORT), ("deep", deep)):  # each filled once, restored before each run
        connection.flushdb()
        fill(roomy, count)
        states[name] = snapshot(connection)
    for port in ports.values():  # warm up connections and code paths
        load.run(port, warm_up=True)
    runs: dict[str, list[Run]] = {name: [] for name in ("bare", "slotq", "refused", "short", "deep")}
    ends: dict[str, list[int]] = {"short": [], "deep": []}
    for _ in range(rounds):
        for name in ("bare", "slotq"):
            connection.flushdb()
            fill(roomy, 0)  # the line empty, its model fitted: a service that has run jobs
            runs[name].append(load.run(ports[name]))
        connection.flushdb()
        fill(full, 1)
        runs["refused"].append(load.run(ports["refused"]))
        assert waiting_now(full) == 1, "a job was admitted to the full line"
        for name in ("short", "deep"):
            restore(connection, states[name])
            runs[name].append(load.run(ports["slotq"]))
            ends[name].append(waiting_now(roomy))
    return runs, ends


def admission_figures(runs: dict[str, list[Run]], ends: dict[str, list[int]], deep: int,
                      per_refusal: float, commands: float) -> list[str]:
    """The admission lines, each against its goal."""
    def of(name: str, base: str, value: Callable[[Run], float]) -> list[float]:
        return ratios([value(run) for run in runs[name]], [value(run) for run in runs[base]])

    def rates(name: str) -> str:
        bad = sum(run.errors if name == "refused" else run.rejected + run.errors for run in runs[name])
        failed = f" ({bad:,} {'failed' if name == 'refused' else 'not 2xx or failed'})" if bad else ""
        return f"{median([run.rate for run in runs[name]]):,.0f}{failed}"

    def p99s(name: str) -> str:
        return f"{1000 * median([run.p99 for run in runs[name]]):.1f}"

    def rate(run: Run) -> float:
        return run.rate

    def p99(run: Run) -> float:
        return run.p99

    all_refused = all(run.rejected == run.requests and not run.errors for run in runs["refused"])
    waits = (f"{deep:,} vs {SHORT} waiting at the start, {median(ends['deep']):,.0f} vs "
             f"{median(ends['short']):,.0f} at the end")
    return [
        figure("admissions/s, slotq ÷ bare Flask+LPUSH", of("slotq", "bare", rate),
               f"{rates('slotq')} vs {rates('bare')} req/s", ">= 0.5", lambda value: value >= 0.5),
        figure("admission p99, slotq ÷ bare", of("slotq", "bare", p99),
               f"{p99s('slotq')} vs {p99s('bare')} ms", "<= 2", lambda value: value <= 2),
        figure("refusals/s, line full, ÷ admissions/s", of("refused", "slotq", rate),
               f"{rates('refused')} vs {rates('slotq')} req/s, {'all' if all_refused else 'NOT all'} 429; "
               f"{per_refusal:.2f} script calls (EVALSHA) and {commands:.2f} Redis commands a refusal",
               ">= 1, in one script call", lambda value: value >= 1 and all_refused and per_refusal == 1),
        figure("admissions/s, deep line ÷ short line", of("deep", "short", rate),
               f"{rates('deep')} vs {rates('short')} req/s; {waits}", "~1 (0.9 to 1.1)",
               lambda value: 0.9 <= value <= 1.1),
        figure("admission p99, deep line ÷ short line", of("deep", "short", p99),
               f"{p99s('deep')} vs {p99s('short')} ms", "~1 (0.9 to 1.1)", lambda value: 0.9 <= value <= 1.1),
    ]


@dataclass(frozen=True)
class ImageCase:
    """One images/s figure: the jobs' size, how many a round, and the batch both sides run."""

    name: str
    size: int
    jobs: int
    batch: int

    def requests(self, first_seed: int = 0) -> list[JobRequest]:
        return [JobRequest(prompt="bench", width=self.size, height=self.size, steps=4, seed=seed)
                for seed in range(first_seed, first_seed + self.jobs)]


def loop_rate(pipeline: Any, case: ImageCase, threads: int, png: PngProcess | None = None) -> float:
    """Images a second calling the pipeline back to back in this process, in batches of the case's,
    with ``threads`` torch threads; with ``png``, handing it each image as it is made, the last one's
    PNG included (the least a service does)."""
    import torch

    torch.set_num_threads(threads)
    batch, handed, began = case.requests(), 0, time.perf_counter()
    for start in range(0, len(batch), case.batch):
        requests = batch[start:start + case.batch]
        made = pipeline.generate_batch(requests)
        if png is not None:
            handed += sum(png.hand(request, images) for request, images in zip(requests, made, strict=True))
    if png is not None:
        png.wait(handed)
    return len(batch) / (time.perf_counter() - began)


def thread_counts() -> list[int]:
    """The torch thread counts the loops choose from, as the worker on the CPU does: 1 and torch's default."""
    from worker.pipeline import TORCH_DEFAULT_THREADS

    return sorted({1, TORCH_DEFAULT_THREADS})


class PngProcess:
    """A second process that encodes each image it is handed into a PNG, as the finishing process
    does (at SLOTQ_PNG_COMPRESS_LEVEL's default): the least work a service adds to the pipeline call."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")  # as the worker starts its finishing process
        self._here, there = context.Pipe()
        self._process = context.Process(target=_encode_each, args=(there,), name="bench-png", daemon=True)
        self._process.start()
        self._here.recv()  # ready: its imports are done, so no round's time includes them

    def hand(self, request: JobRequest, images: list[Any]) -> int:
        """Send a request's images to be encoded; how many."""
        for image in images:
            self._here.send((image, request))
        return len(images)

    def wait(self, count: int) -> None:
        """Until ``count`` more images are encoded."""
        for _ in range(count):
            self._here.recv()

    def close(self) -> None:
        self._here.send(None)
        self._process.join(30)


def _encode_each(connection: Any) -> None:
    from worker.messages import encode_png

    level = Settings.model_fields["png_compress_level"].default
    connection.send(True)
    while (item := connection.recv()) is not None:
        image, request = item
        encode_png(image, request, level)
        connection.send(True)


def ceiling_threads(pipeline: Any, case: ImageCase, trials: int) -> int:
    """The faster for this case of the :func:`thread_counts`, by the median of ``trials`` alternating
    loops each: the plain loop's count, fixed for every round (the faster of two noisy loops each
    round would be a ceiling raised by the noise); with no trials, the fewer."""
    counts = thread_counts()
    rates: dict[int, list[float]] = {count: [] for count in counts}
    for _ in range(trials if len(counts) > 1 else 0):
        for count in counts:
            rates[count].append(loop_rate(pipeline, case, count))
    return max(counts, key=lambda count: median(rates[count]) if rates[count] else 0.0)


@dataclass
class LongJob:
    """The job the N jobs of a round wait behind while they are submitted: of the round's size where
    100 steps (SLOTQ_MAX_STEPS's default) last long enough, else larger."""

    side: int
    steps: int

    @classmethod
    def lasting(cls, seconds: float, case: ImageCase, per_image: float) -> LongJob:
        side, steps = case.size, math.ceil(seconds / per_image * 4)
        while steps > MAX_STEPS and side < 1024:
            side, steps = 2 * side, math.ceil(steps / 3)  # 4x the pixels: about 3x the time a step
        return cls(side, max(16, min(MAX_STEPS, steps)))

    def longer(self) -> LongJob:
        if self.steps < MAX_STEPS:
            return LongJob(self.side, min(MAX_STEPS, 2 * self.steps))
        return LongJob(min(1024, 2 * self.side), self.steps)

    def body(self, seed: int) -> dict[str, Any]:
        return {**JOB, "width": self.side, "height": self.side, "steps": self.steps, "seed": seed}


def submit(port: int, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """POST each job in turn on one keep-alive connection; their views."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    views = []
    try:
        for body in bodies:
            connection.request("POST", "/v1/jobs", body=json.dumps(body),
                               headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            answer = response.read()
            if response.status != 202:
                raise RuntimeError(f"POST /v1/jobs answered {response.status}: {answer[:300]!r}")
            views.append(json.loads(answer))
    finally:
        connection.close()
    return views


def read(port: int, job_id: str) -> dict[str, Any]:
    status, answer = end_to_end.call(port, "GET", f"/v1/jobs/{job_id}")
    if status != 200:
        raise RuntimeError(f"GET /v1/jobs/{job_id} answered {status}: {answer[:300]!r}")
    view: dict[str, Any] = json.loads(answer)
    return view


@dataclass(frozen=True)
class WorkerTime:
    """The worker's GPU sections so far, from its metrics: their time in all and how many."""

    busy_s: float
    executions: int

    @classmethod
    def scraped(cls, port: int) -> WorkerTime:
        status, answer = end_to_end.call(port, "GET", "/metrics")
        if status != 200:
            raise RuntimeError(f"the worker's /metrics answered {status}")
        samples = {sample.name: sample.value for family in text_string_to_metric_families(answer.decode())
                   for sample in family.samples}
        return cls(samples["slotq_gpu_busy_seconds_total"], int(samples["slotq_gpu_section_seconds_count"]))


@dataclass(frozen=True)
class SideWork:
    """CPU seconds of what runs beside the worker's pipeline calls: the API's processes, the worker's
    threads but its main one, its finishing process and Redis."""

    api: float
    threads: float
    finisher: float
    redis: float

    @classmethod
    def read(cls, service: Service) -> SideWork | None:
        """Their CPU so far, from /proc; None where there is none (not Linux)."""
        if not Path("/proc/self/stat").exists():
            return None
        api, worker = service.api.pid, service.worker.pid
        return cls(api=sum(cpu_seconds(pid) for pid in [api, *memory.children(api)]),
                   threads=cpu_seconds(worker) - cpu_seconds(worker, thread=worker),
                   finisher=cpu_seconds(memory.finishing_process(worker)),
                   redis=cpu_seconds(service.redis.pid))

    def per_image(self, before: SideWork, images: int) -> SideWork:
        """What each took an image between ``before`` and this reading."""
        pairs = zip(astuple(self), astuple(before), strict=True)
        return SideWork(*((now - then) / images for now, then in pairs))

    @staticmethod
    def describe(readings: list[SideWork]) -> str:
        """The median of each, in ms."""
        columns = zip(*map(astuple, readings), strict=True)
        api, threads, finisher, redis = (1000 * median(list(column)) for column in columns)
        return (f"the service's other CPU an image: API {api:.1f} ms, the worker's other threads "
                f"{threads:.1f}, its finishing process {finisher:.1f}, Redis {redis:.1f}")


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User and system CPU of a process (its threads, ended ones included), or of one of its threads."""
    path = f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Served:
    """One service round: its images a second, its pipeline calls' time an image and the CPU of the
    service's other work an image (each None when no execution ended between the two readings)."""

    rate: float
    call_s: float | None
    side: SideWork | None = None


def service_rate(service: Service, case: ImageCase, long: LongJob, first_seed: int) -> Served | None:
    """Images a second through the service: N jobs submitted behind a long one, followed in order;
    None when the long job ended before the last of them was submitted (the line ran dry). With it,
    the worker's pipeline calls' time an image, and the CPU of the service's other work an image,
    over the executions that ended after the long job's end was seen (its metrics and the CPU read
    then and at the last job's end)."""
    port, deadline = service.port, time.monotonic() + 600
    metrics_port = service.settings.worker_metrics_port or 0
    [first] = submit(port, [long.body(first_seed + case.jobs)])
    while first["status"] == "queued":  # until the worker holds it: the N jobs then all wait
        time.sleep(0.01)
        first = read(port, first["id"])
    jobs = submit(port, [request.model_dump(mode="json", exclude_none=True)
                         for request in case.requests(first_seed)])
    submitted = datetime.now(UTC)
    end_to_end.wait_end(port, first, deadline)
    after_long, side_before = WorkerTime.scraped(metrics_port), SideWork.read(service)
    for view in jobs:
        end_to_end.wait_end(port, view, deadline)
    at_end, side_after = WorkerTime.scraped(metrics_port), SideWork.read(service)
    began = datetime.fromisoformat(read(port, first["id"])["finished_at"])
    if began <= submitted:
        return None
    ended = max(datetime.fromisoformat(read(port, view["id"])["finished_at"]) for view in jobs)
    images = (at_end.executions - after_long.executions) * case.batch  # the line was full: whole batches
    call_s = (at_end.busy_s - after_long.busy_s) / images if images else None
    side = side_after.per_image(side_before, images) if images and side_after and side_before else None
    return Served(case.jobs / (ended - began).total_seconds(), call_s, side)


def image_lines(quick: bool, scratch: Path, shared: Service | None = None) -> tuple[str, list[str]]:
    """The images/s figures, the service against the least service and the plain loop; their header
    and lines. The batch-1 cases run on ``shared`` where given (it must serve its worker's metrics)."""
    import torch

    from worker.pipeline import load_pipeline

    rounds, cuda = 1 if quick else 7, torch.cuda.is_available()
    cases = [ImageCase("images/s 64x64, service ÷ least service", 64, 4 if quick else 48, 1),
             ImageCase("images/s 256x256, service ÷ least service", 256, 2 if quick else 16, 1),
             ImageCase("images/s batch 8 64x64, service ÷ least service", 64, 8 if quick else 48, 8)]
    models = scratch / "models"
    pipeline = load_pipeline(Settings(cache_dir=models))  # the tiny model, made once, on the service's device
    lines = []
    with ExitStack() as stack:  # both services at once: their start-ups overlap; one idles at a time
        services = [image_service(scratch, batch, models, shared if batch == 1 else None) for batch in (1, 8)]
        running = dict(zip((1, 8), enter_all(stack, services), strict=True))
        png = PngProcess()
        stack.callback(png.close)
        for case in cases:
            measured = image_rounds(pipeline, running[case.batch], png, case, rounds, quick)
            lines.append(image_figure(case, measured, cuda))
    jobs = ", ".join(f"{case.jobs} at {case.size}x{case.size}"
                     + (f" in batches of {case.batch}" if case.batch > 1 else "") for case in cases)
    counts = " or ".join(map(str, thread_counts()))
    header = (f"images: tiny model on {pipeline.device} (OMP_NUM_THREADS="
              f"{os.environ.get('OMP_NUM_THREADS', 'unset')} for every process; the worker at "
              f"SLOTQ_TORCH_THREADS's default), 4 steps; jobs a round: {jobs}; {rounds} round(s), each "
              f"the plain loop (no PNG, at the faster of {counts} torch thread(s) for the case, chosen "
              f"before the rounds), the service, the least service (each PNG handed to a second process) "
              f"at {counts} thread(s), the faster the round's baseline, and the plain loop again")
    return header, lines


def image_service(scratch: Path, batch: int, models: Path, shared: Service | None
                  ) -> AbstractContextManager[Service]:
    """The service the cases of this batch size run on, serving its worker's metrics."""
    return end_to_end.serving(shared, scratch / f"batch-{batch}", 8, log_level="INFO", max_batch=batch,
                              cache_dir=models, worker_metrics_port=free_port())


@dataclass
class ImageRounds:
    """One case's rounds: the plain loop's images/s, the service's, the least service's by thread count."""

    threads: int  # the plain loop's torch threads
    long: LongJob
    loops: list[float] = field(default_factory=list)
    served: list[Served] = field(default_factory=list)
    least: dict[int, list[float]] = field(default_factory=dict)

    def least_best(self) -> list[float]:
        """Each round's baseline: the faster thread count of its least service."""
        return [max(rates) for rates in zip(*self.least.values(), strict=True)]


def image_rounds(pipeline: Any, service: Service, png: PngProcess, case: ImageCase, rounds: int,
                 quick: bool) -> ImageRounds:
    """One case's rounds, each the plain loop, the service, the least service at each thread count
    and the plain loop again (their mean the round's plain loop: a drift of the machine's speed lands
    on both sides); a round whose line ran dry runs again behind a longer job."""
    if not quick:  # the first calls of a shape, and the service's first jobs, are slower: warm up
        warm_up(pipeline, service, png, case)
    threads = ceiling_threads(pipeline, case, 0 if quick else 3)
    per_image = 1 / loop_rate(pipeline, case, threads)
    long = LongJob.lasting(LONG_JOB_S / 3 if quick else LONG_JOB_S, case, per_image)
    measured = ImageRounds(threads, long, least={count: [] for count in thread_counts()})
    for attempt in range(rounds + 6):
        before = loop_rate(pipeline, case, threads)
        served = service_rate(service, case, measured.long, 1000 * attempt)
        if served is None:  # the long job was too short: lengthen it, run the round again
            measured.long = measured.long.longer()
            continue
        for count, rates in measured.least.items():
            rates.append(loop_rate(pipeline, case, count, png))
        measured.loops.append((before + loop_rate(pipeline, case, threads)) / 2)
        measured.served.append(served)
        if len(measured.served) == rounds:
            return measured
    raise RuntimeError(f"{case.name}: the line ran dry while its jobs were submitted")


def warm_up(pipeline: Any, service: Service, png: PngProcess, case: ImageCase) -> None:
    """Untimed: the loop at each thread count, the service on a short line, the PNG process at this size."""
    for count in thread_counts():
        loop_rate(pipeline, case, count)
    service_rate(service, case, LongJob(case.size, 16), 10**6)
    loop_rate(pipeline, case, thread_counts()[0], png)


def image_figure(case: ImageCase, measured: ImageRounds, cuda: bool) -> str:
    """One case's line: the service against the least service and against the plain loop. Judged on a
    GPU alone, where the pipeline's work is the device's and the service's other work should hide
    behind it; on the CPU the API, the finishing process and Redis share the pipeline's cores, so the
    line informs."""
    rates = [served.rate for served in measured.served]
    least, plain = ratios(rates, measured.least_best()), ratios(rates, measured.loops)
    plain_met = not cuda or round(median(plain), 3) >= PLAIN_GOAL
    long = measured.long
    detail = (f"{median(rates):.2f} vs {median(measured.least_best()):.2f} images/s, worst round "
              f"{min(least):.3f}; ÷ the plain loop {median(plain):.3f} ({median(measured.loops):.2f} "
              f"images/s at {measured.threads} torch thread(s)); {case.jobs} jobs behind one of "
              f"{long.side}x{long.side}, {long.steps} steps; {where_time_went(measured)}")
    goal = f">= {LEAST_GOAL}, and >= {PLAIN_GOAL} of the plain loop, on a GPU"
    judged = (lambda value: value >= LEAST_GOAL and plain_met) if cuda else None
    return figure(case.name, least, detail, goal, judged, digits=3)


def where_time_went(measured: ImageRounds) -> str:
    """The service's time an image: the pipeline call (against the plain loop's) and the rest, the
    CPU of its other work, and what the least service reached of the plain loop at each thread count."""
    split = [(1000 * served.call_s, 1000 / loop, 1000 / served.rate)
             for served, loop in zip(measured.served, measured.loops, strict=True)
             if served.call_s is not None]
    where = "no execution ended between the reads of the worker's metrics" if not split else (
        f"an image: the pipeline call {median([call for call, _, _ in split]):.1f} ms in the service vs "
        f"{median([ceiling for _, ceiling, _ in split]):.1f} in the plain loop "
        f"({median([call / ceiling for call, ceiling, _ in split]):.2f} times), "
        f"{median([each - call for call, _, each in split]):.1f} ms outside the call")
    sides = [served.side for served in measured.served if served.side is not None]
    if sides:
        where += f"; {SideWork.describe(sides)}"
    reached = ", ".join(f"{median(ratios(rates, measured.loops)):.3f} of the loop at {count} thread(s)"
                        for count, rates in measured.least.items())
    least = f"the loop handing each image's PNG to a second process, the least a service does: {reached}"
    return f"{where}; {least}"


def enter_all(stack: ExitStack, managers: Sequence[AbstractContextManager[T]]) -> list[T]:
    """Enter the context managers at once, each on a thread (servers start side by side), into
    ``stack``; their values. Where one fails, those that started are stopped with the stack."""
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(manager.__enter__) for manager in managers]
        failures = [future.exception() for future in futures]
    for manager, failure in zip(managers, failures, strict=True):
        if failure is None:
            stack.push(manager)
    for failure in failures:
        if failure is not None:
            raise failure
    return [future.result() for future in futures]


@contextmanager
def scratch_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="slotq-bench-") as scratch:
        yield Path(scratch)


def report(quick: bool = False, shared: Service | None = None) -> list[str]:
    """Every figure of the section, each on one line, after the headers; last, the goals met."""
    with scratch_dir() as scratch:
        for name in ("admission", "images"):
            (scratch / name).mkdir()
        admission_header, admitted = admission_lines(quick, scratch / "admission")
        image_header, images = image_lines(quick, scratch / "images", shared)
    return [admission_header, image_header, *admitted, *images, goals([*admitted, *images])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test; figures mean little)")
    print("\n".join(report(parser.parse_args().quick)))


if __name__ == "__main__":
    main()
