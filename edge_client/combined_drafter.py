"""Choosing the drafter of a generation: the ONNX model, prompt lookup, both combined, or
the feature head fed by the verifier's target features (edge_client.feature_drafter).

``CombinedDrafter`` proposes the n-gram continuation when the context has one and asks the
model otherwise. Each round's drafts come from one drafter only, so a Draft message never
mixes point masses with sparse q: an n-gram round sends no q at all (an empty ``Draft.q``
means point masses to the verifier), a model round in sampling mode sends one sparse q per
draft. Both are lossless; the empty q also keeps the n-gram rounds' payload to the ids alone.

The model drafter is not fed during n-gram rounds. Its ``resync`` crops its cache to the
prefix it shares with whatever was committed since and feeds the missing tokens in one
forward, so its cache is right whichever drafter proposed the rounds before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, ModelDrafter, Proposal
from edge_client.feature_draft import FeatureHead
from edge_client.feature_drafter import FeatureDrafter, LatestFeature
from edge_client.ngram_drafter import NgramDrafter

FEATURE = "feature"  # edge_client.feature_drafter: needs a head and the verifier's features
DRAFTER_KINDS = ("model", "ngram", "combined", FEATURE)


class Drafter(Protocol):
    def resync(self, committed: list[int]) -> int: ...

    def propose(self, committed: list[int], k: int) -> Proposal: ...


class CombinedDrafter:
    def __init__(self, model: ModelDrafter, ngram: NgramDrafter) -> None:
        self.model = model
        self.ngram = ngram
        self.ngram_rounds = 0
        self.model_rounds = 0

    def resync(self, committed: list[int]) -> int:
        return self.model.resync(committed)

    def propose(self, committed: list[int], k: int) -> Proposal:
        proposal = self.ngram.propose(committed, k)
        if proposal.tokens:
            self.ngram_rounds += 1
            return proposal
        self.model_rounds += 1
        return self.model.propose(committed, k)


def make_drafter(kind: str, model: OnnxDraftModel, sampling: DraftSampling,
                 rng: np.random.Generator, head: FeatureHead | None = None,
                 latest: Callable[[], LatestFeature | None] | None = None) -> Drafter:
    """A fresh drafter of ``kind`` (one of DRAFTER_KINDS) for one generation; FEATURE needs
    the checked ``head`` and the generation state's latest feature (``latest``)."""
    if kind == FEATURE:
        if head is None or latest is None:
            raise ValueError("the feature drafter needs a feature head and the latest feature")
        return FeatureDrafter(head, sampling, rng, latest)
    if kind == "model":
        return ModelDrafter(model, sampling, rng)
    if kind == "ngram":
        return NgramDrafter()
    if kind == "combined":
        return CombinedDrafter(ModelDrafter(model, sampling, rng), NgramDrafter())
    raise ValueError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTER_KINDS)}")
