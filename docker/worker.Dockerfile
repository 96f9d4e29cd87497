# slotq GPU worker: one process, one job at a time, diffusers on CUDA.
# The base image ships torch on Python >= 3.11 (the project's floor): PyTorch's own CUDA image by
# default, which runs on a CPU host too (docker-compose.cpu.yml). Override with
# --build-arg BASE_IMAGE=... to follow a newer PyTorch/CUDA, or for any image with torch in it.
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# Hub weights (HF_HOME) and the generated tiny model live on the `models` volume.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models \
    SLOTQ_CACHE_DIR=/models/slotq

# /models and /var/lib/slotq/results are created and owned by the runtime user here: Docker
# copies this ownership into a fresh named volume, so the non-root worker can write its model
# cache and its results.
# A C compiler: torch.compile's Triton builds its launchers with one (SLOTQ_COMPILE, docs/compile.md),
# and the runtime image has none.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin slotq \
    && mkdir -p /models/slotq /var/lib/slotq/results \
    && chown -R slotq:slotq /models /var/lib/slotq

WORKDIR /src
COPY pyproject.toml README* ./
COPY api/ api/
COPY shared/ shared/
COPY worker/ worker/
COPY slotq/ slotq/
# Pin torch to the base image's own build with a constraints file so that no dependency
# (diffusers, accelerate, ...) can make pip swap it for another wheel (a CUDA build for a CPU-only
# one, say); then assert that the torch installed is still the base's, CUDA version and all.
RUN python -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
        > /tmp/torch-constraint.txt \
    && python -c "import torch; print(torch.__version__, torch.version.cuda)" > /tmp/torch-before.txt \
    && pip install --no-cache-dir --constraint /tmp/torch-constraint.txt ".[worker]" \
    && python -c "import torch; print(torch.__version__, torch.version.cuda)" \
        | cmp - /tmp/torch-before.txt \
    && rm -rf /src /tmp/torch-constraint.txt /tmp/torch-before.txt

WORKDIR /home/slotq
USER slotq
EXPOSE 9101

# Healthy once the model is loaded and Redis and the result store answer: the worker serves
# /readyz beside its metrics (SLOTQ_WORKER_METRICS_PORT) only after its model's load and warm-up.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('SLOTQ_WORKER_METRICS_PORT', '9101'), timeout=4)"]

# Exec form: the worker receives SIGTERM itself and finishes the running job before
# exiting (compose gives it stop_grace_period for that).
CMD ["slotq", "worker"]
