"""Verifier microbenchmarks, offline tools that time the target on this machine (torch).

    python -m cloud_verifier.bench.verify_cost   # verify K drafts vs decode one, per batch
    python -m cloud_verifier.bench.layout        # packed vs padded vs sequential batching
    python -m cloud_verifier.bench.prefix_cache  # time to first token, prefix cache on/off

The verifier's runtime never imports this package.
"""
