"""The round logic of one speculative generation, free of I/O: which K to draft, the
OpenSession / Verify requests to send, and how a RoundResult is applied to the committed
tokens. Both the sync client (edge_client.client) and the simulated fleet
(edge_client.fleet) drive generations through it, so there is one implementation of the
protocol's client side.

Round numbers: a session's rounds are 0, 1, 2, ...; round 0 rides on OpenSession as its
first draft. After an eviction (NOT_FOUND, "evicted") the generation reopens: a new session
whose prompt is the full committed context, with the same sampling parameters and seed,
max_new_tokens = what remains, the same stop ids, and the pending draft as its first draft.
Its rounds start again at 0. The server's randomness depends only on (seed, committed
length), so a reopened generation commits exactly what the evicted one would have.
"""

from __future__ import annotations

from dataclasses import dataclass

from edge_client.drafter import Proposal
from edge_client.rate_chooser import CONTINUE, RateChooser
from shared.draft_length import worth_verifying
from shared.pb import verifier_pb2 as pb


class ProtocolError(RuntimeError):
    """The verifier's reply is inconsistent with the request."""


@dataclass(frozen=True)
class SessionParams:
    """What a session is opened with; the same on every reopen."""

    max_new_tokens: int
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()  # empty: the verifier's eos tokens
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")


@dataclass(frozen=True)
class ServerLimits:
    vocab_size: int
    max_draft_len: int
    max_context: int

    @classmethod
    def from_info(cls, info: pb.GetInfoResponse) -> ServerLimits:
        return cls(info.vocab_size, info.max_draft_len, info.max_context)


def draft_to_pb(proposal: Proposal, confidence: bool = True) -> pb.Draft:
    """The wire form; ``confidence=False`` leaves out the confidences (a Verify round is
    already cut by them on the client, and the verifier uses them only on lookaheads)."""
    draft = pb.Draft(token_ids=proposal.tokens,
                     confidence=(proposal.confidence or ()) if confidence else ())
    for ids, probs in proposal.q or ():
        draft.q.add(token_ids=ids.tolist(), probs=probs.tolist())
    return draft


# The proposal a K = 0 round (a Continue stream's results) is applied with.
NO_DRAFTS = Proposal([], None)


