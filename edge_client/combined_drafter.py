"""Choosing the drafter of a generation: the ONNX model, prompt lookup, both combined, or
the feature head fed by the verifier's target features (edge_client.feature_drafter).

``combined`` chooses per position: where the text so far ends in two or more tokens that
occurred earlier, it proposes the token that followed them (``ContextLookup``), and asks the
model everywhere else (``ModelDrafter`` with a lookup). Copies win where text repeats (names,
list scaffolding, code, the prompt's own words); a single repeated token is left to the model,
which beats the lookup there two to one (docs/benchmarks.md "Combined drafting"). Each choice
depends on the context alone, so both greedy identity and the sampling law hold.
``ngram`` alone copies whole rounds, as point masses with no q on the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, ModelDrafter, Proposal
from edge_client.feature_draft import FeatureHead
from edge_client.feature_drafter import FeatureDrafter, LatestFeature
from edge_client.ngram_drafter import ContextLookup, NgramDrafter

FEATURE = "feature"  # edge_client.feature_drafter: needs a head and the verifier's features
DRAFTER_KINDS = ("model", "ngram", "combined", FEATURE)


class Drafter(Protocol):
    def resync(self, committed: list[int]) -> int: ...

    def propose(self, committed: list[int], k: int) -> Proposal: ...


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
        return ModelDrafter(model, sampling, rng, lookup=ContextLookup())
    raise ValueError(f"unknown drafter {kind!r}; choose one of {', '.join(DRAFTER_KINDS)}")
