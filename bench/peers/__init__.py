"""``python -m bench.peers``: slotq beside Ray Serve and a Celery worker, on one pipeline and one trace."""
