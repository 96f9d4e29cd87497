# syntax=docker/dockerfile:1
# slotq GPU worker: one process, one job at a time, diffusers on CUDA.
# The base image already ships a CUDA build of torch on Python >= 3.11 (the project's
# floor); override with --build-arg BASE_IMAGE=... to follow a newer PyTorch/CUDA.
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
# Pin torch to the image's own CUDA build with a constraints file so that no dependency
# (diffusers, accelerate, ...) can make pip swap it for a different wheel; then assert
# the installed torch is still a CUDA build.
RUN python -c "from importlib.metadata import version; print('torch==' + version('torch'))" \
        > /tmp/torch-constraint.txt \
    && pip install --no-cache-dir --constraint /tmp/torch-constraint.txt ".[worker]" \
    && python -c "import torch; assert torch.version.cuda, 'CPU-only torch installed'" \
    && rm -rf /src /tmp/torch-constraint.txt

WORKDIR /home/slotq
USER slotq

# Exec form: the worker receives SIGTERM itself and finishes the running job before
# exiting (compose gives it stop_grace_period for that).
CMD ["slotq", "worker"]
