"""The OpenAI-compatible endpoints over one ``AsyncEdgeClient``: /v1/models,
/v1/completions and /v1/chat/completions, streamed (server-sent events) or not.

Each request is one speculative generation (edge_client.client). The response's ``usage`` is
OpenAI's; ``edgespec`` adds the speculative statistics (acceptance, tokens per round, round
trips, the positions the verifier fed). A chat is routed by a key derived from its first
messages, so every turn of one conversation reaches the verifier replica whose prefix cache
holds the turns before (edge_client.connection.document_routing_key); a follow-up turn's
prompt starts with the previous turn's prompt and answer, so the verifier feeds only the new
part (``edgespec.fed_tokens``).

A client that disconnects cancels its generation: the verifier's session closes at once and
no more drafting is done for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from edge_client.client import AsyncEdgeClient, AsyncGeneration, GenerationConfig
from edge_client.connection import document_routing_key
from edge_client.errors import IncompatibleVerifier, RequestRejected, VerifierUnavailable
from edge_client.serve.requests import (
    CHAT_DEFAULT_MAX_TOKENS,
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ApiError,
    ParsedRequest,
    parse_chat,
    parse_completion,
)
from edge_client.tokenizer import TextStream

log = logging.getLogger(__name__)

# What the verifier's refusals mean to an HTTP client: its input (400), the verifier's load
# (429: retry later), anything else is this server's configuration or the verifier (502).
_STATUS_OF_REJECTION = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
                        grpc.StatusCode.FAILED_PRECONDITION: 400,
                        grpc.StatusCode.RESOURCE_EXHAUSTED: 429}


@dataclass
class ServeOptions:
    """How every request drafts (the HTTP API has no say in it: it is the device's choice)."""

    model_id: str | None = None  # None: the verifier's target_model
    draft_len: int = 4
    drafter: str = "combined"
    stop_confidence: float = 0.1


@dataclass
class ServeCounters:
    """Generations by outcome: what /healthz reports, and what the tests read."""

    active: int = 0
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    last_stats: dict = field(default_factory=dict)


class ServeState:
    def __init__(self, make_client: Callable[[], AsyncEdgeClient], options: ServeOptions):
        self.make_client = make_client
        self.options = options
        self.client: AsyncEdgeClient | None = None
        self.counters = ServeCounters()

    @property
    def model_id(self) -> str:
        if self.options.model_id:
            return self.options.model_id
        info = self.client.info if self.client is not None else None
        return info.target_model if info is not None and info.target_model else "edgespec"


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def api_error_of(exc: BaseException) -> ApiError:
    """A generation's failure in OpenAI's shape."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestRejected):
        status = _STATUS_OF_REJECTION.get(exc.details.code, 502)
        type_ = "invalid_request_error" if status == 400 else (
            "rate_limit_error" if status == 429 else "server_error")
        return ApiError(status, f"the verifier refused the request: {exc}", type_=type_,
                        code=exc.details.reason or exc.details.code.name.lower())
    if isinstance(exc, VerifierUnavailable):
        return ApiError(503, str(exc), type_="server_error", code="verifier_unavailable")
    if isinstance(exc, IncompatibleVerifier):
        return ApiError(502, str(exc), type_="server_error", code="incompatible_verifier")
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    log.exception("generation failed", exc_info=exc)
    return ApiError(500, f"internal error: {type(exc).__name__}", type_="server_error",
                    code="internal_error")


async def _json_body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON: {err}",
                       code="invalid_json") from None


class _Run:
    """One request's generation: its prompt, its config, and the text as it streams."""

    def __init__(self, state: ServeState, parsed: ParsedRequest, chat: bool) -> None:
        client = state.client
        if parsed.model != state.model_id:
            raise ApiError(404, f"The model {parsed.model!r} does not exist; this server "
                           f"serves {state.model_id!r} (GET /v1/models)", param="model",
                           code="model_not_found")
        tok = client.tokenizer
        routing_key = None
        if chat:
            try:
                text = tok.apply_chat_template(list(parsed.messages))
            except Exception as err:  # noqa: BLE001 - a template error is the input's fault
                raise ApiError(400, f"the chat template cannot render these messages: {err}",
                               param="messages") from None
            prompt_ids = tok.encode(text)
            # The conversation's identity: its first message (a system prompt and the first
            # question), so every turn meets the same prefix cache.
            routing_key = document_routing_key(json.dumps(parsed.messages[:2]))
        elif isinstance(parsed.prompt, str):
            prompt_ids = tok.encode(parsed.prompt)
        else:
            vocab = client.model.vocab_size
            if max(parsed.prompt) >= vocab:
                raise ApiError(400, f"prompt token ids must be < {vocab}", param="prompt")
            prompt_ids = list(parsed.prompt)
        if not prompt_ids:
            raise ApiError(400, "the prompt encodes to no tokens", param="prompt")
        opts = state.options
        room = client.limits(opts.draft_len).max_context - len(prompt_ids)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this model's "
                           f"context holds {room + len(prompt_ids)}", param="messages"
                           if chat else "prompt", code="context_length_exceeded")
        max_tokens = parsed.max_tokens
        if max_tokens is None:
            default = CHAT_DEFAULT_MAX_TOKENS if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
            max_tokens = min(default, room)
        elif max_tokens > room:
            raise ApiError(400, f"max_tokens={max_tokens} does not fit: the prompt has "
                           f"{len(prompt_ids)} tokens and the context holds "
                           f"{room + len(prompt_ids)}", param="max_tokens",
                           code="context_length_exceeded")
        self.config = GenerationConfig(
            max_new_tokens=max_tokens, temperature=parsed.temperature, top_p=parsed.top_p,
            seed=parsed.seed, draft_len=opts.draft_len, drafter=opts.drafter,
            stop_confidence=opts.stop_confidence)
        self.state, self.parsed, self.chat = state, parsed, chat
        self.generation: AsyncGeneration = client.generate(prompt_ids, self.config,
                                                           routing_key=routing_key)
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.finished = False

    async def pieces(self) -> AsyncIterator[str]:
        """The verified text as it commits; counts the outcome, whatever it is."""
        counters = self.state.counters
        counters.active += 1
        stream = TextStream(self.state.client.tokenizer)
        try:
            async with contextlib.aclosing(self.generation.chunks()) as chunks:
                async for chunk in chunks:
                    if chunk.verified and (piece := stream.push(chunk.token_ids)):
                        yield piece
            self.finished = True
            counters.completed += 1
        except (asyncio.CancelledError, GeneratorExit):
            counters.cancelled += 1
            log.info("%s: the client went away; generation cancelled after %d tokens",
                     self.id, len(self.generation.token_ids))
            raise
        except BaseException:
            counters.failed += 1
            raise
        finally:
            counters.active -= 1
            counters.last_stats = {"completion_tokens": len(self.generation.token_ids),
                                   **self.extension()}

    @property
    def finish_reason(self) -> str:
        return "length" if len(self.generation.token_ids) >= self.config.max_new_tokens \
            else "stop"

    def usage(self) -> dict:
        prompt, completion = len(self.generation.prompt_ids), len(self.generation.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def extension(self) -> dict:
        s = self.generation.stats
        return {"acceptance_rate": round(s.acceptance_rate, 4),
                "tokens_per_round": round(s.tokens_per_round, 4), "round_trips": s.round_trips,
                "rounds": s.rounds, "drafted": s.drafted, "accepted": s.accepted,
                "target_forwards": s.target_forwards, "fed_tokens": s.fed_tokens,
                "reopens": s.reopens}

    def chunk(self, delta_or_text, finish_reason: str | None = None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": delta_or_text, "logprobs": None,
                      "finish_reason": finish_reason}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta_or_text, "logprobs": None,
                      "finish_reason": finish_reason}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.parsed.model, "system_fingerprint": None, "choices": [choice]}

    def whole(self, text: str) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": self.finish_reason}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None,
                      "finish_reason": self.finish_reason}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created,
                "model": self.parsed.model, "system_fingerprint": None, "choices": [choice],
                "usage": self.usage(), "edgespec": self.extension()}


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def _events(run: _Run) -> AsyncIterator[str]:
    """The SSE stream. Starlette cancels it when the client disconnects, which closes the
    generation (``_Run.pieces``) and with it the verifier's session."""
    if run.chat:
        yield _sse(run.chunk({"role": "assistant", "content": ""}))
    try:
        async for piece in run.pieces():
            yield _sse(run.chunk({"content": piece} if run.chat else piece))
    except Exception as exc:  # noqa: BLE001 - the headers are sent: the error goes in-band
        yield _sse(api_error_of(exc).body())
        return
    last = run.chunk({} if run.chat else "", run.finish_reason)
    last["edgespec"] = run.extension()
    if not run.parsed.include_usage:
        last["usage"] = run.usage()
    yield _sse(last)
    if run.parsed.include_usage:  # OpenAI's shape: a last chunk with no choices
        final = run.chunk({} if run.chat else "")
        final["choices"], final["usage"] = [], run.usage()
        yield _sse(final)
    yield _sse("[DONE]")


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(request: Request, chat: bool) -> Response:
    state: ServeState = request.app.state.serve
    try:
        body = await _json_body(request)
        parsed = parse_chat(body) if chat else parse_completion(body)
        if state.client is None or (state.client.info is None and
                                    not await state.client.reach_verifier()):
            raise ApiError(503, "the verifier has not answered yet", type_="server_error",
                           code="verifier_unavailable")
        run = _Run(state, parsed, chat)
    except ApiError as err:
        return error_response(err)
    if parsed.stream:
        return StreamingResponse(_events(run), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def collect() -> str:
        return "".join([piece async for piece in run.pieces()])

    # No body to stream: watch the connection ourselves, and cancel on a disconnect.
    work = asyncio.ensure_future(collect())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        return Response(status_code=499)  # nobody is listening; for the access log
    if work.exception() is not None:
        return error_response(api_error_of(work.exception()))
    return JSONResponse(run.whole(work.result()))


async def completions(request: Request) -> Response:
    return await _respond(request, chat=False)


async def chat_completions(request: Request) -> Response:
    return await _respond(request, chat=True)


async def models(request: Request) -> Response:
    state: ServeState = request.app.state.serve
    return JSONResponse({"object": "list", "data": [
        {"id": state.model_id, "object": "model", "created": 0, "owned_by": "edgespec"}]})


async def healthz(request: Request) -> Response:
    state: ServeState = request.app.state.serve
    c = state.counters
    return JSONResponse({"verifier": state.client is not None and state.client.info is not None,
                         "active": c.active, "completed": c.completed,
                         "cancelled": c.cancelled, "failed": c.failed})


async def not_found(request: Request, exc) -> Response:
    status = getattr(exc, "status_code", 404)
    return error_response(ApiError(status, f"{request.method} {request.url.path}: "
                                   f"{'no such route' if status == 404 else 'not allowed'}",
                                   code="not_found" if status == 404 else
                                   "method_not_allowed"))


ROUTES = [
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/healthz", healthz, methods=["GET"]),
]


def create_app(make_client: Callable[[], AsyncEdgeClient], options: ServeOptions,
               extra_routes: list | None = None) -> Starlette:
    """The app; ``make_client`` builds the client in the server's event loop (its gRPC
    channel belongs to that loop), connected by the lifespan."""
    state = ServeState(make_client, options)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        client = make_client()
        try:
            await client.connect()
            state.client = client
            yield
        finally:
            state.client = None
            await client.close()

    app = Starlette(routes=ROUTES + list(extra_routes or ()), lifespan=lifespan,
                    exception_handlers={404: not_found, 405: not_found})
    app.state.serve = state
    return app
