"""The protocol state of one speculative generation, free of I/O: which K to draft, the
messages to send, and how each Step the verifier streams back is checked and committed.

The client core (edge_client.core) drives it for the app API and the simulated fleet alike.

Reopening: a session lives as long as its Session stream. When a stream is lost (the
verifier restarted, a network cut, an eviction), the generation reopens a new session whose
prompt is everything committed so far, with the same sampling parameters and seed,
``max_new_tokens`` = what remains, and, as its first draft, the draft that was in flight
(``pending``). The verifier's randomness at a position depends only on (seed, position), so
with the same drafts a reopened generation commits exactly what an undisturbed one would
have, greedy or sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from edge_client.drafter import Proposal, Spell
from edge_client.errors import EdgeError
from edge_client.feature_drafter import LatestFeature
from edge_client.rate_chooser import CONTINUE, RateChooser
from shared.draft_length import worth_verifying
from shared.feature_codec import EncodedFeature
from shared.pb import verifier_pb2 as pb
from shared.token_spelling import TokenSpelling

ROUNDS = "rounds"
LOOKAHEAD = "lookahead"
CLOUD = "cloud"  # no drafts: the verifier's Generate RPC, the cloud-only baseline
PROTOCOLS = (ROUNDS, LOOKAHEAD, CLOUD)
_DRAFTING = {ROUNDS: pb.DRAFTING_ROUNDS, LOOKAHEAD: pb.DRAFTING_LOOKAHEAD}


class ProtocolError(EdgeError):
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

    def sampling_pb(self) -> pb.SamplingParams:
        return pb.SamplingParams(temperature=self.temperature, top_k=self.top_k,
                                 top_p=self.top_p, seed=self.seed)


@dataclass(frozen=True)
class ServerLimits:
    vocab_size: int
    max_draft_len: int
    max_context: int
    max_q_support: int = 0  # 0: the verifier sets no cap

    @classmethod
    def from_info(cls, info: pb.GetInfoResponse) -> ServerLimits:
        return cls(info.vocab_size, info.max_draft_len, info.max_context, info.max_q_support)

    def q_support(self, wanted: int) -> int:
        """The support cap to draft with: ``wanted`` (0 = none), within the verifier's."""
        if self.max_q_support == 0:
            return wanted
        return self.max_q_support if wanted == 0 else min(wanted, self.max_q_support)


def draft_to_pb(proposal: Proposal, confidence: bool = True) -> pb.Draft:
    """The wire form; ``confidence=False`` leaves out the confidences (a Verify round is
    already cut by them on the client, and the verifier uses them only on lookaheads)."""
    draft = pb.Draft(token_ids=proposal.tokens,
                     confidence=(proposal.confidence or ()) if confidence else ())
    for ids, probs in proposal.q or ():
        draft.q.add(token_ids=ids.tolist(), probs=probs.tolist())
    return draft


# The proposal a K = 0 round (a Decode's steps) is applied with.
NO_DRAFTS = Proposal([], None)


