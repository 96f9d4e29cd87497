"""slotq beside the systems its users would otherwise put in front of a GPU, on one trace:

    python -m bench.peers [--rounds 3] [--jobs 60] [--loads 0.5,0.9,1.3] [--plot FILE] [--quick]

Peers, each serving the tiny SD pipeline on the CPU with the same torch threads: slotq with its
defaults (batches of up to 8, step-level scheduling and preemption); slotq one job at a time
(``SLOTQ_MAX_BATCH=1``, ``SLOTQ_STEP_SCHEDULING=false``: the defaults before this benchmark);
Ray Serve with ``@serve.batch`` (bench/peers/ray_app.py); a Celery worker behind a Flask app
(bench/peers/celery_app.py). A peer
whose packages are missing (the ``bench`` extra) is skipped with a line saying so.

All peers run side by side, idle but for the one replaying. Each first serves every shape of job of
the trace alone (its solo latency: a job's SLO is 3 times it, on that peer). The capacity is the mix's
mean solo time on slotq with its defaults; each round replays, for each load, one seeded open-loop
trace of Poisson arrivals at that share of the capacity to every peer in turn (the order rotating),
clients giving up at 10 times their SLO. Each client asks to start by its SLO less its solo latency,
which slotq takes as the job's ``deadline_s`` (refusing at once what its estimates say cannot start
by then) and the others have no field for. The median of the rounds counts; the spread is shown.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.peers.peer import Outcome, Peer
from bench.peers.replay import ClassFigures, Shape, figures, replay, shape, solo_latencies
from bench.peers.slotq_peer import ONE_AT_A_TIME, SlotqPeer
from bench.peers.trace import CLASSES, QUICK_CLASSES, SLO_FACTOR, JobClass, TraceJob, mean_service_s, trace
from bench.stats import median

SLOTQ, ONE_NAME = "slotq", "slotq, one job at a time"
SETTLE_S = 60.0


@dataclass
class Served:
    """One peer in the run: its solo latencies, and per load its rounds' outcomes."""

    peer: Peer
    solo: dict[Shape, float] = field(default_factory=dict)
    rounds: dict[float, list[tuple[list[TraceJob], list[Outcome], float]]] = field(default_factory=dict)
    lost: int = 0
    queue_rss: int = 0

    def slo_s(self, job: TraceJob) -> float:
        return SLO_FACTOR * self.solo[shape(job)]


def available_peers(cache_dir: Path, threads: int) -> tuple[list[Peer], list[str]]:
    """Every peer that can run here, and a line for each that cannot."""
    peers: list[Peer] = [SlotqPeer(cache_dir, threads, SLOTQ),
                         SlotqPeer(cache_dir, threads, ONE_NAME, ONE_AT_A_TIME)]
    skipped = []
    if importlib.util.find_spec("ray") is not None:
        from bench.peers.ray_peer import RayServePeer

        peers.append(RayServePeer(cache_dir, threads))
    else:
        skipped.append("Ray Serve: skipped, `ray[serve]` is not installed (pip install .[bench])")
    if importlib.util.find_spec("celery") is not None:
        from bench.peers.celery_peer import CeleryPeer

        peers.append(CeleryPeer(cache_dir, threads))
    else:
        skipped.append("Celery: skipped, `celery` is not installed (pip install .[bench])")
    return peers, skipped


@contextmanager
def started(peers: Sequence[Peer], scratch: Path) -> Iterator[list[Served]]:
    """Every peer started (side by side, each in its own folder) and stopped after."""
    with ExitStack() as stack:
        def start(peer: Peer) -> Served:
            folder = scratch / peer.name.replace(" ", "-").replace(",", "")
            folder.mkdir()
            stack.callback(peer.stop)
            peer.start(folder)
            return Served(peer)

        with ThreadPoolExecutor(len(peers)) as pool:
            served = list(pool.map(start, peers))
        yield served


