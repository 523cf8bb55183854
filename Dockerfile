# syntax=docker/dockerfile:1
# kvalloc: one allocator per GPU. Build from the repository root:
#   docker build -t kvalloc:0.1.0 .
#   docker build -t kvalloc:cpu --build-arg BASE_IMAGE=python:3.12-slim .   # no GPU
#   docker build -t kvalloc:0.1.0-worker --build-arg KVALLOC_EXTRAS='[worker]' .  # + kvalloc worker
# The default base is a CUDA runtime image that already ships torch (and Triton), so the image
# adds only kvalloc and its small pure-Python dependencies on top. It is the stack the GPU tests
# run on: torch 2.11 built for CUDA 13.0, with its Triton 3.6.
#
# The default command listens on all interfaces, so it needs KVALLOC_TOKEN: without it the
# service refuses to start (exit 2) rather than serve tokenless.
#   docker run -e KVALLOC_TOKEN="$(openssl rand -hex 32)" ... kvalloc:0.1.0
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime

# Build stage: only the kvalloc wheel; its dependencies resolve in the runtime stage, where the
# base's torch already satisfies torch>=2.4 and is not downloaded again.
FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvalloc kvalloc
COPY allocator allocator
COPY server server
COPY worker worker
RUN python -m pip wheel --no-deps --no-cache-dir --wheel-dir /wheels .

FROM ${BASE_IMAGE}
# A base without torch (python:*-slim for CPU) gets the CPU build; a CUDA base keeps its own.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN python -c "import torch" 2>/dev/null \
    || python -m pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch
# KVALLOC_EXTRAS='[worker]' adds what `kvalloc worker` needs (transformers); the default image
# serves, and runs loadgen and simulate, without it.
ARG KVALLOC_EXTRAS=""
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir "kvalloc${KVALLOC_EXTRAS} @ file://$(echo /wheels/kvalloc-*.whl)"
# Non-root; /run/kvalloc holds the REST and stream sockets shared with same-host workers.
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin kvalloc \
    && install -d -o kvalloc -g kvalloc -m 0750 /run/kvalloc
USER kvalloc
# Triton writes its compiled kernels to ~/.triton unless told, and this user has no home (and a
# read-only root in Kubernetes): /tmp is writable here, and an emptyDir there.
ENV PYTHONUNBUFFERED=1 \
    TRITON_CACHE_DIR=/tmp/kvalloc-triton-cache
EXPOSE 8900
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8900/healthz', timeout=2)"]
ENTRYPOINT ["kvalloc"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8900", "--ipc", "stream:///run/kvalloc/kvalloc.stream"]