class GenerationRounds:
    """The committed tokens of one generation and the protocol state around them."""

    def __init__(self, prompt_ids: list[int], params: SessionParams, limits: ServerLimits,
                 draft_len: int, follow_suggestion: bool = True,
                 chooser: RateChooser | None = None) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if draft_len < 0:
            raise ValueError("draft_len must be >= 0")
        self.params = params
        self.limits = limits
        self.draft_len = draft_len
        # The server's suggestion depends on its load, so following it makes sampled outputs
        # depend on load too (still exact in distribution); off keeps them a function of
        # the seed alone.
        self.follow_suggestion = follow_suggestion
        # Picks drafting or Continue by measured rate (edge_client.rate_chooser); None: draft
        # whenever K > 0.
        self.chooser = chooser
        self.prompt_len = len(prompt_ids)
        self.committed = list(prompt_ids)  # prompt + generated
        self.round_no = 0  # the number of the next round of the current session
        self.suggested: int | None = None  # the last reply's suggested_draft_len
        self.token_cost: float | None = None  # the last reply's draft_token_cost
        # Whether the drafts carry confidences: then the server's draft_token_cost, not its
        # suggested_draft_len, decides how many are sent (``worth_sending``).
        self.confident = False
        self.finished = False
        self.reopens = 0

    @property
    def generated(self) -> list[int]:
        return self.committed[self.prompt_len:]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - (len(self.committed) - self.prompt_len)

    def next_k(self) -> int:
        """K for the next round: ours, capped by the server's suggestion and the room left."""
        k = self.draft_len
        if self.follow_suggestion and self.suggested is not None and not self.cut_by_cost:
            k = min(k, self.suggested)
        room = self.limits.max_context - len(self.committed) - 1
        return max(0, min(k, self.limits.max_draft_len, self.remaining - 1, room))

    @property
    def cut_by_cost(self) -> bool:
        return self.follow_suggestion and self.confident and self.token_cost is not None

    def worth_sending(self, proposal: Proposal) -> Proposal:
        """The drafts of ``proposal`` to send in a round: with confidences and the server's
        draft_token_cost, the prefix worth verifying (shared.draft_length), else all."""
        self.confident = proposal.confidence is not None
        if not self.cut_by_cost:
            return proposal
        return proposal.prefix(worth_verifying(proposal.confidence, self.token_cost))

    def open_request(self, proposal: Proposal) -> pb.OpenSessionRequest:
        """Opens (or reopens) a session over everything committed so far."""
        p = self.params
        self.round_no = 0
        self.confident = proposal.confidence is not None
        return pb.OpenSessionRequest(
            prompt_token_ids=self.committed,
            sampling=pb.SamplingParams(temperature=p.temperature, top_k=p.top_k,
                                       top_p=p.top_p, seed=p.seed),
            max_new_tokens=self.remaining, stop_token_ids=list(p.stop_token_ids),
            ignore_eos=p.ignore_eos, first_draft=draft_to_pb(proposal))

    def reopen_request(self, proposal: Proposal) -> pb.OpenSessionRequest:
        """After an eviction: the same generation on a new session, nothing lost."""
        self.reopens += 1
        return self.open_request(proposal)

    def verify_request(self, session_id: str, proposal: Proposal) -> pb.VerifyRequest:
        return pb.VerifyRequest(session_id=session_id, round=self.round_no,
                                draft=draft_to_pb(proposal, confidence=False))

    def wants_continue(self) -> bool:
        """Whether the next tokens should come from a Continue stream rather than a drafted
        round: when K is 0 (the server's suggestion, our draft_len, or the room left), or
        when the chooser finds it faster. Call once per decision."""
        if self.next_k() == 0:
            return True
        return self.chooser is not None and self.chooser.choose() == CONTINUE

    def continue_request(self, session_id: str) -> pb.ContinueRequest:
        """After ``wants_continue()``: the server decodes in the session, no round trip per
        token; each streamed RoundResult is applied with ``NO_DRAFTS``."""
        if self.next_k() == 0:  # until drafting pays again (if we draft at all)
            return pb.ContinueRequest(
                session_id=session_id, round=self.round_no, max_tokens=self.remaining,
                stop_when_drafting_pays=self.follow_suggestion and self.draft_len > 0)
        assert self.chooser is not None
        return pb.ContinueRequest(session_id=session_id, round=self.round_no,
                                  max_tokens=min(self.remaining,
                                                 self.chooser.continue_tokens()))

    def observe(self, mode: str, tokens: int, seconds: float) -> None:
        """Feeds the chooser: ``tokens`` delivered by a drafted round (SPEC) or a Continue
        stream (CONTINUE) in ``seconds``, request to last reply."""
        if self.chooser is not None:
            self.chooser.observe(mode, tokens, seconds)

    def lookahead_len(self, opening: bool = False) -> int:
        """Drafts for a Lookahead stream's next lookahead: 2K + 1 for the round's K (the
        server takes K a forward; the rest covers what it commits while the lookahead is on
        its way), or K when it opens the session (its first round verifies them at once).
        With confidences, K is our draft_len whatever the suggestion."""
        k = self.next_k()
        room = min(self.limits.max_draft_len, self.remaining - 1,
                   self.limits.max_context - len(self.committed) - 1)
        return max(0, min(k if opening else 2 * k + 1, room))

    def lookahead_request(self, proposal: Proposal) -> pb.LookaheadRequest:
        """A lookahead goes whole: the server cuts what it verifies by its confidences."""
        self.confident = proposal.confidence is not None
        return pb.LookaheadRequest(lookahead=pb.LookaheadDraft(
            base_length=len(self.committed), draft=draft_to_pb(proposal)))

    def apply_step(self, step: pb.LookaheadStep) -> list[int]:
        """Commits what one forward of a Lookahead stream committed; returns those tokens."""
        if self.finished:
            raise ProtocolError("a step arrived after the generation finished")
        new = list(step.token_ids)
        if step.num_accepted > step.num_drafted \
                or any(not 0 <= t < self.limits.vocab_size for t in new):
            raise ProtocolError(f"step accepts {step.num_accepted} of {step.num_drafted} "
                                f"drafts and commits {new}")
        token_cost = _token_cost(step)
        self._commit(new, step.committed_length, step.finished)
        self.suggested = step.suggested_draft_len
        self.token_cost = token_cost
        return new

    def apply(self, proposal: Proposal, result: pb.RoundResult) -> list[int]:
        """Commits d_1..d_n + the next token (cut where the server says it finished);
        returns the new tokens."""
        if self.finished:
            raise ProtocolError("a round result arrived after the generation finished")
        k, n = len(proposal.tokens), result.num_accepted
        if result.round != self.round_no:
            raise ProtocolError(f"reply answers round {result.round}, the client sent round "
                                f"{self.round_no}")
        if n > k or not 0 <= result.next_token < self.limits.vocab_size:
            raise ProtocolError(f"reply accepts {n} of {k} drafts with next token "
                                f"{result.next_token}")
        token_cost = _token_cost(result)
        new = (proposal.tokens[:n] + [result.next_token])[:result.committed_length
                                                           - len(self.committed)]
        self._commit(new, result.committed_length, result.finished)
        self.round_no += 1
        self.suggested = (result.suggested_draft_len
                          if result.HasField("suggested_draft_len") else None)
        self.token_cost = token_cost
        return new

    def _commit(self, new: list[int], committed_length: int, finished: bool) -> None:
        if len(self.committed) + len(new) != committed_length or not new:
            raise ProtocolError(f"reply says committed length {committed_length}, "
                                f"the client has {len(self.committed)} + {len(new)}")
        self.committed.extend(new)
        if self.remaining < 0 or (self.remaining == 0 and not finished):
            raise ProtocolError(f"{len(self.generated)} tokens generated of "
                                f"{self.params.max_new_tokens} and the reply says finished="
                                f"{finished}")
        self.finished = finished


def _token_cost(reply) -> float | None:
    """A reply's draft_token_cost, checked (None when absent)."""
    if not reply.HasField("draft_token_cost"):
        return None
    cost = reply.draft_token_cost
    if not 0 <= cost < float("inf"):  # also false for NaN
        raise ProtocolError(f"draft_token_cost {cost} is not a finite cost >= 0")
    return cost
