"""The edge client's Python API: speculative generation against a remote verifier.

    client = EdgeClient("verifier:50051", draft_dir)
    gen = client.generate("Write a haiku about the sea.", GenerationConfig(max_new_tokens=64))
    for text in gen.text():
        print(text, end="", flush=True)
    print(gen.stats.to_dict())

One round: draft K tokens on the device (recording q), send ids + sparse q, receive the
number accepted n and the correction/bonus token, commit d_1..d_n + that token, resync the
draft cache. The first round rides on OpenSession, and the server closes the session itself
when the generation finishes, so a generation of R rounds costs exactly R round trips.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edge_client.combined_drafter import DRAFTER_KINDS, Drafter, make_drafter
from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, Proposal
from edge_client.rate_chooser import CONTINUE, SPEC, RateChooser
from edge_client.rounds import (  # noqa: F401 - ProtocolError is part of this module's API
    NO_DRAFTS,
    GenerationRounds,
    ProtocolError,
    ServerLimits,
    SessionParams,
)
from edge_client.tokenizer import EdgeTokenizer, TextStream
from edge_client.transport import (
    LookaheadStream,
    StreamRounds,
    Transport,
    UnaryRounds,
    WireStats,
)
from shared.pb import verifier_pb2 as pb

# How a generation talks to the verifier: Verify rounds on one Session stream or as unary
# calls, or one Lookahead stream (edge_client.transport).
PROTOCOLS = ("stream", "unary", "lookahead")


class IncompatibleVerifier(RuntimeError):
    """The verifier's model does not share this client's tokenizer or vocabulary."""


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    draft_len: int = 4
    max_support: int = 64  # cap on each q's support (see DraftSampling)
    stop_token_ids: tuple[int, ...] = ()  # empty: the verifier's eos tokens
    ignore_eos: bool = False
    drafter: str = "model"  # one of DRAFTER_KINDS: "model", "ngram" (prompt lookup), "combined"
    # Adapt to the server and the network: cap K by the server's suggested_draft_len, and
    # choose drafting or server-side decoding (Continue) by measured rate
    # (edge_client.rate_chooser). Off by default: both depend on load, so sampled outputs
    # would no longer be a function of the seed (they stay exact in distribution).
    follow_suggested_draft_len: bool = False

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTER_KINDS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTER_KINDS)}, "
                             f"got {self.drafter!r}")
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.draft_len < 0:
            raise ValueError("draft_len must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")


@dataclass
class GenerationStats:
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    round_trips: int = 0
    target_forwards: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    draft_s: float = 0.0
    network_s: float = 0.0  # call time minus the server's own queue + forward time
    verify_s: float = 0.0  # server queue + forward time
    wall_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.new_tokens / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["acceptance_rate"] = self.acceptance_rate
        d["tokens_per_round"] = self.tokens_per_round
        d["tokens_per_s"] = self.new_tokens / self.wall_s if self.wall_s else 0.0
        return d


class EdgeClient:
    def __init__(self, address: str, draft_dir: str | Path, api_key: str | None = None,
                 rtt_ms: float = 0.0, protocol: str = "stream", timeout_s: float = 60.0,
                 intra_op_threads: int | None = None) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}")
        self.tokenizer = EdgeTokenizer(draft_dir)
        self.model = OnnxDraftModel(draft_dir, intra_op_threads=intra_op_threads)
        self.transport = Transport(address, api_key=api_key, rtt_ms=rtt_ms, timeout_s=timeout_s)
        self.protocol = protocol
        # Measured rates of drafting vs Continue on this connection, across generations.
        self.chooser = RateChooser()
        self.info = self.transport.info()
        self._check_compatible()

    def _check_compatible(self) -> None:
        info = self.info
        if info.tokenizer_fingerprint != self.tokenizer.fingerprint:
            raise IncompatibleVerifier(
                f"the verifier at {self.transport.address} serves {info.target_model!r} whose "
                f"tokenizer ({info.tokenizer_fingerprint[:19]}...) differs from the draft's "
                f"({self.tokenizer.fingerprint[:19]}...); token ids would mean different text")
        if info.vocab_size != self.model.vocab_size:
            raise IncompatibleVerifier(
                f"the verifier's vocabulary has {info.vocab_size} ids but the draft model "
                f"outputs {self.model.vocab_size}")

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> EdgeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompt: str | list[int], config: GenerationConfig = GenerationConfig(),
                 chat: bool = True) -> Generation:
        """``prompt`` is text (wrapped in the chat template when ``chat``) or token ids."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        return Generation(self, ids, config)