def run(served: list[Served], classes: tuple[JobClass, ...], rounds: int, jobs: int,
        loads: Sequence[float], solo_repeats: int) -> float:
    """Measure each peer's solo latencies, then replay the rounds; the capacity (jobs/s) used."""
    shapes = [TraceJob(0.0, job_class.name, side, steps, job_class.priority, seed=0)
              for job_class in classes for side in job_class.sides for steps in job_class.steps]
    for each in served:
        each.solo = solo_latencies(each.peer, shapes, solo_repeats)
    base = next(each for each in served if each.peer.name == SLOTQ)
    mean_by_class = {job_class.name: median([base.solo[(side, steps)] for side in job_class.sides
                                             for steps in job_class.steps]) for job_class in classes}
    capacity = 1.0 / mean_service_s(classes, mean_by_class)
    for round_index in range(rounds):
        for load in loads:
            arrivals = trace(classes, jobs, capacity * load, seed=1000 * round_index + int(load * 100))
            order = served[round_index % len(served):] + served[:round_index % len(served)]
            for each in order:
                begun = time.perf_counter()
                outcomes = replay(each.peer, arrivals, each.slo_s)
                span = time.perf_counter() - begun
                each.rounds.setdefault(load, []).append((arrivals, outcomes, span))
                each.lost += each.peer.lost(SETTLE_S)
                each.queue_rss = max(each.queue_rss, each.peer.queue_rss())
    return capacity


def class_figures(each: Served, load: float, job_class: str) -> list[ClassFigures]:
    """The class's figures in each round that had a job of it."""
    return [f for f in round_figures(each, load, job_class) if f.jobs]


def round_figures(each: Served, load: float, job_class: str) -> list[ClassFigures]:
    return [figures(arrivals, outcomes, each.slo_s, job_class, span)
            for arrivals, outcomes, span in each.rounds.get(load, [])]


def spread(values: Sequence[float], digits: int = 2) -> str:
    """The median, and the range of the rounds where there are several."""
    middle = f"{median(values):.{digits}f}"
    return middle if len(values) < 2 else f"{middle} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def table(served: list[Served], classes: tuple[JobClass, ...], loads: Sequence[float]) -> list[str]:
    """One line a peer, class and load: what its clients felt."""
    lines = [f"{'load':>4}  {'peer':<24} {'class':<11} {'SLO met':<17} {'goodput/s':<17} "
             f"{'p50 s':>6} {'p95 s':>6} {'p99 s':>6} {'jobs':>5} {'refused':>7} {'refusal s':>9}"]
    for load in loads:
        for each in served:
            for job_class in classes:
                rounds = class_figures(each, load, job_class.name)
                if not rounds:  # no job of the class arrived (a --quick trace)
                    lines.append(f"{load:>4}  {each.peer.name:<24} {job_class.name:<11} -")
                    continue
                tails = [shown([getattr(f, name) for f in rounds if getattr(f, name) is not None])
                         for name in ("p50", "p95", "p99")]
                refusal = [f.refusal_s for f in rounds if f.refusal_s is not None]
                lines.append(f"{load:>4}  {each.peer.name:<24} {job_class.name:<11} "
                             f"{spread([f.attainment for f in rounds]):<17} "
                             f"{spread([f.goodput for f in rounds]):<17} "
                             f"{tails[0]:>6} {tails[1]:>6} {tails[2]:>6} "
                             f"{median([f.jobs for f in rounds]):>5.0f} "
                             f"{median([f.refused for f in rounds]):>7.0f} "
                             f"{(f'{max(refusal):.3f}' if refusal else '-'):>9}")
    lines += ["lost (admitted, never ended): "
              + ", ".join(f"{each.peer.name} {each.lost}" for each in served),
              "queueing side's memory (MiB): "
              + ", ".join(f"{each.peer.name} {each.queue_rss / 2**20:.0f}" for each in served)]
    return lines


def shown(values: Sequence[float]) -> str:
    """The median of the rounds' figures, or a dash where no job of the class ended."""
    return f"{median(values):.2f}" if values else "-"


def goodput(each: Served, load: float, classes: tuple[JobClass, ...]) -> float:
    """The median over rounds of the goodput summed over the classes."""
    by_class = [round_figures(each, load, job_class.name) for job_class in classes]
    return median([sum(f.goodput for f in in_round) for in_round in zip(*by_class, strict=True)] or [0.0])


