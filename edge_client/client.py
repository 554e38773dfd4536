"""The edge client's Python API: speculative generation against a remote verifier.

    with EdgeClient("verifier:50051") as client:          # the shipped draft by default
        gen = client.generate("Write a haiku about the sea.", GenerationConfig(max_new_tokens=64))
        for text in gen.text():
            print(text, end="", flush=True)
        print(gen.stats.to_dict())

or, in asyncio code::

    async with AsyncEdgeClient("verifier:50051") as client:
        async for text in client.generate("Hi!").text():
            ...

Both run the one client core (edge_client.core): drafting on the device, Verify rounds or a
lookahead stream, reopening after evictions and restarts, back-off as the server asks. The
synchronous ``EdgeClient`` is a facade that runs an ``AsyncEdgeClient`` on its own event-loop
thread. ``Generation.cancel()`` may be called from any thread; it, or leaving the iteration
early, closes the server's session at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_client.combined_drafter import FEATURE, make_drafter
from edge_client.connection import ClientTls, Connection, Deadlines, RetryPolicy
from edge_client.core import (
    DRAFT_ONLY,
    FAIL,
    FALLBACKS,
    Delivery,
    GenerationStats,
    draft_alone,
    generate,
    model_proposer,
    unverified_delivery,
)
from edge_client.document import AsyncDocument, Document
from edge_client.draft_model import OnnxDraftModel
from edge_client.errors import (  # noqa: F401 - part of this module's API
    IncompatibleVerifier,
    RequestRejected,
    VerifierUnavailable,
)
from edge_client.feature_draft import FeatureHead
from edge_client.feature_drafter import feature_head_for
from edge_client.generation_config import GenerationConfig
from edge_client.generation_state import (  # noqa: F401 - ProtocolError is API
    PROTOCOLS,
    ROUNDS,
    GenerationState,
    ProtocolError,
    ServerLimits,
    SessionParams,
)
from edge_client.link import DelayLink, Link
from edge_client.offline_start import (
    OFFLINE_AFTER_S,
    VerifierProbe,
    draft_until_reached,
    offline_wait_s,
)
from edge_client.rate_chooser import RateChooser
from edge_client.tokenizer import EdgeTokenizer, TextStream
from shared.paths import default_draft_dir
from shared.pb import verifier_pb2 as pb

log = logging.getLogger(__name__)

# The context a draft without a position limit may draft in while no verifier has said its
# own (the verifier's max_context replaces it when it answers).
NO_CONTEXT_CAP = 1 << 20
class AsyncEdgeClient:
    """A draft model on this device and a connection to one verifier.

    ``tls``: a TLS channel (``ClientTls(ca=..., cert=..., key=...)``); without it the
    channel is plaintext, allowed to a loopback address or with ``insecure=True``.
    ``feature_head``: the directory of a feature head (``edgespec-distill export-head``), for
    ``GenerationConfig(drafter="feature")``.
    """

    def __init__(self, address: str, draft_dir: str | Path | None = None, *,
                 api_key: str | None = None, protocol: str = ROUNDS,
                 deadlines: Deadlines | None = None, retry: RetryPolicy | None = None,
                 rtt_ms: float = 0.0, link: Link | None = None,
                 intra_op_threads: int | None = None, tls: ClientTls | None = None,
                 insecure: bool = False, fallback: str = FAIL,
                 feature_head: str | Path | None = None,
                 offline_after_s: float = OFFLINE_AFTER_S) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}")
        if fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {', '.join(FALLBACKS)}")
        if not offline_after_s >= 0:
            raise ValueError("offline_after_s must be >= 0")
        # Draft-only: how long connect() waits for a verifier that has not answered.
        self.offline_after_s = offline_after_s
        # DRAFT_ONLY: connect() comes up without a verifier it cannot reach (info None);
        # documents then suggest with the draft alone until one answers (refresh_info).
        self.fallback = fallback
        draft_dir = Path(draft_dir) if draft_dir is not None else default_draft_dir()
        self.tokenizer = EdgeTokenizer(draft_dir)
        self.model = OnnxDraftModel(draft_dir, intra_op_threads=intra_op_threads)
        self.protocol = protocol
        self.conn = Connection(address, api_key, deadlines or Deadlines(), retry or RetryPolicy(),
                               link if link is not None else
                               (DelayLink(rtt_ms) if rtt_ms else None), tls=tls,
                               insecure=insecure)
        # Measured rates of drafting vs cloud-side decoding on this connection.
        self.chooser = RateChooser()
        self.info = None
        self.feature_head_dir = None if feature_head is None else Path(feature_head)
        self._intra_op_threads = intra_op_threads
        # The loaded head and the capability it was checked against.
        self._head: tuple[bytes, FeatureHead] | None = None
        # Draft-only: reaches an absent verifier in the background (edge_client.offline_start).
        self.probe = VerifierProbe(self)

    async def connect(self) -> AsyncEdgeClient:
        """Asks the verifier what it serves and refuses one with another tokenizer. With
        ``fallback="draft-only"`` an unreachable verifier is not an error: the client comes
        up with ``info`` None (the draft's tokenizer is local) after at most
        ``offline_after_s`` (0.5 s by default), and keeps asking in the background (``probe``)."""
        if self.fallback != DRAFT_ONLY:
            await self.refresh_info()
        elif not await self.probe.wait(self.offline_after_s):
            log.warning("the verifier at %s has not answered; coming up with the draft alone",
                        self.conn.address)
        return self

    async def refresh_info(self) -> pb.GetInfoResponse:
        """GetInfo once; sets ``info`` if the verifier serves this draft's tokenizer, else
        raises IncompatibleVerifier (VerifierUnavailable when it cannot be reached)."""
        info = await self.conn.info()
        if info.tokenizer_fingerprint != self.tokenizer.fingerprint:
            raise IncompatibleVerifier(
                f"the verifier at {self.conn.address} serves {info.target_model!r} whose "
                f"tokenizer ({info.tokenizer_fingerprint[:19]}...) differs from the draft's "
                f"({self.tokenizer.fingerprint[:19]}...); token ids would mean different text")
        if info.vocab_size != self.model.vocab_size:
            raise IncompatibleVerifier(
                f"the verifier's vocabulary has {info.vocab_size} ids but the draft model "
                f"outputs {self.model.vocab_size}")
        self.info = info
        return info

    def feature_head(self) -> FeatureHead:
        """The feature head, checked against the verifier's current feature capability
        (loaded once per capability): IncompatibleVerifier when the verifier serves none or
        another target's."""
        if self.feature_head_dir is None:
            raise ValueError("drafter 'feature' needs a feature head: AsyncEdgeClient("
                             "feature_head=DIR), edge-client --feature-head DIR")
        if self.info is None:
            raise VerifierUnavailable(f"the feature drafter drafts from the verifier's "
                                      f"features, and the verifier at {self.conn.address} "
                                      "has not answered")
        key = self.info.feature.SerializeToString() if self.info.HasField("feature") else b""
        if self._head is None or self._head[0] != key:
            self._head = key, feature_head_for(self.feature_head_dir, self.info,
                                               self.conn.address, self._intra_op_threads)
        return self._head[1]

    async def close(self) -> None:
        await self.probe.close()
        await self.conn.close()

    async def __aenter__(self) -> AsyncEdgeClient:
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def limits(self, draft_len: int) -> ServerLimits:
        """The verifier's limits; while none has answered (a draft-only start), the draft's
        own, which the verifier's replace when it does."""
        if self.info is not None:
            return ServerLimits.from_info(self.info)
        return ServerLimits(self.model.vocab_size, draft_len,
                            self.model.max_context or NO_CONTEXT_CAP)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The verifier's end-of-sequence tokens, or the draft tokenizer's before it answers."""
        return tuple(self.info.eos_token_ids if self.info is not None
                     else self.tokenizer.eos_token_ids)

    async def reach_verifier(self, required: bool = False) -> bool:
        """Whether the client has its verifier. One that came up without it asks again;
        False while it is unreachable, or with ``required`` its VerifierUnavailable."""
        if self.info is None:
            try:
                await self.refresh_info()
            except VerifierUnavailable:
                if required:
                    raise
                return False
        return True

    def prompt_ids(self, prompt: str | list[int], chat: bool) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt)
        return list(prompt)

    def generate(self, prompt: str | list[int], config: GenerationConfig = GenerationConfig(),
                 chat: bool = True, routing_key: str | None = None) -> AsyncGeneration:
        """``prompt`` is text (wrapped in the chat template when ``chat``) or token ids.
        ``routing_key``: see ``edge_client.core.generate`` (None: a fresh one)."""
        if self.info is None and self.fallback != DRAFT_ONLY:
            raise RuntimeError("call connect() (or use `async with`) before generate()")
        return AsyncGeneration(self, self.prompt_ids(prompt, chat), config, routing_key)

    def document(self, config: GenerationConfig = GenerationConfig()) -> AsyncDocument:
        """An editing session for one text field (edge_client.document); no RPC until its
        first suggestion."""
        return AsyncDocument(self, config)


@dataclass(frozen=True)
class Chunk:
    """Tokens of one delivery. ``verified`` False: drafted on the device alone. ``replaces``:
    how many unverified tokens at the end of the text so far this chunk takes back first."""

    token_ids: list[int]
    verified: bool = True
    replaces: int = 0


class AsyncGeneration:
    """One generation: ``async for`` it for committed token chunks, or use ``text()``."""

    def __init__(self, client: AsyncEdgeClient, prompt_ids: list[int],
                 config: GenerationConfig, routing_key: str | None = None) -> None:
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        self.client = client
        self.config = config
        self.routing_key = routing_key
        self.prompt_ids = list(prompt_ids)
        self.token_ids: list[int] = []  # generated and verified so far
        self.unverified_ids: list[int] = []  # after them: drafted alone, not verified (yet)
        self.stats = GenerationStats()
        self.budget_spent = False  # config.budget_ms ran out before the generation ended

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        """The verified token chunks (``chunks()`` also has the unverified ones)."""
        async for chunk in self.chunks():
            if chunk.verified and chunk.token_ids:
                yield chunk.token_ids

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Every chunk, verified or not: with ``fallback="draft-only"``, tokens the draft
        proposed alone come marked unverified, and a verified chunk may first take back
        (``replaces``) unverified ones at the end of what came before."""
        async for delivery in self._deliveries():
            if delivery.replaces:
                del self.unverified_ids[len(self.unverified_ids) - delivery.replaces:]
            (self.token_ids if delivery.verified else self.unverified_ids).extend(
                delivery.tokens)
            yield Chunk(list(delivery.tokens), delivery.verified, delivery.replaces)

    async def _deliveries(self) -> AsyncIterator[Delivery]:
        cfg, client = self.config, self.client
        if cfg.fallback == DRAFT_ONLY:
            # Never longer than the first token's budget: the draft starts alone after it.
            await client.probe.wait(offline_wait_s(cfg.budget_ms))
        else:
            await client.reach_verifier(required=True)
        adaptive = cfg.follow_suggested_draft_len is True
        features = cfg.drafter == FEATURE
        state = GenerationState(self.prompt_ids, cfg.session_params(),
                                client.limits(cfg.draft_len), cfg.draft_len,
                                client.protocol, follow_suggestion=adaptive,
                                chooser=client.chooser if adaptive else None,
                                want_feature=features)
        drafter = make_drafter(cfg.drafter, client.model,
                               cfg.draft_sampling(state.limits.q_support(cfg.max_support)),
                               np.random.default_rng(cfg.seed),
                               head=client.feature_head() if features else None,
                               latest=lambda: state.feature)
        rng = np.random.default_rng()  # back-off jitter only: never touches the output
        propose = model_proposer(drafter, self.stats)
        deadline = None if cfg.budget_ms is None else (
            asyncio.get_running_loop().time() + cfg.budget_ms / 1000)
        async with contextlib.aclosing(self._phases(state, propose, rng)) as deliveries:
            while True:
                try:
                    # The budget bounds the waits for the core only, never the caller's
                    # code between chunks.
                    async with asyncio.timeout_at(deadline):
                        delivery = await anext(deliveries)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    break
                yield delivery
        # The budget is spent: the drafts on their way to the verifier, then (draft-only)
        # the draft alone, come unverified.
        self.budget_spent = True
        in_flight = state.pending
        if in_flight is not None and in_flight.tokens and state.unverified is None:
            state.add_unverified(in_flight.prefix(state.remaining))
            yield unverified_delivery(state.unverified.tokens)
        if cfg.fallback == DRAFT_ONLY:
            async for delivery in draft_alone(state, propose, self._stop_ids(), self.stats):
                yield delivery
        self.stats.unverified_tokens = state.num_unverified

    async def _phases(self, state: GenerationState, propose,
                      rng: np.random.Generator) -> AsyncIterator[Delivery]:
        """Without a verifier yet (a draft-only start): the draft alone, unverified, while
        the client's probe asks for one in the background; then the core, whose first
        rounds verify what the draft proposed alone."""
        client = self.client
        if client.info is None:
            async for delivery in draft_until_reached(client.probe, state, propose,
                                                      self._stop_ids(), self.stats):
                yield delivery
            if client.info is None:
                log.warning("the verifier stayed away; %d tokens stay unverified",
                            state.num_unverified)
                self.stats.unverified_tokens = state.num_unverified
                return
            state.limits = client.limits(self.config.draft_len)
        async with contextlib.aclosing(generate(
                client.conn, state, propose, self.stats, client.info, rng,
                self.routing_key, fallback=self.config.fallback)) as deliveries:
            async for delivery in deliveries:
                yield delivery

    def _stop_ids(self) -> frozenset[int]:
        cfg = self.config
        return frozenset(cfg.stop_token_ids or (() if cfg.ignore_eos else
                                                self.client.eos_token_ids))

    async def text(self) -> AsyncIterator[str]:
        stream = TextStream(self.client.tokenizer)
        async for chunk in self:
            if piece := stream.push(chunk):
                yield piece


class EdgeClient:
    """The synchronous API: an ``AsyncEdgeClient`` on a private event-loop thread."""

    def __init__(self, address: str, draft_dir: str | Path | None = None,
                 **options) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="edge-client",
                                        daemon=True)
        self._thread.start()
        try:
            self._async = self._call(self._make(address, draft_dir, options))
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _make(address, draft_dir, options) -> AsyncEdgeClient:
        client = AsyncEdgeClient(address, draft_dir, **options)
        try:
            return await client.connect()
        except BaseException:
            await client.close()
            raise

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def tokenizer(self) -> EdgeTokenizer:
        return self._async.tokenizer

    @property
    def info(self):
        return self._async.info

    @property
    def protocol(self) -> str:
        return self._async.protocol

    def generate(self, prompt: str | list[int], config: GenerationConfig = GenerationConfig(),
                 chat: bool = True, routing_key: str | None = None) -> Generation:
        return Generation(self, self._async.generate(prompt, config, chat, routing_key))

    def document(self, config: GenerationConfig = GenerationConfig()) -> Document:
        return Document(self, self._async.document(config))

    def close(self) -> None:
        if self._loop.is_running():
            self._call(self._async.close())
        self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> EdgeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_DONE = object()


