"""``python -m api``: serve the HTTP API (what ``slotq api`` runs)."""

from __future__ import annotations

import argparse

from api.server import serve
from shared.contract.settings import load_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slotq api", description="serve the HTTP API (gunicorn)")
    parser.add_argument("--host", help="address to bind (default: SLOTQ_API_HOST)")
    parser.add_argument("--port", type=int, help="port to bind (default: SLOTQ_API_PORT)")
    args = parser.parse_args(argv)
    serve(args.host, args.port, load_settings())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