class Generation:
    """One generation; iterate it for committed token chunks, or call ``text()``."""

    def __init__(self, client: EdgeClient, prompt_ids: list[int],
                 config: GenerationConfig) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self.client = client
        self.config = config
        self.prompt_ids = list(prompt_ids)
        self.token_ids: list[int] = []  # generated so far
        self.stats = GenerationStats()
        self.wire = WireStats()

    def text(self) -> Iterator[str]:
        stream = TextStream(self.client.tokenizer)
        for chunk in self:
            piece = stream.push(chunk)
            if piece:
                yield piece

    def __iter__(self) -> Iterator[list[int]]:
        cfg, client = self.config, self.client
        started = time.perf_counter()
        drafter = make_drafter(
            cfg.drafter, client.model,
            DraftSampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.max_support),
            np.random.default_rng(cfg.seed))
        state = GenerationRounds(
            self.prompt_ids,
            SessionParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                          top_k=cfg.top_k, top_p=cfg.top_p, seed=cfg.seed,
                          stop_token_ids=tuple(cfg.stop_token_ids), ignore_eos=cfg.ignore_eos),
            ServerLimits.from_info(client.info), cfg.draft_len,
            follow_suggestion=cfg.follow_suggested_draft_len,
            chooser=client.chooser if cfg.follow_suggested_draft_len else None)
        if client.protocol == "lookahead":
            try:
                yield from self._lookahead(drafter, state)
            finally:
                self._finish(started)
            return
        rounds = (StreamRounds if client.protocol == "stream" else UnaryRounds)(
            client.transport, self.wire)
        try:
            proposal = self._propose(drafter, state)
            opened = rounds.open(state.open_request(proposal))
            session_id = opened.session_id
            yield from self._apply(state, proposal, opened.first_round)
            while not state.finished:
                t0 = time.perf_counter()
                if state.wants_continue():  # the server decodes in the session
                    before = len(state.committed)
                    for result in rounds.continue_(state.continue_request(session_id)):
                        yield from self._apply(state, NO_DRAFTS, result)
                    state.observe(CONTINUE, len(state.committed) - before,
                                  time.perf_counter() - t0)
                    continue
                proposal = self._propose(drafter, state)
                result = rounds.verify(state.verify_request(session_id, proposal)).result
                n = yield from self._apply(state, proposal, result)
                state.observe(SPEC, n, time.perf_counter() - t0)
        finally:
            rounds.end()
            self._finish(started)

    def _lookahead(self, drafter: Drafter, state: GenerationRounds) -> Iterator[list[int]]:
        """The server decodes back to back; after each step, draft ahead and send it."""
        stream = LookaheadStream(self.client.transport, self.wire, state.open_request(
            self._propose(drafter, state, state.lookahead_len(opening=True))))
        try:
            for step in stream:
                new = state.apply_step(step)
                self.token_ids.extend(new)
                self._account(step.num_drafted, step.num_accepted, len(new), 1, step.timing)
                yield new
                if state.finished:
                    break  # the server keeps the stream open until we end it
                if state.lookahead_len():
                    stream.send(state.lookahead_request(
                        self._propose(drafter, state, state.lookahead_len())))
            if not state.finished:
                raise ProtocolError("the Lookahead stream ended before the generation "
                                    "finished")
        finally:
            stream.end()

    def _finish(self, started: float) -> None:
        stats = self.stats
        stats.round_trips = self.wire.round_trips
        stats.bytes_up, stats.bytes_down = self.wire.bytes_up, self.wire.bytes_down
        stats.network_s = max(0.0, self.wire.call_s - stats.verify_s)
        stats.wall_s = time.perf_counter() - started

    def _apply(self, state: GenerationRounds, proposal: Proposal,
               result: pb.RoundResult) -> Iterator[list[int]]:
        """Applies one round's result and yields its new tokens; returns how many."""
        new = state.apply(proposal, result)
        self.token_ids.extend(new)
        self._account(len(proposal.tokens), result.num_accepted, len(new),
                      result.target_forwards, result.timing)
        yield new
        return len(new)

    def _propose(self, drafter: Drafter, state: GenerationRounds,
                 k: int | None = None) -> Proposal:
        """``k`` drafts after the committed text for a lookahead, or (by default) the next
        round's drafts, cut to what is worth verifying."""
        t0 = time.perf_counter()
        proposal = drafter.propose(state.committed, state.next_k() if k is None else k)
        self.stats.draft_s += time.perf_counter() - t0
        return proposal if k is not None else state.worth_sending(proposal)

    def _account(self, drafted: int, accepted: int, emitted: int, forwards: int,
                 timing: pb.Timing) -> None:
        s = self.stats
        s.rounds += 1
        s.drafted += drafted
        s.accepted += accepted
        s.new_tokens += emitted
        s.target_forwards += forwards
        s.verify_s += (timing.queue_ns + timing.forward_ns) / 1e9
