"""The gRPC VerifierService: GetInfo, Generate, and the Session stream's open and dispatch.

Protobuf stops here: handlers turn requests into domain objects (cloud_verifier.wire), run
them on the RoundRunner, and turn the results back. Authentication and the mapping of
errors to statuses happen around every handler (cloud_verifier.interceptors), so a handler
only raises.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

from cloud_verifier.config import VerifierConfig
from cloud_verifier.engine import NO_DRAFT, VerifierEngine
from cloud_verifier.errors import InvalidRequest
from cloud_verifier.interceptors import current_caller, current_routing_key
from cloud_verifier.lookahead_mode import LookaheadMode
from cloud_verifier.metrics import VerifierMetrics
from cloud_verifier.rounds import RoundRunner
from cloud_verifier.rounds_mode import RoundsMode
from cloud_verifier.session_stream import RequestReader
from cloud_verifier.wire import ROUNDS, Limits, parse_generate, parse_open, step_to_pb
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

PROTOCOL_VERSION = "edgespec.v1"


@dataclass(frozen=True)
class ModelInfo:
    name: str
    vocab_size: int
    tokenizer_fingerprint: str
    eos_token_ids: tuple[int, ...]


class VerifierService(pb_grpc.VerifierServiceServicer):
    def __init__(self, engine: VerifierEngine, config: VerifierConfig, info: ModelInfo,
                 metrics: VerifierMetrics) -> None:
        self.engine = engine
        self.config = config
        self.info = info
        self.metrics = metrics
        self.runner = RoundRunner(engine, config, metrics)
        self.limits = Limits(info.vocab_size, config.max_draft_len, engine.max_context)
        self._eos = frozenset(info.eos_token_ids)

    # What operators and tests look at.
    @property
    def store(self):
        return self.runner.store

    @property
    def batcher(self):
        return self.runner.batcher

    @property
    def prefix_cache(self):
        return self.runner.prefix_cache

    @property
    def draining(self) -> bool:
        return self.runner.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.runner.draining = value

    # -- handlers ---------------------------------------------------------------------------

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.GetInfoResponse:
        return pb.GetInfoResponse(
            protocol_version=PROTOCOL_VERSION, target_model=self.info.name,
            vocab_size=self.info.vocab_size,
            tokenizer_fingerprint=self.info.tokenizer_fingerprint,
            max_draft_len=self.config.max_draft_len, max_context=self.engine.max_context,
            modes=["greedy", "sampling"], eos_token_ids=list(self.info.eos_token_ids))

    async def Session(self, request_iterator, context):
        """One session per stream: the open's drafting mode runs it; the stream's end
        closes it."""
        reader = RequestReader(request_iterator)
        try:
            first = await reader.get()
            if first is None or first.WhichOneof("kind") != "open":
                raise InvalidRequest("the first message of a Session stream must be open",
                                     field="open")
            params = parse_open(first.open, self.limits, self._eos)
            session = self.runner.create_session(params, current_caller(),
                                                 current_routing_key())
            mode = RoundsMode if params.drafting == ROUNDS else LookaheadMode
            try:
                async with contextlib.aclosing(mode(self.runner, self.limits, session, reader,
                                                    params.first_draft).run()) as replies:
                    async for reply in replies:
                        yield reply
            finally:
                self.runner.close_soon(session)
        finally:
            reader.close()

    async def Generate(self, request: pb.GenerateRequest, context):
        """Cloud-only decoding: K = 0 rounds through the same batcher, one token each."""
        params = parse_generate(request, self.limits, self._eos)
        session = self.runner.create_session(params, current_caller(), current_routing_key())
        session.streamed = True
        try:
            for forward in itertools.count():
                result = await self.runner.run_round(session, forward, NO_DRAFT,
                                                     follow_up=True)
                yield pb.GenerateResponse(step=step_to_pb(result, suggestion=False))
                if result.finished:
                    return
        finally:
            self.runner.close_soon(session)

    # -- lifecycle --------------------------------------------------------------------------

    async def expire_forever(self, period_s: float) -> None:
        await self.runner.expire_forever(period_s)

    async def finish_background(self) -> None:
        await self.runner.finish_background()
