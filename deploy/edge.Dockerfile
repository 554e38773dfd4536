# The edge client: the base install plus the `edge` extra (onnxruntime, numpy, tokenizers,
# jinja2, grpcio) -- no torch. The distilled default draft ships inside the package
# (edge_client/drafts, package data).
#   docker build -f deploy/edge.Dockerfile -t edgespec-edge .
#   docker run --rm edgespec-edge generate --server verifier:50051 --prompt "Hello"
# Python 3.11: the version CI tests and pyproject's requires-python floor.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared shared
COPY cloud_verifier cloud_verifier
COPY edge_client edge_client
RUN pip install --upgrade pip \
    && pip install ".[edge]" \
    && cd / && python -c "import sys, edge_client.client, edge_client.cli; \
assert not {'torch', 'transformers'} & set(sys.modules), 'the edge imports torch'"

FROM ${PYTHON_IMAGE}
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 PATH=/opt/venv/bin:$PATH
COPY --from=build /opt/venv /opt/venv
RUN useradd --system --create-home --uid 10001 edgespec
USER edgespec
WORKDIR /home/edgespec
ENTRYPOINT ["edge-client"]
CMD ["--help"]