def goals(served: list[Served], classes: tuple[JobClass, ...], loads: Sequence[float]) -> list[str]:
    """Issue 58's goals, each met or missed, for each slotq row."""
    lines = []
    for mine in (each for each in served if each.peer.name.startswith(SLOTQ)):
        others = [each for each in served if each is not mine]
        unstepped = [each for each in others if each.peer.name != SLOTQ]  # slotq's defaults step
        if 0.9 in loads:
            own = median([f.attainment for f in class_figures(mine, 0.9, "interactive")] or [0.0])
            best = max((median([f.attainment for f in class_figures(each, 0.9, "interactive")] or [0.0])
                        for each in unstepped), default=0.0)
            lines.append(verdict(f"{mine.peer.name}: interactive SLO met at 0.9 load, at least 0.95 and "
                                 f"1.44x each peer without step scheduling: {own:.2f} vs {best:.2f}",
                                 own >= 0.95 and own >= 1.44 * best))
            mine_goodput = goodput(mine, 0.9, classes)
            top = max((goodput(each, 0.9, classes) for each in others), default=0.0)
            lines.append(verdict(f"{mine.peer.name}: goodput at 0.9 load at least every peer's: "
                                 f"{mine_goodput:.2f}/s vs {top:.2f}/s", mine_goodput >= top))
        if 1.3 in loads:
            by_class = [round_figures(mine, 1.3, job_class.name) for job_class in classes]
            admitted = median([sum(f.met for f in in_round) / max(1, sum(f.admitted for f in in_round))
                               for in_round in zip(*by_class, strict=True)] or [0.0])
            rounds = [f for in_class in by_class for f in in_class]
            refused = sum(f.refused for f in rounds)
            at_once = all(f.retry_after == f.refused and (f.refusal_s or 0.0) < 0.1 for f in rounds)
            lines.append(verdict(f"{mine.peer.name}: at 1.3 load, admitted jobs meet their SLO "
                                 f"(at least 0.9): {admitted:.2f}; the rest refused at once with "
                                 f"Retry-After: {refused} refused",
                                 admitted >= 0.9 and refused > 0 and at_once))
        lines.append(verdict(f"{mine.peer.name}: jobs lost: {mine.lost}", mine.lost == 0))
    return lines


def verdict(text: str, met: bool) -> str:
    return f"{'met   ' if met else 'missed'}  {text}"


def plot(served: list[Served], classes: tuple[JobClass, ...], load: float, path: Path) -> None:
    """Latency CDF per class per peer at ``load``, the rounds pooled (matplotlib, PNG)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(classes), figsize=(5 * len(classes), 4), sharey=True)
    for axis, job_class in zip(axes, classes, strict=True):
        for each in served:
            latencies = sorted(outcome.latency_s for arrivals, outcomes, _ in each.rounds.get(load, [])
                               for job, outcome in zip(arrivals, outcomes, strict=True)
                               if job.job_class == job_class.name and outcome.latency_s is not None)
            if latencies:
                total = sum(job.job_class == job_class.name for arrivals, _, _ in each.rounds[load]
                            for job in arrivals)
                axis.step(latencies, [(index + 1) / total for index in range(len(latencies))],
                          where="post", label=each.peer.name)
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # decades only: no overlap
        axis.set_title(f"{job_class.name} ({load} of capacity)")
        axis.set_xlabel("latency, s (log)")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("share of the class's jobs done")
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8)
    figure.subplots_adjust(bottom=0.22)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report(rounds: int = 3, jobs: int = 60, loads: Sequence[float] = (0.5, 0.9, 1.3), quick: bool = False,
           plot_path: Path | None = None, threads: int | None = None) -> list[str]:
    """Run every available peer through the rounds; the report's lines."""
    classes = QUICK_CLASSES if quick else CLASSES
    threads = threads or os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="slotq-peers-") as scratch:
        peers, skipped = available_peers(Path(scratch) / "models", threads)
        with started(peers, Path(scratch)) as served:
            capacity = run(served, classes, rounds, jobs, loads, solo_repeats=1 if quick else 2)
            lines = [f"capacity {capacity:.2f} jobs/s (slotq's mean solo time over the mix); {rounds} "
                     f"round(s) of {jobs} jobs a load; torch threads {threads}", *skipped,
                     *table(served, classes, loads), *goals(served, classes, loads)]
            if plot_path is not None:
                plot(served, classes, 0.9 if 0.9 in loads else loads[0], plot_path)
                lines.append(f"plot: {plot_path}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=60, help="jobs a trace (each load, each round)")
    parser.add_argument("--loads", default="0.5,0.9,1.3", help="shares of the capacity, comma-separated")
    parser.add_argument("--plot", type=Path, help="write the latency CDFs at 0.9 load here (PNG)")
    parser.add_argument("--threads", type=int, help="torch threads of every peer (default: the CPUs)")
    parser.add_argument("--quick", action="store_true", help="one round of 6 tiny jobs at 0.9: it runs")
    args = parser.parse_args(argv)
    if args.quick:
        lines = report(rounds=1, jobs=6, loads=(0.9,), quick=True, plot_path=args.plot, threads=args.threads)
    else:
        loads = tuple(float(load) for load in args.loads.split(","))
        lines = report(args.rounds, args.jobs, loads, plot_path=args.plot, threads=args.threads)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
