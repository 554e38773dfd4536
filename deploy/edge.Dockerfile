# The edge client: slim, the `edge` extra only (onnxruntime, numpy, tokenizers, grpcio).
#   docker build -f deploy/edge.Dockerfile -t edgespec-edge .
#   docker run edgespec-edge generate --server verifier:50051 --prompt "Hello"
# The distilled default draft ships inside the package (edge_client/drafts).
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY cloud_verifier cloud_verifier
COPY edge_client edge_client
RUN pip install ".[edge]" \
    && python -c "import edge_client.client, sys; assert 'torch' not in sys.modules"

ENTRYPOINT ["edge-client"]
