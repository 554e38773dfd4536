"""The wire form of one target hidden state (a "feature"), numpy only, pure.

The verifier encodes the target's final-norm hidden state f [H] with ``FeatureCodec.encode``
and sends (values, scales) in a Step; the edge decodes it for its feature-conditioned draft
(``edge_client.feature_draft``), and training feeds its head exactly ``round_trip`` of the
true features (``edge_client.tools.distill.head_model.wire_round_trip``), so that the head
learns on what it will be fed.

Two codecs, by name (``GetInfo``'s feature capability and a head's ``feature_head.json`` both
carry it):

- ``fp16``: IEEE half precision, little-endian, no scales: 2 H bytes (1152 for hidden 576).
  What the verifier serves: SmolLM2's final hidden state has outlier dimensions (median |f|
  0.84, max about 20), and on 720 real positions no int8 form kept the target's own argmax
  (f times its LM head) at 99% of them, fp16 kept it at all (docs/feature-draft.md).
- ``int8-g<G>``: symmetric absmax per group of G consecutive values: scale_g = max |f_g| / 127
  (float32 arithmetic, then stored as float32), values round(f / scale_g) (ties to even) in
  [-127, 127]; an all-zero group gets scale 1. H + 4 H / G bytes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

INT8_MAX = 127
FP16 = "fp16"
_INT8_GROUPED = re.compile(r"^int8-g([1-9][0-9]*)$")


@dataclass(frozen=True)
class EncodedFeature:
    values: bytes  # fp16: 2 H bytes; int8: H bytes
    scales: tuple[float, ...]  # int8: one per group; fp16: none


@dataclass(frozen=True)
class FeatureCodec:
    name: str
    group: int  # values per scale; 0 for fp16 (no scales)

    def nbytes(self, hidden: int) -> int:
        """Payload bytes of one feature (values and scales as float32)."""
        if self.group == 0:
            return 2 * hidden
        return hidden + 4 * (hidden // self.group)

    def check_hidden(self, hidden: int) -> None:
        if hidden < 1 or (self.group and hidden % self.group):
            raise ValueError(f"codec {self.name} needs a hidden size that is a positive "
                             f"multiple of {self.group or 1}, got {hidden}")

    def encode(self, feature: np.ndarray) -> EncodedFeature:
        """f [H] float -> its wire form."""
        f = np.asarray(feature, dtype=np.float32)
        if f.ndim != 1 or f.size == 0:
            raise ValueError(f"a feature is one non-empty vector [H], got shape {f.shape}")
        if not np.isfinite(f).all():
            raise ValueError("feature has non-finite values")
        self.check_hidden(f.size)
        if self.group == 0:
            return EncodedFeature(f.astype("<f2").tobytes(), ())
        q, scales = self._quantize(f)
        return EncodedFeature(q.tobytes(), tuple(float(s) for s in scales))

    def decode(self, values: bytes, scales, hidden: int) -> np.ndarray:
        """The wire form of a feature of ``hidden`` values -> f [H] float32. ValueError when
        the sizes do not match the codec (a peer that encodes otherwise)."""
        self.check_hidden(hidden)
        scales = np.asarray(scales, dtype=np.float32)
        if self.group == 0:
            if len(values) != 2 * hidden or scales.size:
                raise ValueError(f"an {self.name} feature of {hidden} values is {2 * hidden} "
                                 f"bytes and no scales, got {len(values)} bytes and "
                                 f"{scales.size} scales")
            return np.frombuffer(values, dtype="<f2").astype(np.float32)
        groups = hidden // self.group
        if len(values) != hidden or scales.shape != (groups,):
            raise ValueError(f"an {self.name} feature of {hidden} values is {hidden} bytes and "
                             f"{groups} scales, got {len(values)} bytes and {scales.size}")
        if not (np.isfinite(scales).all() and (scales > 0).all()):
            raise ValueError("feature scales must be finite and > 0")
        q = np.frombuffer(values, dtype=np.int8).astype(np.float32).reshape(groups, self.group)
        return (q * scales[:, None]).reshape(hidden)

    def round_trip(self, features: np.ndarray) -> np.ndarray:
        """decode(encode(f)) for every vector of ``features`` [..., H], vectorized: what
        training feeds the head."""
        f = np.asarray(features, dtype=np.float32)
        self.check_hidden(f.shape[-1])
        if self.group == 0:
            return f.astype(np.float16).astype(np.float32)
        q, scales = self._quantize(f)
        return (q.astype(np.float32).reshape(*scales.shape, self.group)
                * scales[..., None]).reshape(f.shape)

    def _quantize(self, f: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """f [..., H] float32 -> (int8 [..., H], scales float32 [..., H / G])."""
        x = f.reshape(*f.shape[:-1], f.shape[-1] // self.group, self.group)
        top = np.abs(x).max(-1)
        scales = np.where(top > 0, top / np.float32(INT8_MAX), np.float32(1)).astype(np.float32)
        q = np.clip(np.round(x / scales[..., None]), -INT8_MAX, INT8_MAX).astype(np.int8)
        return q.reshape(f.shape), scales


def codec_named(name: str) -> FeatureCodec:
    """The codec called ``name`` (``fp16``, ``int8-g<G>``); ValueError for any other."""
    if name == FP16:
        return FeatureCodec(FP16, 0)
    m = _INT8_GROUPED.match(name)
    if m is None:
        raise ValueError(f"unknown feature codec {name!r}; use {FP16} or int8-g<G> "
                         "(e.g. int8-g32)")
    return FeatureCodec(name, int(m.group(1)))


DEFAULT_CODEC = FP16
