"""Where prepared model assets live on disk.

Everything that `edgespec-prepare` builds goes under one cache directory, taken from
``EDGESPEC_CACHE`` or ``~/.cache/edgespec``; the default draft ships inside the package.
Nothing here downloads anything.
"""

from __future__ import annotations

import os
from pathlib import Path

TARGET_DIRNAME = "smollm2-135m-instruct"
DRAFT_DIRNAME = "draft-standin-onnx"
DRAFT_PT_DIRNAME = "draft-standin-pt"
# The distilled draft committed under edge_client/drafts (edgespec-distill; see its card).
SHIPPED_DRAFT = "smollm2-draft-v9"


def cache_dir() -> Path:
    return Path(os.environ.get("EDGESPEC_CACHE", Path.home() / ".cache" / "edgespec"))


def default_target_dir() -> Path:
    """The safetensors checkpoint converted once from the SmolLM2 GGUF file."""
    return cache_dir() / TARGET_DIRNAME


def default_draft_dir() -> Path:
    """The ONNX draft the edge client uses by default: the distilled draft shipped in the
    package (``edge_client/drafts``), so it needs no preparation.

    Resolved from this file's location (``shared`` and ``edge_client`` are installed side by
    side), so the cloud side finds the draft without importing ``edge_client``."""
    return Path(__file__).resolve().parent.parent / "edge_client" / "drafts" / SHIPPED_DRAFT


def standin_draft_dir() -> Path:
    """The untrained stand-in draft (the target's first layers) exported to ONNX by
    ``edgespec-prepare``: checks the export path on the real target."""
    return cache_dir() / DRAFT_DIRNAME


def standin_draft_pt_dir() -> Path:
    """The stand-in's weights as a PyTorch checkpoint (for assisted-generation baselines)."""
    return cache_dir() / DRAFT_PT_DIRNAME


def draft_twin_dir(draft_dir: Path) -> Path:
    """A distilled draft's full-vocabulary PyTorch twin, written by ``edgespec-distill
    export`` beside the cache (for the assisted-generation case of ``edgespec-bench e2e``)."""
    return cache_dir() / f"{Path(draft_dir).name}-pt"