class GenerationState:
    """The committed tokens of one generation and the protocol state around them."""

    def __init__(self, prompt_ids: list[int], params: SessionParams, limits: ServerLimits,
                 draft_len: int, protocol: str = ROUNDS, follow_suggestion: bool = False,
                 chooser: RateChooser | None = None, editable: bool = False,
                 want_feature: bool = False, spelling: TokenSpelling | None = None,
                 continue_with: bytes = b"") -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if draft_len < 0:
            raise ValueError("draft_len must be >= 0")
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}")
        if editable and protocol != ROUNDS:
            raise ValueError("an editable session needs the rounds protocol")
        self.params = params
        # An editing session (edge_client.document): one session, many suggestions. Each
        # ``edit`` starts the next suggestion; the edit travels with that suggestion's first
        # round (``pending_edit``), or, when the session must be (re)opened, is already part
        # of the text the open sends.
        self.editable = editable
        self.suggestion = 0
        self.pending_edit: pb.Edit | None = None
        # Draft-only fallback (edge_client.core): tokens the draft proposed after
        # ``committed`` while the verifier was away, shown as unverified. When it is back
        # they are sent first, as drafts, so the verifier verifies them (losslessly, with
        # their q); what it does not accept is replaced (``replaced``).
        self.unverified: Proposal | None = None
        self.replaced = 0
        self.limits = limits
        self.draft_len = draft_len
        self.protocol = protocol
        # The server's suggestion depends on its load, so following it makes sampled outputs
        # depend on load too (still exact in distribution); off keeps them a function of
        # the seed alone.
        self.follow_suggestion = follow_suggestion
        # Picks drafting or Decode by measured rate (edge_client.rate_chooser); None: draft
        # whenever K > 0.
        self.chooser = chooser
        self.prompt_len = len(prompt_ids)
        self.committed = list(prompt_ids)  # prompt + generated
        self.round_no = 0  # the number of the next round of the current session
        self.suggested: int | None = None  # the last step's suggested_draft_len
        self.token_cost: float | None = None  # the last step's draft_token_cost
        # Whether the drafts carry confidences: then the server's draft_token_cost, not its
        # suggested_draft_len, decides how many are sent (``worth_sending``).
        self.confident = False
        self.finished = False
        self.reopens = 0
        # The round sent and not yet answered: a reopen sends it again as its first draft.
        self.pending: Proposal | None = None
        # A feature drafter's session (edge_client.feature_drafter): every Step carries the
        # target feature of its last committed token; the latest one is kept while the text
        # before its position stays as it was.
        self.want_feature = want_feature
        self.feature: LatestFeature | None = None
        # Token healing (shared.token_spelling): the bytes the new tokens must still begin
        # with, advanced as they commit; sent with every open and edit.
        self.spelling = spelling
        self.continue_with = b""
        self._set_continue_with(continue_with)

    def _set_continue_with(self, value: bytes) -> None:
        if value and self.spelling is None:
            raise ValueError("continue_with needs the tokenizer's spelling table")
        if value and self.protocol != ROUNDS:
            raise ValueError("continue_with needs the rounds protocol")
        self.continue_with = bytes(value)

    def spell(self, after: list[int] = ()) -> Spell | None:
        """What the next drafts must spell, after ``after`` (tokens past the committed ones);
        None when nothing is left to spell."""
        if not self.continue_with:
            return None
        _, rest = self.spelling.advance_all(self.continue_with, after)
        return (self.spelling, rest) if rest else None

    def spellable(self, proposal: Proposal, after: list[int] = ()) -> Proposal:
        """The drafts of ``proposal`` (made after ``committed + after``) up to the first that
        cannot spell what is left: later ones could never be accepted."""
        spell = self.spell(after)
        if spell is None:
            return proposal
        n, _ = spell[0].advance_all(spell[1], proposal.tokens)
        return proposal if n == len(proposal.tokens) else proposal.prefix(n)

    @property
    def generated(self) -> list[int]:
        return self.committed[self.prompt_len:]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - (len(self.committed) - self.prompt_len)

    def _room(self) -> int:
        return min(self.limits.max_draft_len, self.remaining - 1,
                   self.limits.max_context - len(self.committed) - 1)

    def next_k(self) -> int:
        """K for the next round: ours, capped by the server's suggestion and the room left."""
        k = self.draft_len
        # With the server's cost, the drafts' confidences choose K (worth_sending), except
        # for a suggested 0: the drafts keep being rejected, however sure the draft is.
        if self.follow_suggestion and self.suggested is not None and (
                not self.cut_by_cost or self.suggested == 0):
            k = min(k, self.suggested)
        return max(0, min(k, self._room()))

    @property
    def cut_by_cost(self) -> bool:
        return self.follow_suggestion and self.confident and self.token_cost is not None

    def worth_sending(self, proposal: Proposal) -> Proposal:
        """The drafts of ``proposal`` to send in a round: with confidences and the server's
        draft_token_cost, the prefix worth verifying (shared.draft_length), else all."""
        self.confident = proposal.confidence is not None
        proposal = self.spellable(proposal)
        if not self.cut_by_cost:
            return proposal
        return proposal.prefix(worth_verifying(proposal.confidence, self.token_cost))

    # -- messages -------------------------------------------------------------------------

    def open_message(self, first: Proposal) -> pb.SessionRequest:
        """Opens (or reopens) a session over everything committed so far. Rounds: ``first``
        is round 0. Lookahead: it is the first lookahead, drafted after the committed text."""
        p = self.params
        self.round_no = 0
        self.suggestion = 0  # a new session: the open starts its suggestion 0
        self.pending_edit = None  # the open's prompt already is the edited text
        self.confident = first.confidence is not None
        rounds = self.protocol == ROUNDS
        if rounds:
            self.pending = first
        return pb.SessionRequest(open=pb.OpenSession(
            prompt_token_ids=self.committed, sampling=p.sampling_pb(),
            max_new_tokens=self.remaining, stop_token_ids=list(p.stop_token_ids),
            ignore_eos=p.ignore_eos, drafting=_DRAFTING[self.protocol],
            first_draft=draft_to_pb(first, confidence=not rounds), editable=self.editable,
            want_feature=self.want_feature, continue_with=self.continue_with))

    def reopen_first(self) -> Proposal | None:
        """The draft a reopen sends first: the unverified tokens drafted during an outage, or
        else the round in flight when the stream was lost, so that the output is what an
        undisturbed run commits. None: draft afresh."""
        if self.protocol != ROUNDS:
            return None
        return self.resync_proposal() or self.pending

    # -- draft-only fallback --------------------------------------------------------------

    @property
    def num_unverified(self) -> int:
        return 0 if self.unverified is None else len(self.unverified.tokens)

    def unverified_room(self) -> int:
        """How many more tokens the draft may propose alone."""
        return max(0, min(self.remaining,
                          self.limits.max_context - len(self.committed) - 1)
                   - self.num_unverified)

    def add_unverified(self, proposal: Proposal) -> None:
        """Appends drafts made after ``committed`` + the unverified tokens so far (up to the
        first that cannot spell what is left of ``continue_with``)."""
        proposal = self.spellable(proposal, [] if self.unverified is None
                                  else self.unverified.tokens)
        if not proposal.tokens:
            return
        u = self.unverified
        if u is None:
            self.unverified = proposal
            return
        both_q = u.q is not None and proposal.q is not None
        both_c = u.confidence is not None and proposal.confidence is not None
        if (u.q is None) != (proposal.q is None):
            raise ValueError("unverified drafts mix point-mass and sampled q")
        self.unverified = Proposal(u.tokens + proposal.tokens,
                                   u.q + proposal.q if both_q else None,
                                   u.confidence + proposal.confidence if both_c else None)

    def resync_proposal(self) -> Proposal | None:
        """The next round's drafts while unverified tokens wait: the first of them, as many
        as a round takes (None when there are none)."""
        if self.unverified is None:
            return None
        return self.unverified.prefix(max(0, self._room()))

    def _settle_unverified(self, new: list[int]) -> None:
        """After ``new`` was committed: unverified tokens it confirms are dropped from the
        buffer; from the first it contradicts on, all are replaced."""
        u = self.unverified
        if u is None:
            return
        same = 0
        while same < min(len(new), len(u.tokens)) and new[same] == u.tokens[same]:
            same += 1
        if same == len(new) and same < len(u.tokens):
            self.unverified = _suffix(u, same)
            return
        self.replaced += len(u.tokens) - same
        self.unverified = None

    def verify_message(self, proposal: Proposal) -> pb.SessionRequest:
        """The next round; the first of a suggestion carries its edit (kept until a step of
        the suggestion shows that the verifier has it)."""
        self.pending = proposal
        return pb.SessionRequest(verify=pb.VerifyRound(
            round=self.round_no, draft=draft_to_pb(proposal, confidence=False),
            edit=self.pending_edit))

    # -- editing sessions -----------------------------------------------------------------

    def edit(self, keep: int, append: list[int], max_new_tokens: int,
             continue_with: bytes = b"") -> None:
        """Starts the next suggestion over ``committed[:keep] + append``, at most
        ``max_new_tokens`` long, its text beginning with ``continue_with`` (token healing).
        Applied here at once; the verifier applies the same edit when the suggestion's first
        round reaches it, keeping its KV cache up to ``keep``."""
        if not self.editable:
            raise ValueError("not an editable session")
        if not 0 <= keep <= len(self.committed) or keep + len(append) < 1:
            raise ValueError(f"edit keeps {keep} of {len(self.committed)} tokens and appends "
                             f"{len(append)}: the text would be out of range or empty")
        if any(not 0 <= t < self.limits.vocab_size for t in append):
            raise ValueError("an appended token id is outside the vocabulary")
        self._set_continue_with(continue_with)
        self.params = replace(self.params, max_new_tokens=max_new_tokens)
        # Unverified tokens the user kept (typed or accepted) are now text; the rest of them
        # still waits to be verified, first, if the text did not change otherwise (and can
        # spell what the new text must continue with).
        u, self.unverified = self.unverified, None
        if u is not None and keep == len(self.committed) \
                and append == u.tokens[:len(append)] and len(append) < len(u.tokens):
            self.unverified = self.spellable(_suffix(u, len(append)))
            if not self.unverified.tokens:
                self.unverified = None
        self.committed[keep:] = append
        if self.feature is not None and self.feature.position > keep:
            self.feature = None  # it read text that is gone
        if self.pending_edit is not None:
            # The verifier may not have the last edit (it was cancelled on its way): this
            # one then replaces it, kept no further than it. Its kept tokens are the same
            # whether the verifier applied the last edit or not.
            keep = min(keep, self.pending_edit.keep_length)
            append = self.committed[keep:]
        self.prompt_len = len(self.committed)
        self.suggestion += 1
        self.round_no = 0
        self.finished = False
        self.pending = None
        self.pending_edit = pb.Edit(keep_length=keep, append_token_ids=append,
                                    suggestion=self.suggestion, max_new_tokens=max_new_tokens,
                                    continue_with=self.continue_with)

    def cancel_message(self) -> pb.SessionRequest:
        """Stops the suggestion in flight on the verifier; the next one starts with an edit."""
        self.pending = None
        return pb.SessionRequest(cancel=pb.CancelSuggestion(suggestion=self.suggestion))

    def is_stale(self, step: pb.Step) -> bool:
        """A step of a suggestion this client has moved on from (it was on its way when the
        edit or cancel left): dropped, never applied."""
        return self.editable and step.suggestion != self.suggestion

    def wants_decode(self) -> bool:
        """Whether the next tokens should come from cloud-side decoding rather than a drafted
        round: when K is 0 (the server's suggestion, our draft_len, or the room left), or
        when the chooser finds it faster. Call once per decision."""
        if self.next_k() == 0:
            return True
        return self.chooser is not None and self.chooser.choose() == CONTINUE

    def decode_message(self) -> pb.SessionRequest:
        """After ``wants_decode()``: the server decodes in the session, no round trip per
        token; each Step is applied with ``NO_DRAFTS``."""
        self.pending = NO_DRAFTS
        if self.next_k() == 0:  # until drafting pays again (if we draft at all)
            decode = pb.Decode(round=self.round_no, max_tokens=self.remaining,
                               stop_when_drafting_pays=self.follow_suggestion
                               and self.draft_len > 0)
        else:
            assert self.chooser is not None
            decode = pb.Decode(round=self.round_no,
                               max_tokens=min(self.remaining, self.chooser.continue_tokens()))
        return pb.SessionRequest(decode=decode)

    def observe(self, mode: str, tokens: int, seconds: float) -> None:
        """Feeds the chooser: ``tokens`` delivered by a drafted round (SPEC) or a Decode
        (CONTINUE) in ``seconds``, request to last reply."""
        if self.chooser is not None:
            self.chooser.observe(mode, tokens, seconds)

    def lookahead_len(self, opening: bool = False) -> int:
        """Drafts for the next lookahead: 2K + 1 for the round's K (the server takes K a
        forward; the rest covers what it commits while the lookahead is on its way), or K
        when it opens the session (its first forward verifies them at once)."""
        k = self.next_k()
        return max(0, min(k if opening else 2 * k + 1, self._room()))

    def lookahead_message(self, proposal: Proposal) -> pb.SessionRequest:
        """A lookahead goes whole: the server cuts what it verifies by its confidences."""
        self.confident = proposal.confidence is not None
        return pb.SessionRequest(lookahead=pb.LookaheadDraft(
            base_length=len(self.committed), draft=draft_to_pb(proposal)))

    # -- replies --------------------------------------------------------------------------

    def apply(self, step: pb.Step, proposal: Proposal | None = None) -> list[int]:
        """Checks and commits one Step; returns its new tokens. ``proposal``: the round's
        drafts (rounds mode; NO_DRAFTS for a Decode's steps); None for a lookahead or a
        Generate step, whose drafts the server picked."""
        if self.finished:
            raise ProtocolError("a step arrived after the generation finished")
        token_cost = _token_cost(step)  # every check before any state moves
        new = list(step.token_ids)
        n = step.num_accepted
        if n > step.num_drafted or any(not 0 <= t < self.limits.vocab_size for t in new) \
                or not new or len(new) > n + 1:
            raise ProtocolError(f"step accepts {n} of {step.num_drafted} drafts and commits "
                                f"{new}")
        if proposal is not None:
            if step.round != self.round_no:
                raise ProtocolError(f"step answers round {step.round}, the client is at "
                                    f"round {self.round_no}")
            if step.num_drafted != len(proposal.tokens) \
                    or new[:n] != proposal.tokens[:len(new)][:n]:
                raise ProtocolError(f"step accepts {new[:n]} of {step.num_drafted} drafts, "
                                    f"the client sent {proposal.tokens}")
        spelled, rest = (len(new), b"") if not self.continue_with else \
            self.spelling.advance_all(self.continue_with, new)
        if spelled < len(new):
            raise ProtocolError(f"step commits {new}, which does not begin to spell "
                                f"{self.continue_with!r} as the session asked")
        if len(self.committed) + len(new) != step.committed_length:
            raise ProtocolError(f"step says committed length {step.committed_length}, "
                                f"the client has {len(self.committed)} + {len(new)}")
        feature = self._feature_of(step)
        remaining = self.remaining - len(new)
        if remaining < 0 or (remaining == 0 and not step.finished):
            raise ProtocolError(f"{len(self.generated) + len(new)} tokens generated of "
                                f"{self.params.max_new_tokens} and the step says finished="
                                f"{step.finished}")
        if proposal is not None:
            self.round_no += 1
            self.pending = None
        self.pending_edit = None  # a step of this suggestion: the verifier has its edit
        self.committed.extend(new)
        self.continue_with = rest
        self._settle_unverified(new)
        self.finished = step.finished
        self.suggested = (step.suggested_draft_len if step.HasField("suggested_draft_len")
                          else None)
        self.token_cost = token_cost
        if feature is not None:
            self.feature = feature
        return new

    def _feature_of(self, step: pb.Step) -> LatestFeature | None:
        """The step's feature, checked: present exactly when asked for, and of a committed
        position. Its sizes are the head's to check (they depend on its codec)."""
        if not step.HasField("feature"):
            if self.want_feature:
                raise ProtocolError("the session asked for target features and a step came "
                                    "without one")
            return None
        if not self.want_feature:
            raise ProtocolError("a step carries a target feature the session did not ask for")
        f = step.feature
        if f.position >= step.committed_length:
            raise ProtocolError(f"the step's feature is of position {f.position}, past the "
                                f"committed length {step.committed_length}")
        return LatestFeature(f.position, EncodedFeature(bytes(f.values), tuple(f.scales)))

    def generate_request(self) -> pb.GenerateRequest:
        """The cloud-only baseline over everything committed so far (resumes after a loss)."""
        p = self.params
        return pb.GenerateRequest(prompt_token_ids=self.committed, sampling=p.sampling_pb(),
                                  max_new_tokens=self.remaining,
                                  stop_token_ids=list(p.stop_token_ids),
                                  ignore_eos=p.ignore_eos)


def _suffix(proposal: Proposal, start: int) -> Proposal:
    """Drafts d_{start+1} .. d_K with their q and confidences."""
    q, c = proposal.q, proposal.confidence
    return Proposal(proposal.tokens[start:], None if q is None else q[start:],
                    None if c is None else c[start:])


def _token_cost(step: pb.Step) -> float | None:
    """A step's draft_token_cost, checked (None when absent)."""
    if not step.HasField("draft_token_cost"):
        return None
    cost = step.draft_token_cost
    if not 0 <= cost < float("inf"):  # also false for NaN
        raise ProtocolError(f"draft_token_cost {cost} is not a finite cost >= 0")
    return cost
