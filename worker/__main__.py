"""``python -m worker``: run one single-slot GPU worker (what ``slotq worker`` runs)."""

from __future__ import annotations

import argparse

from shared.contract.settings import load_settings
from worker.main import run_worker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slotq worker", description="run one single-slot GPU worker")
    parser.add_argument("--burst", action="store_true", help="quit when the queue is empty")
    args = parser.parse_args(argv)
    return run_worker(load_settings(), burst=args.burst)


if __name__ == "__main__":
    raise SystemExit(main())
