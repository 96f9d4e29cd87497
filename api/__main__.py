"""``python -m api``: serve the HTTP API (what ``slotq api`` runs)."""

from __future__ import annotations

import argparse
import os
import sys

from shared.contract.settings import load_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slotq api", description="serve the HTTP API (gunicorn)")
    parser.add_argument("--host", help="address to bind (default: SLOTQ_API_HOST)")
    parser.add_argument("--port", type=int, help="port to bind (default: SLOTQ_API_PORT)")
    args = parser.parse_args(argv)
    settings = load_settings()
    if settings.api_worker_class == "gevent" and not _patched():
        # gevent must patch the standard library before ssl is first imported, and loading the
        # settings has imported it (pydantic-settings imports asyncio): start again, patched first.
        arguments = sys.argv[1:] if argv is None else argv
        os.execv(sys.executable, [sys.executable, "-m", "api.patched", *arguments])
    from api.server import serve  # after the choice above: Flask and gunicorn import ssl too

    serve(args.host, args.port, settings)
    return 0


def _patched() -> bool:
    from gevent import monkey  # type: ignore[import-untyped]  # gevent ships no stubs

    return bool(monkey.is_module_patched("socket"))


if __name__ == "__main__":
    raise SystemExit(main())
