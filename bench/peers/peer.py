"""What every peer of ``bench.peers`` offers the replay: start, serve one job a client waits for,
say what it lost, stop. Each peer is a module of this package whose set-up a user could copy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from bench.peers.trace import TraceJob


@dataclass(frozen=True)
class Outcome:
    """One job as its client saw it: admitted or refused (and how fast), its latency from arrival to
    the image in hand, or that the client gave up on it."""

    admitted: bool
    latency_s: float | None = None  # None: no image (refused, gave up, or failed)
    refused_in_s: float | None = None  # how long the refusal took to come
    retry_after: bool = False  # the refusal said when to come back
    gave_up: bool = False  # the client stopped waiting (10x its SLO) and let the peer know where it can
    failed: bool = False  # the peer answered with an error


class Peer(Protocol):
    """A serving system, started and stopped inside the benchmark, on the tiny SD pipeline."""

    name: str  # the table's row label
    priorities: bool  # whether it serves a job's class (high, normal, low) first

    def start(self, scratch: Path) -> None:
        """Start every process it needs, the model loaded once, and return once it serves."""

    def call(self, job: TraceJob, give_up_s: float, start_by_s: float | None = None) -> Outcome:
        """Submit the job and wait for its image, as a client would (thread-safe, blocking).
        ``start_by_s``: the latest start that still meets the job's SLO, for a peer whose API can
        take a deadline and refuse at once what it cannot start in time."""

    def lost(self, settle_s: float) -> int:
        """Jobs it admitted that never ended, after waiting up to ``settle_s`` for the last to end."""

    def queue_rss(self) -> int:
        """Bytes of resident memory of its queueing side: every process but the one holding the model."""

    def stop(self) -> None:
        """Stop every process it started."""


def process_tree_rss(pid: int) -> int:
    """Resident bytes of a process and its descendants (VmRSS of each, from /proc)."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except OSError:
            continue
        total += next((int(line.split()[1]) * 1024 for line in status.splitlines()
                       if line.startswith("VmRSS:")), 0)
        pending += [int(child) for child in children]
    return total
