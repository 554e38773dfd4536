# syntax=docker/dockerfile:1
# The edge client: the base install plus the `edge` extra (onnxruntime, numpy, tokenizers,
# jinja2, grpcio) -- no torch. The distilled default draft ships inside the package
# (edge_client/drafts, package data).
#   docker build -f deploy/edge.Dockerfile -t edgespec-edge .
#   docker run --rm edgespec-edge generate --server gateway:8080 --prompt "Hello"
# Pin the base by digest in production: PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:...
# Python 3.11: the version CI tests and pyproject's requires-python floor.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG PIP_VERSION=26.3
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY deploy/constraints.txt deploy/
COPY shared shared
COPY cloud_verifier cloud_verifier
COPY edge_client edge_client
WORKDIR /
RUN pip install "pip==${PIP_VERSION}" \
    && pip install --constraint /src/deploy/constraints.txt "/src[edge]" \
    && python -c "import sys, edge_client.client, edge_client.cli; \
assert not {'torch', 'transformers'} & set(sys.modules), 'the edge imports torch'"

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/venv/bin:$PATH
COPY --from=build /opt/venv /opt/venv
RUN useradd --system --no-create-home --uid 10001 --user-group edgespec
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["edge-client"]
CMD ["--help"]
