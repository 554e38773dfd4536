"""The ``"feature"`` drafter: drafts from the latest target feature the verifier sent.

A generation that drafts with a feature head (``edge_client.feature_draft``) opens its
session with ``want_feature``; every Step then carries the target's hidden state that decided
its last committed token, and ``GenerationState`` keeps the latest one with its position m
(``LatestFeature``). Each proposal runs the head's chain over ``tail = committed[m:]``: one
token in rounds (the feature came with the last step), more when it is older (lookahead
drafts after steps it has not seen the feature of yet, a document edited after m, the
draft-only fallback drafting past it). The chain may hold at most the head's ``max_chain``
positions, so K shrinks to fit.

With no usable feature (the open, an edit that changed the text before m, a tail too long)
the proposal is empty: a round with no drafts, one plain target step that commits a token and
returns a fresh feature. That costs one forward's worth of drafts at those moments and needs
no other draft on the device; the q of every draft is the exact distribution the head
sampled it from (``FeatureHead.propose``), so verification stays lossless.

``feature_head_for`` checks the verifier's GetInfo against the head before anything runs: a
verifier that serves no features, or serves another target's (the weights fingerprint), or
in another wire form, is refused with ``IncompatibleVerifier``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.drafter import DraftSampling, Proposal
from edge_client.errors import IncompatibleVerifier
from edge_client.feature_draft import FeatureHead, FeatureSpec
from shared.feature_codec import EncodedFeature
from shared.pb import verifier_pb2 as pb


@dataclass(frozen=True)
class LatestFeature:
    """The target feature that decided committed[position]."""

    position: int
    feature: EncodedFeature


def verifier_spec(info: pb.GetInfoResponse, address: str) -> FeatureSpec:
    """The feature a verifier serves, from its GetInfo; IncompatibleVerifier if none."""
    if not info.HasField("feature"):
        raise IncompatibleVerifier(
            f"the verifier at {address} serves no target features (its GetInfo has no feature "
            "capability: an older verifier, or one started with --no-features); the feature "
            "drafter needs them: use drafter 'model', 'ngram' or 'combined'")
    cap = info.feature
    return FeatureSpec(cap.layer, cap.hidden_size, cap.codec, cap.target_fingerprint)


def feature_head_for(head_dir: str | Path, info: pb.GetInfoResponse, address: str,
                     intra_op_threads: int | None = None) -> FeatureHead:
    """The head at ``head_dir``, checked against the verifier's feature capability."""
    return FeatureHead(head_dir, verifier_spec(info, address), intra_op_threads)


class FeatureDrafter:
    """``combined_drafter.Drafter`` over a feature head and the generation's latest feature
    (``latest``: read at each proposal, on the thread that drafts, while the generation
    waits for the proposal)."""

    def __init__(self, head: FeatureHead, sampling: DraftSampling, rng: np.random.Generator,
                 latest: Callable[[], LatestFeature | None]) -> None:
        self.head = head
        self.sampling = sampling
        self.rng = rng
        self.latest = latest
        self.feature_rounds = 0  # proposals drafted from a feature
        self.featureless_rounds = 0  # proposals left empty: no usable feature

    def resync(self, committed: list[int]) -> int:
        """The head keeps no cache across proposals: nothing to resync."""
        return 0

    def propose(self, committed: list[int], k: int) -> Proposal:
        latest = self.latest()
        if k == 0:
            return self._nothing()
        if latest is None or latest.position >= len(committed):
            self.featureless_rounds += 1
            return self._nothing()
        tail = committed[latest.position:]
        k = min(k, self.head.max_chain - len(tail) + 1)
        if k < 1:
            self.featureless_rounds += 1
            return self._nothing()
        self.feature_rounds += 1
        return self.head.propose(latest.feature, tail, k, self.sampling, self.rng)

    def _nothing(self) -> Proposal:
        """No drafts, of the same kind as this drafter's (greedy ones carry confidences), so
        that a K = 0 round does not change how the client cuts the next ones."""
        return Proposal([], None, [] if self.sampling.is_greedy else None)
