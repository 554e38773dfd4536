"""A simulated device's drafts: the product's drafter (``make_drafter``: the ONNX draft model,
with copies where the text repeats by default) in a worker thread, through the client core's
``model_proposer``, or the replay book with that drafter on a miss."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from edge_client.bench.fleet.replay import ReplayBook
from edge_client.bench.fleet.workload import Request
from edge_client.combined_drafter import make_drafter
from edge_client.core import GenerationStats, Propose, model_proposer
from edge_client.drafter import DraftSampling, Proposal
from edge_client.generation_state import NO_DRAFTS


class DraftSource:
    """Proposals for one device, with its replay hits and misses and its drafting time."""

    def __init__(self, kind: str, model_factory: Callable, sampling: DraftSampling,
                 book: ReplayBook | None, confidence: bool = True,
                 drafter: str = "combined") -> None:
        self.kind = kind
        self.drafter = drafter  # edge_client.combined_drafter.make_drafter's kind
        self.confidence = confidence
        self._model_factory = model_factory
        self.sampling = sampling
        self.book = book
        self.hits = 0
        self.misses = 0
        self.draft_s = 0.0  # the model's, over every request (GenerationStats.draft_s)

    def start(self, request: Request, rng: np.random.Generator,
              stats: GenerationStats) -> Propose:
        """The ``Propose`` of one request; the model's time goes to ``stats.draft_s``."""
        model: list[Propose] = []

        async def from_model(committed: list[int], k: int) -> Proposal:
            if not model:  # the first miss loads the model (shared by the devices)
                model.append(model_proposer(
                    make_drafter(self.drafter, self._model_factory(), self.sampling, rng),
                    stats))
            before = stats.draft_s
            try:
                return await model[0](committed, k)
            finally:
                self.draft_s += stats.draft_s - before

        async def lookup_or_draft(committed: list[int], k: int) -> Proposal:
            if self.book is None or k == 0:
                return await from_model(committed, k) if k else NO_DRAFTS
            proposal = self.book.lookup(request, committed, k)
            if proposal is not None:
                self.hits += 1
                return proposal
            self.misses += 1
            return await from_model(committed, k)

        async def propose(committed: list[int], k: int, spell=None) -> Proposal:
            # The fleet's workloads open no session that must spell given bytes.
            proposal = await lookup_or_draft(committed, k)
            return proposal if self.confidence else Proposal(proposal.tokens, proposal.q)

        return propose
