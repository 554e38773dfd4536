"""The wire form of one target hidden state: int8 values and one float32 scale per vector.

``quantize_feature`` is what the verifier sends and ``dequantize_feature`` what the edge
feeds its feature-conditioned draft (``edge_client.feature_draft``); the head is trained on
exactly this round trip (``edge_client.tools.distill.head_model.fake_int8``). Symmetric
absmax: scale = max |f| / 127, values round(f / scale) (ties to even) in [-127, 127]. About
H + 4 bytes per feature (580 for hidden 576) instead of 4 H.
"""

from __future__ import annotations

import numpy as np

INT8_MAX = 127


def quantize_feature(feature: np.ndarray) -> tuple[np.ndarray, float]:
    """f [H] float -> (int8 [H], scale > 0). An all-zero f gets scale 1."""
    f = np.asarray(feature, dtype=np.float32)
    if f.ndim != 1 or f.size == 0:
        raise ValueError(f"a feature is one non-empty vector [H], got shape {f.shape}")
    if not np.isfinite(f).all():
        raise ValueError("feature has non-finite values")
    top = np.abs(f).max()  # float32 arithmetic throughout, as the torch twin does
    scale = top / np.float32(INT8_MAX) if top > 0 else np.float32(1.0)
    q = np.clip(np.round(f / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, float(scale)


def dequantize_feature(values: np.ndarray, scale: float) -> np.ndarray:
    """(int8 [H], scale) -> f [H] float32."""
    q = np.asarray(values)
    if q.dtype != np.int8 or q.ndim != 1 or q.size == 0:
        raise ValueError(f"feature values must be int8 [H], got {q.dtype} {q.shape}")
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"feature scale must be finite and > 0, got {scale!r}")
    return q.astype(np.float32) * np.float32(scale)