class Generation:
    """One generation; iterate it for committed token chunks, or call ``text()``."""

    def __init__(self, client: EdgeClient, inner: AsyncGeneration) -> None:
        self._client = client
        self._inner = inner
        self._task: asyncio.Future | None = None
        self._cancelled = threading.Event()

    @property
    def stats(self) -> GenerationStats:
        return self._inner.stats

    @property
    def token_ids(self) -> list[int]:
        return self._inner.token_ids

    @property
    def prompt_ids(self) -> list[int]:
        return self._inner.prompt_ids

    @property
    def unverified_ids(self) -> list[int]:
        return self._inner.unverified_ids

    def cancel(self) -> None:
        """Stops the generation from any thread; the server's session closes at once."""
        self._cancelled.set()
        task = self._task
        if task is not None:
            self._client._loop.call_soon_threadsafe(task.cancel)

    def __iter__(self) -> Iterator[list[int]]:
        """The verified token chunks."""
        return self._iterate(self._inner.__aiter__)

    def chunks(self) -> Iterator[Chunk]:
        """Every chunk, verified or not (AsyncGeneration.chunks)."""
        return self._iterate(self._inner.chunks)

    def _iterate(self, source) -> Iterator:
        if self._task is not None:
            raise RuntimeError("a generation runs once")
        chunks: queue.SimpleQueue = queue.SimpleQueue()

        async def pump() -> None:
            try:
                async for chunk in source():
                    chunks.put(chunk)
            except BaseException as exc:  # noqa: BLE001 - handed to the iterating thread
                chunks.put(exc)
                raise
            finally:
                chunks.put(_DONE)

        self._task = asyncio.run_coroutine_threadsafe(pump(), self._client._loop)
        if self._cancelled.is_set():
            self.cancel()
        try:
            while (item := chunks.get()) is not _DONE:
                if isinstance(item, asyncio.CancelledError):
                    if self._cancelled.is_set():
                        return
                    raise item
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not self._task.done():  # left early: end the stream, then return
                self.cancel()
                with contextlib.suppress(BaseException):
                    self._task.result(timeout=10)

    def text(self) -> Iterator[str]:
        stream = TextStream(self._client.tokenizer)
        for chunk in self:
            if piece := stream.push(chunk):
                yield piece
