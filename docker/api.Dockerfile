# slotq HTTP API: Flask under gunicorn. CPU-only, deliberately without torch.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Fixed uid so volume/file ownership is predictable across rebuilds.
# /var/lib/slotq/results (the file result store) owned by the runtime user: Docker copies this
# ownership into a fresh named volume.
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin slotq \
    && mkdir -p /var/lib/slotq/results && chown -R slotq:slotq /var/lib/slotq

# Only packaging metadata and the packages enter the build context of this layer, so
# edits to tests, docs or compose files do not invalidate the pip install layer.
# README* is optional (an empty wildcard match is allowed).
WORKDIR /src
COPY pyproject.toml README* ./
COPY api/ api/
COPY shared/ shared/
COPY worker/ worker/
COPY slotq/ slotq/
# Only the `api` extra: no torch/diffusers in this image. The source tree is removed
# afterwards; the package runs from site-packages.
RUN pip install --no-cache-dir ".[api]" && rm -rf /src

WORKDIR /app
USER slotq
EXPOSE 8000

# Liveness only (/readyz depends on Redis; an API that cannot reach Redis should not be
# restarted for it). python instead of curl, which the slim image does not have.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]

# Exec form: gunicorn is PID 1 and receives SIGTERM directly for a graceful stop.
CMD ["slotq", "api", "--host", "0.0.0.0", "--port", "8000"]
