"""``python -m worker``: run one single-slot GPU worker (what ``slotq worker`` runs)."""

from __future__ import annotations

import argparse

from shared.contract.settings import load_settings
from worker import startup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slotq worker", description="run one single-slot GPU worker")
    parser.add_argument("--burst", action="store_true", help="quit when the queue is empty")
    args = parser.parse_args(argv)
    settings = load_settings()
    startup.prepare()
    from worker.main import run_worker  # torch and diffusers are imported here, after prepare

    return run_worker(settings, burst=args.burst)


if __name__ == "__main__":
    raise SystemExit(main())
