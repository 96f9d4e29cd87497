"""``python -m api.patched``: the API under gevent, the standard library patched before anything else
imports it; ``python -m api`` starts this when SLOTQ_API_WORKER_CLASS is gevent. gunicorn's gevent
workers patch again when they start, which is then a no-op instead of a warning about ssl."""

from gevent import monkey  # type: ignore[import-untyped]  # gevent ships no stubs

monkey.patch_all()

from api.__main__ import main  # noqa: E402  # after the patch, which is the point of this module

if __name__ == "__main__":
    raise SystemExit(main())
