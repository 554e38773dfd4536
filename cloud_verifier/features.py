"""Serving target features: what GetInfo advertises, and the wire form of each captured one.

A session opened with ``want_feature`` gets, in each Step, the target's hidden state after
its final norm (what its LM head reads) at the position that decided its last committed
token, encoded by ``shared.feature_codec`` (docs/feature-draft.md). The engine captures the
rows in its packed forward (``cloud_verifier.engine``); this module says whether the target
can serve them and computes, once at startup, the weights fingerprint that lets an edge head
tell this target from any other fine-tune (``shared.fingerprint``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from shared.feature_codec import EncodedFeature, FeatureCodec, codec_named
from shared.fingerprint import fingerprint_tensor_names, weights_fingerprint
from shared.message_limits import MAX_FEATURE_HIDDEN
from shared.pb import verifier_pb2 as pb

log = logging.getLogger(__name__)

FEATURE_LAYER = "final_norm"


@dataclass(frozen=True)
class FeatureServing:
    """The features one verifier serves."""

    hidden_size: int
    codec: FeatureCodec
    target_fingerprint: str
    layer: str = FEATURE_LAYER

    def capability_pb(self) -> pb.FeatureCapability:
        return pb.FeatureCapability(layer=self.layer, hidden_size=self.hidden_size,
                                    codec=self.codec.name, group_size=self.codec.group,
                                    target_fingerprint=self.target_fingerprint)

    def encode(self, rows: np.ndarray) -> list[EncodedFeature]:
        """[n, H] float32 hidden states -> their wire forms."""
        return [self.codec.encode(row) for row in rows]


def feature_serving(model, codec_name: str, packed: bool) -> FeatureServing | None:
    """What ``model`` can serve with ``codec_name``, or None (logged) when it cannot: the
    capture lives in the packed forward (``packed``: Llama-family) and the fingerprint reads
    Llama tensor names. Computes the fingerprint (about 0.3 s for SmolLM2): call once."""
    codec = codec_named(codec_name)
    hidden = int(model.config.hidden_size)
    if not packed:
        log.warning("%s is not Llama-family: serving no target features",
                    type(model).__name__)
        return None
    if hidden > MAX_FEATURE_HIDDEN:
        log.warning("hidden size %d is above the protocol's %d: serving no target features",
                    hidden, MAX_FEATURE_HIDDEN)
        return None
    codec.check_hidden(hidden)
    layers = int(model.config.num_hidden_layers)
    state = model.state_dict()
    names = fingerprint_tensor_names(layers)
    tensors = {n: state[n].detach().float().cpu().numpy() for n in names}
    return FeatureServing(hidden, codec, weights_fingerprint(tensors, layers))
