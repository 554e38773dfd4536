"""A simulated fleet of edge devices load-testing a verifier over real gRPC (grpc.aio).

Each of N asyncio clients is one device: its own channel (its own TCP connection), its own
network profile injected around every message (edge_client.netem), its own workload, and the
retry discipline of a production client:

- every call has a deadline (``deadline_s``; a Generate stream gets the rest of the window
  plus ``deadline_s``);
- RESOURCE_EXHAUSTED: back off and retry. The wait is the server's trailing "retry-after-ms"
  hint (RETRY_AFTER_DEFAULT_MS without one) doubled per attempt, capped at BACKOFF_CAP_S, with
  "equal jitter" (uniform in [wait/2, wait]), at most MAX_ATTEMPTS attempts;
- UNAVAILABLE or DEADLINE_EXCEEDED on Verify: the same backoff, resending the same round
  (round numbers make that idempotent). OpenSession is retried only on RESOURCE_EXHAUSTED,
  which the server answers before creating anything;
- NOT_FOUND whose details say "evicted": reopen with the full committed context
  (edge_client.rounds.GenerationRounds.reopen_request) and carry on; the output is unchanged.
  A Generate stream cut by an eviction, or by RESOURCE_EXHAUSTED after it made progress,
  resumes the same way (``generate_tokens``);
- ``RoundResult.suggested_draft_len`` caps the next K (GenerationRounds.next_k).

Modes: ``spec`` runs speculative rounds (OpenSession + unary Verify calls, the first round on
OpenSession); ``baseline`` is cloud-only decoding through the verifier's Generate stream (one
target forward per token, the same continuous batching).

Drafts (spec mode): ``model`` runs the ONNX draft on the client (in a worker thread, so the
event loop keeps serving the other devices); ``replay`` sends drafts recorded from the same
model, which takes edge CPU out of a server benchmark on a small machine. Recording (greedy
only, see ``ReplayBook``): the target's greedy continuation of every request of the workload,
from the verifier's Generate RPC (lossless verification commits exactly that), and the
model's K greedy drafts after every prefix of it. In greedy mode a proposal depends only on
the committed context, and the first k of K greedy drafts are the k drafts, so a replayed
proposal is exactly what the model would send whatever K the round uses. A context that is
not in the book (a near tie resolved differently under batching) falls back to the model and
is counted as a replay miss. Books are cached on disk per (target, draft, K).

Workloads: ``chat`` sends chat prompts (shared.prompts.CHAT_PROMPTS, then the held-out split
of edge_client.tools.distill_prompts) for long answers (``chat_tokens``). ``ime`` types
sentences word by word: after every 1-3 more words, the grown raw-text prefix is sent for a
completion of 4-12 tokens, with a typing pause (``think_ms``, +-50 %) before each request;
with ``ime_document`` the sentences are one document, so each prompt also holds every sentence
before the one being typed.
``mixed`` makes even-numbered clients chat and odd-numbered ones type.

Timing definitions (all times are when the device has the data, i.e. after the emulated
downlink delay; per-token figures count only what was delivered inside the window):

- a request's **TTFT** is from its start (before its first draft is made or its request is
  sent) to the delivery of its first token;
- a request's **TPOT** is (delivery of its last token - delivery of its first token) /
  (tokens - 1), over requests with at least 2 tokens. Tokens that arrive together (a
  speculative round) share one delivery time. A request cut by the end of the window counts
  with the tokens it had by then;
- percentiles are over requests, all clients together (per client: over its requests);
- **tokens/s** is tokens delivered inside the window / window length;
- round trips, target forwards and bytes (serialized protobuf, both directions, retries
  included) are per token delivered inside the window;
- server queue / forward ms per token add up the verifier's own timing fields as each
  session sees them (a forward shared by B sessions counts once for each of them).

Before the window, one uncounted request per workload kind warms the server up; clients then
start spread over ``ramp_s`` and run closed-loop (next request as soon as the last one ends,
after the think time) until the window closes, when in-flight requests are cancelled and
their sessions closed. Loops are bounded: requests per client, attempts per call, reopens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import math
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
import numpy as np

from edge_client.drafter import DraftSampling, ModelDrafter, Proposal
from edge_client.netem import PROFILES, NetEm, NetworkProfile, profile
from edge_client.rate_chooser import CONTINUE, SPEC, RateChooser
from edge_client.rounds import (
    NO_DRAFTS,
    GenerationRounds,
    ProtocolError,
    ServerLimits,
    SessionParams,
)
from edge_client.tokenizer import EdgeTokenizer
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_ATTEMPTS = 8
RETRY_AFTER_DEFAULT_MS = 100.0
BACKOFF_CAP_S = 5.0
MAX_REOPENS = 8  # reopens / resumes in a row without a new token
CLOSE_TIMEOUT_S = 5.0  # the server answers once the session's in-flight round is done
WORKLOADS = ("chat", "ime", "mixed")
MODES = ("spec", "baseline")
# How a spec client talks to the verifier: one Lookahead stream per generation, or a Verify
# round trip per round (falling back to Continue streams when drafting does not pay).
PROTOCOLS = ("lookahead", "rounds")
DRAFT_SOURCES = ("model", "replay")
PERCENTILES = (50, 95, 99)
REPLAY_FORMAT = 3  # bump when Recording changes


class NotLoopback(ValueError):
    """The fleet only load-tests a verifier on this machine."""


def require_loopback(address: str) -> None:
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror as err:
        raise NotLoopback(f"cannot resolve {host!r}: {err}") from err
    for info in infos:
        if not ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback:
            raise NotLoopback(f"{address} is not a loopback address; the fleet load test "
                              "only targets a verifier on this machine (127.0.0.1)")


# -- configuration ----------------------------------------------------------------------------


@dataclass(frozen=True)
class FleetConfig:
    clients: int = 4
    duration_s: float = 30.0
    profile: str = "4g"
    workload: str = "chat"
    mode: str = "spec"
    drafts: str = "replay"
    protocol: str = "lookahead"
    draft_len: int = 4
    # Greedy drafts carry the draft's confidences, and the server's draft_token_cost cuts them
    # (shared.draft_length); off: the suggested_draft_len alone decides (an A/B switch).
    confidence: bool = True
    # Spec clients pick drafting or Continue by measured rate (edge_client.rate_chooser);
    # off: draft whenever the server's suggestion allows.
    adaptive: bool = True
    chat_tokens: int = 128  # max new tokens of a chat answer
    # IME: the sentences are one document typed in order, so a prompt holds every sentence
    # before the one being typed (long, growing contexts); off: each sentence stands alone.
    ime_document: bool = False
    prompts: int = 8  # distinct chat prompts / IME sentences the clients cycle through
    think_ms: float | None = None  # pause before each request; None: 0 chat, 300 IME
    temperature: float = 0.0
    seed: int = 0
    deadline_s: float = 30.0
    ramp_s: float = 1.0  # clients start spread uniformly over this long
    progress: bool = True
    warm_up: bool = True  # one uncounted request per kind before the window
    keep_outputs: bool = False  # put every request's output tokens in the result (tests)
    max_requests: int = 100_000  # per client: the load ends at this count or the window's end

    def __post_init__(self) -> None:
        if not 1 <= self.clients <= 1024:
            raise ValueError("clients must be in [1, 1024]")
        if not 0 < self.duration_s <= 3600:
            raise ValueError("duration_s must be in (0, 3600]")
        profile(self.profile)
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}")
        if self.drafts not in DRAFT_SOURCES:
            raise ValueError(f"drafts must be one of {', '.join(DRAFT_SOURCES)}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}")
        if self.drafts == "replay" and self.temperature != 0 and self.mode == "spec":
            raise ValueError("replayed drafts need greedy decoding (temperature 0): a replayed "
                             "sample is not a fresh draw from its q, so sampling would not be "
                             "lossless")
        if (self.draft_len < 0 or self.chat_tokens < 1 or self.prompts < 1
                or self.max_requests < 1):
            raise ValueError("draft_len must be >= 0; chat_tokens, prompts and max_requests "
                             ">= 1")
        if self.deadline_s <= 0 or self.ramp_s < 0:
            raise ValueError("deadline_s must be > 0 and ramp_s >= 0")


# -- workloads --------------------------------------------------------------------------------

# Sentences the simulated IME users type, word by word (written for this benchmark).
IME_SENTENCES: tuple[str, ...] = (
    "I will be a few minutes late because the bus did not come on time this morning",
    "Could you send me the slides from yesterday so I can review them before lunch",
    "Thanks for dinner last night, the pasta was great and we should do it again soon",
    "The package should arrive on Thursday but let me know if it does not show up",
    "Let us move the weekly sync to Friday afternoon since half the team is away",
    "Remember to pick up milk and bread on the way home from the office tonight",
    "I have attached the signed contract and a copy of the invoice for your records",
    "Happy birthday to my favourite sister, I hope your day is full of good surprises",
    "The build failed again on the main branch, I think the new test is flaky",
    "We are planning a short hike on Sunday morning if the weather stays dry",
    "Please water the plants on the balcony while I am travelling next week",
    "Our flight lands at seven so we should be at the hotel around nine",
    "Can we talk about the budget for next quarter before the board meeting",
    "The doctor said the results look fine and there is nothing to worry about",
    "I finished reading the book you lent me and I loved the ending",
    "Do not forget that the library closes early on public holidays",
)


@dataclass(frozen=True)
class Request:
    kind: str  # "chat" or "ime"
    prompt_ids: tuple[int, ...]
    max_new_tokens: int

    @property
    def key(self) -> str:
        """Greedy continuations of one prompt are prefixes of each other: the prompt alone
        keys a recording."""
        return ",".join(map(str, self.prompt_ids))


def chat_requests(tokenizer: EdgeTokenizer, count: int, max_new_tokens: int,
                  max_context: int) -> list[Request]:
    from shared.prompts import CHAT_PROMPTS

    texts = list(CHAT_PROMPTS)
    if count > len(texts):
        from edge_client.tools.distill_prompts import prompt_split

        texts += [p.text for p in prompt_split("heldout") if p.chat and p.kind == "chat"]
    out = []
    for text in texts:
        ids = tokenizer.encode_chat(text)
        n = min(max_new_tokens, max_context - len(ids) - 1)
        if ids and n >= 1:
            out.append(Request("chat", tuple(ids), n))
        if len(out) == count:
            break
    if not out:
        raise ValueError("no chat prompt fits the verifier's context")
    return out


def ime_requests(tokenizer: EdgeTokenizer, count: int, max_context: int,
                 seed: int, document: bool = False) -> list[list[Request]]:
    """Per sentence, its typing session: requests over ever longer prefixes (of the sentence
    alone, or with ``document`` of the text of every sentence before it too)."""
    rng = np.random.default_rng([seed, 7])
    sessions = []
    for i, sentence in enumerate(IME_SENTENCES[:count]):
        before = list(IME_SENTENCES[:i]) if document else []
        words = sentence.split()
        typed = int(rng.integers(1, 4))
        requests = []
        while typed <= len(words):
            ids = tokenizer.encode(" ".join(before + words[:typed]))
            n = min(int(rng.integers(4, 13)), max_context - len(ids) - 1)
            if ids and n >= 1:
                requests.append(Request("ime", tuple(ids), n))
            typed += int(rng.integers(1, 4))
        if requests:
            sessions.append(requests)
    if not sessions:
        raise ValueError("no IME prefix fits the verifier's context")
    return sessions


@dataclass(frozen=True)
class Workload:
    chat: list[Request]
    ime: list[list[Request]]

    def kind_of(self, name: str, client: int) -> str:
        return name if name != "mixed" else ("chat" if client % 2 == 0 else "ime")

    def schedule(self, kind: str, client: int, count: int) -> Iterator[Request]:
        """Client ``client``'s first ``count`` requests, in order, cycling."""
        if kind == "chat":
            order = [self.chat[(client + j) % len(self.chat)] for j in range(len(self.chat))]
        else:
            order = [r for j in range(len(self.ime))
                     for r in self.ime[(client + j) % len(self.ime)]]
        for i in range(count):
            yield order[i % len(order)]

    def all_requests(self, name: str, clients: int) -> list[Request]:
        kinds = {self.kind_of(name, i) for i in range(clients)}
        out = list(self.chat) if "chat" in kinds else []
        if "ime" in kinds:
            out += [r for s in self.ime for r in s]
        return out


def build_workload(tokenizer: EdgeTokenizer, config: FleetConfig, max_context: int) -> Workload:
    chat = (chat_requests(tokenizer, config.prompts, config.chat_tokens, max_context)
            if config.workload in ("chat", "mixed") else [])
    ime = (ime_requests(tokenizer, config.prompts, max_context, config.seed,
                        config.ime_document)
           if config.workload in ("ime", "mixed") else [])
    return Workload(chat, ime)


# -- one device's connection ------------------------------------------------------------------


def _is_evicted(err: grpc.aio.AioRpcError) -> bool:
    return err.code() == grpc.StatusCode.NOT_FOUND and "evicted" in (err.details() or "")


def _lost_to_a_write(err: grpc.aio.AioRpcError) -> bool:
    """grpc.aio reports a write that met a stream the server had just ended as this INTERNAL
    error, in place of the server's own status (grpc/grpc#36066): on a Lookahead stream,
    whose drafts go up while steps come down, the real status (an eviction, a full KV budget)
    is lost. Reopening with the committed context is always safe; the output is unchanged."""
    return (err.code() == grpc.StatusCode.INTERNAL
            and (err.details() or "") == "Internal error from Core")


def _retry_after_ms(err: grpc.aio.AioRpcError) -> float | None:
    for key, value in err.trailing_metadata() or ():
        if key == "retry-after-ms":
            with contextlib.suppress(ValueError):
                return max(0.0, float(value))
    return None


@dataclass
class Pending:
    """Costs not yet charged to delivered tokens (a retry's bytes go to the next delivery)."""

    round_trips: int = 0
    bytes_up: int = 0
    bytes_down: int = 0


class DeviceLink:
    """One device's channel to the verifier, with emulated network and retry policy."""

    def __init__(self, address: str, netem: NetEm, deadline_s: float, window_end: float,
                 rng: np.random.Generator, errors: Counter) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ])
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.netem = netem
        self.deadline_s = deadline_s
        self.window_end = window_end
        self.rng = rng
        self.errors = errors
        self.pending = Pending()
        self.backoff_s = 0.0

    async def close(self) -> None:
        await self.channel.close()

    def take_pending(self) -> Pending:
        p, self.pending = self.pending, Pending()
        return p

    async def _until(self, t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)

    async def _up(self, request) -> None:
        size = request.ByteSize()
        self.pending.bytes_up += size
        if self.netem.enabled:
            await self._until(self.netem.up.deliver_at(time.perf_counter(), size))

    async def _down(self, size: int) -> float:
        self.pending.bytes_down += size
        if not self.netem.enabled:
            return time.perf_counter()
        at = self.netem.down.deliver_at(time.perf_counter(), size)
        await self._until(at)
        return at

    async def backoff(self, attempt: int, hint_ms: float | None) -> None:
        wait = min(BACKOFF_CAP_S, (hint_ms if hint_ms is not None else RETRY_AFTER_DEFAULT_MS)
                   / 1000 * 2 ** attempt)
        wait = float(self.rng.uniform(wait / 2, wait))
        self.backoff_s += wait
        await asyncio.sleep(wait)

    async def unary(self, method: str, request, retry_on: tuple[grpc.StatusCode, ...]):
        """One call with the retry policy; every attempt is one round trip."""
        call = getattr(self.stub, method)
        for attempt in range(MAX_ATTEMPTS):
            await self._up(request)
            self.pending.round_trips += 1
            try:
                reply = await call(request, timeout=self.deadline_s)
            except grpc.aio.AioRpcError as err:
                await self._down(len((err.details() or "").encode()))
                self.errors[err.code().name] += 1
                retryable = err.code() in retry_on + (grpc.StatusCode.RESOURCE_EXHAUSTED,)
                if not retryable or attempt + 1 == MAX_ATTEMPTS:
                    raise
                await self.backoff(attempt, _retry_after_ms(err))
                continue
            await self._down(reply.ByteSize())
            return reply
        raise AssertionError("unreachable")

    async def stream(self, method: str, request) -> AsyncIterator[tuple[float, object]]:
        """A server stream (Generate, Continue) as (delivery time, message); retried on
        RESOURCE_EXHAUSTED while nothing arrived.

        Messages are read as soon as gRPC has them; each one's delivery time is computed on
        the emulated downlink (in order), and the stream's end waits for the last one.
        """
        for attempt in range(MAX_ATTEMPTS):
            await self._up(request)
            self.pending.round_trips += 1
            timeout = max(0.0, self.window_end - time.perf_counter()) + self.deadline_s
            call = getattr(self.stub, method)(request, timeout=timeout)
            received = False
            last = time.perf_counter()
            try:
                async for msg in call:
                    received = True
                    last = self._arrived(msg)
                    yield last, msg
            except grpc.aio.AioRpcError as err:
                await self._retry_stream(err, received, attempt)
                continue
            finally:
                call.cancel()
            await self._until(last)
            return

    def _arrived(self, msg) -> float:
        """Counts a message that just arrived; returns its emulated delivery time."""
        size = msg.ByteSize()
        self.pending.bytes_down += size
        return (self.netem.down.deliver_at(time.perf_counter(), size) if self.netem.enabled
                else time.perf_counter())

    async def _retry_stream(self, err: grpc.aio.AioRpcError, received: bool,
                            attempt: int) -> None:
        """A stream failed: re-raises unless nothing arrived and the answer was
        RESOURCE_EXHAUSTED with attempts left, in which case it backs off."""
        await self._down(len((err.details() or "").encode()))
        self.errors[err.code().name] += 1
        if received or err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED \
                or attempt + 1 == MAX_ATTEMPTS:
            raise err
        await self.backoff(attempt, _retry_after_ms(err))


    async def duplex(self, method: str, first, outbox: Outbox
                     ) -> AsyncIterator[tuple[float, object]]:
        """A bidirectional stream (Lookahead): ``first``, then whatever ``outbox`` is given,
        each over the emulated uplink; yields each reply at its emulated delivery time.
        Retried on RESOURCE_EXHAUSTED while nothing arrived."""
        for attempt in range(MAX_ATTEMPTS):
            self.pending.round_trips += 1
            timeout = max(0.0, self.window_end - time.perf_counter()) + self.deadline_s
            call = getattr(self.stub, method)(timeout=timeout)
            inbox: asyncio.Queue = asyncio.Queue()

            async def send(call=call) -> None:
                message = first
                while True:
                    await self._up(message)
                    await call.write(message)
                    message = await outbox.get()

            async def receive(call=call, inbox=inbox) -> None:
                # Read as soon as gRPC has a message, so that delivery times are exact.
                try:
                    while (msg := await call.read()) is not grpc.aio.EOF:
                        inbox.put_nowait((self._arrived(msg), msg))
                    inbox.put_nowait(None)
                except grpc.aio.AioRpcError as err:
                    inbox.put_nowait(err)

            tasks = [asyncio.ensure_future(send()), asyncio.ensure_future(receive())]
            received = False
            try:
                while (item := await inbox.get()) is not None:
                    if isinstance(item, grpc.aio.AioRpcError):
                        raise item
                    await self._until(item[0])
                    received = True
                    yield item
            except grpc.aio.AioRpcError as err:
                await self._retry_stream(err, received, attempt)
                continue
            finally:
                call.cancel()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            return


class Outbox:
    """The next message for a stream's uplink: a newer one replaces one not yet sent."""

    def __init__(self) -> None:
        self._message = None
        self._ready = asyncio.Event()

    def put(self, message) -> None:
        self._message = message
        self._ready.set()

    async def get(self):
        await self._ready.wait()
        self._ready.clear()
        message, self._message = self._message, None
        return message


# -- drafts -----------------------------------------------------------------------------------


@dataclass
class Recording:
    """The target's greedy continuation of one request and the model's drafts along it."""

    max_new_tokens: int
    continuation: list[int]
    proposals: list[list[int]]  # [j]: K greedy drafts after prompt + continuation[:j]
    confidences: list[list[float]]  # [j]: the draft's probability of each of them

    def covers(self, request: Request) -> bool:
        return (self.max_new_tokens >= request.max_new_tokens
                or len(self.continuation) < self.max_new_tokens)  # it ended on a stop token


class ReplayBook:
    """Recorded greedy proposals per request, cached as JSON on disk."""

    def __init__(self, path: Path | None, identity: dict) -> None:
        self.path = path
        self.identity = identity
        self.recordings: dict[str, Recording] = {}
        if path is not None and path.exists():
            import json

            data = json.loads(path.read_text())
            if data.get("identity") == identity:
                self.recordings = {k: Recording(**v) for k, v in data["recordings"].items()}

    def save(self) -> None:
        if self.path is None:
            return
        import json

        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"identity": self.identity, "recordings": {
            k: asdict(v) for k, v in self.recordings.items()}}))
        tmp.replace(self.path)

    def lookup(self, request: Request, committed: list[int], k: int) -> Proposal | None:
        rec = self.recordings.get(request.key)
        if rec is None:
            return None
        j = len(committed) - len(request.prompt_ids)
        if j >= len(rec.proposals) or committed[len(request.prompt_ids):] != \
                rec.continuation[:j] or len(rec.proposals[j]) < k:
            return None
        return Proposal(rec.proposals[j][:k], None, rec.confidences[j][:k])


def draft_identity(draft_dir: Path) -> list:
    """What the recorded drafts depend on: the draft model's files (name, size, mtime)."""
    return sorted([p.name, p.stat().st_size, p.stat().st_mtime_ns]
                  for p in Path(draft_dir).iterdir() if p.is_file())


def greedy_proposals(model, prompt: list[int], continuation: list[int],
                     k: int) -> list[Proposal]:
    drafter = ModelDrafter(model, DraftSampling(), np.random.default_rng(0))
    return [drafter.propose(prompt + continuation[:j], k) for j in range(len(continuation))]


async def record_replay(book: ReplayBook, address: str, requests: list[Request],
                        model_factory: Callable, k: int, vocab_size: int,
                        concurrency: int = 8, progress: bool = True) -> int:
    """Records every request missing from the book; returns how many were recorded."""
    longest: dict[str, Request] = {}
    for r in requests:
        if r.key not in longest or r.max_new_tokens > longest[r.key].max_new_tokens:
            longest[r.key] = r
    todo = [r for r in longest.values()
            if r.key not in book.recordings or not book.recordings[r.key].covers(r)]
    if not todo:
        return 0
    from tqdm import tqdm

    errors: Counter = Counter()
    link = DeviceLink(address, NetEm(profile("none"), np.random.default_rng(0)), 600.0,
                      time.perf_counter(), np.random.default_rng(0), errors)
    gate = asyncio.Semaphore(concurrency)
    model = model_factory()
    bar = tqdm(total=len(todo), desc="recording drafts", unit="req", file=sys.stderr,
               disable=not progress)

    async def one(req: Request) -> None:
        async with gate:
            tokens: list[int] = []
            async with contextlib.aclosing(generate_tokens(
                    link, list(req.prompt_ids), SessionParams(req.max_new_tokens),
                    vocab_size, [0])) as stream:
                async for _, ids, _ in stream:
                    tokens.extend(ids)
        proposals = await asyncio.to_thread(greedy_proposals, model, list(req.prompt_ids),
                                            tokens, k)
        book.recordings[req.key] = Recording(req.max_new_tokens, tokens,
                                             [p.tokens for p in proposals],
                                             [p.confidence or [] for p in proposals])
        bar.update(1)

    try:
        await asyncio.gather(*(one(r) for r in todo))
    finally:
        bar.close()
        await link.close()
    book.save()
    return len(todo)


class DraftSource:
    """Proposals for one device: the ONNX model, or the replay book (model on a miss)."""

    def __init__(self, kind: str, model_factory: Callable, sampling: DraftSampling,
                 book: ReplayBook | None, confidence: bool = True) -> None:
        self.kind = kind
        self.confidence = confidence
        self._model_factory = model_factory
        self.sampling = sampling
        self.book = book
        self.hits = 0
        self.misses = 0
        self.draft_s = 0.0

    def start(self, request: Request, rng: np.random.Generator) -> Callable:
        """A propose(committed, k) coroutine function for one request."""
        drafter: list[ModelDrafter] = []

        async def from_model(committed: list[int], k: int) -> Proposal:
            if not drafter:
                drafter.append(ModelDrafter(self._model_factory(), self.sampling, rng))
            t0 = time.perf_counter()
            proposal = await asyncio.to_thread(drafter[0].propose, list(committed), k)
            self.draft_s += time.perf_counter() - t0
            return proposal

        async def propose(committed: list[int], k: int) -> Proposal:
            proposal = await lookup_or_draft(committed, k)
            return proposal if self.confidence else Proposal(proposal.tokens, proposal.q)

        async def lookup_or_draft(committed: list[int], k: int) -> Proposal:
            if self.book is None or k == 0:
                return await from_model(committed, k) if k else NO_DRAFTS
            proposal = self.book.lookup(request, committed, k)
            if proposal is not None:
                self.hits += 1
                return proposal
            self.misses += 1
            return await from_model(committed, k)

        return propose


# -- one device -------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    kind: str
    start: float
    # (delivery time, tokens, target forwards, round trips, bytes up, bytes down,
    #  server queue s, server forward s)
    events: list[tuple] = field(default_factory=list)
    completed: bool = False
    failed: str | None = None
    reopens: int = 0
    drafted: int = 0
    accepted: int = 0
    drafting_forwards: int = 0  # target forwards that verified at least one draft
    continued: int = 0  # tokens from Continue streams (server-side decoding)
    prompt_key: str = ""
    max_new_tokens: int = 0
    output: list[int] = field(default_factory=list)  # every token received


class Device:
    def __init__(self, index: int, kind: str, config: FleetConfig, link: DeviceLink,
                 limits: ServerLimits, drafts: DraftSource | None, schedule: Iterator[Request],
                 rng: np.random.Generator) -> None:
        self.index = index
        self.kind = kind
        self.config = config
        self.link = link
        self.limits = limits
        self.drafts = drafts
        self.schedule = schedule
        self.rng = rng
        self.records: list[RequestRecord] = []
        # Drafting vs Continue by measured rate, across this device's generations.
        self.chooser = RateChooser() if config.adaptive else None
        think = config.think_ms if config.think_ms is not None else (300.0 if kind == "ime"
                                                                     else 0.0)
        self.think_s = think / 1000

    async def run(self, start_delay_s: float) -> None:
        await asyncio.sleep(start_delay_s)
        for n, request in enumerate(self.schedule):
            if self.think_s:
                await asyncio.sleep(self.think_s * float(self.rng.uniform(0.5, 1.5)))
            record = RequestRecord(request.kind, time.perf_counter(), prompt_key=request.key,
                                   max_new_tokens=request.max_new_tokens)
            self.records.append(record)
            params = SessionParams(max_new_tokens=request.max_new_tokens,
                                   temperature=self.config.temperature,
                                   seed=(self.config.seed * 1_000_003 + self.index * 10_007 + n)
                                   % 2**63)
            try:
                if self.config.mode == "spec" and self.config.protocol == "lookahead":
                    await self._lookahead(request, params, record)
                elif self.config.mode == "spec":
                    await self._spec(request, params, record)
                else:
                    await self._baseline(request, params, record)
                record.completed = True
            except grpc.aio.AioRpcError as err:
                record.failed = err.code().name
                log.info("client %d: request failed with %s: %s", self.index,
                         err.code().name, err.details())
            except ProtocolError as err:
                record.failed = "PROTOCOL_ERROR"
                self.link.errors["PROTOCOL_ERROR"] += 1
                log.warning("client %d: %s", self.index, err)
            if record.failed:
                await asyncio.sleep(0.1)  # do not spin on a failing server

    def _event(self, record: RequestRecord, at: float, tokens: int, forwards: int,
               timing: pb.Timing) -> None:
        p = self.link.take_pending()
        record.events.append((at, tokens, forwards, p.round_trips, p.bytes_up, p.bytes_down,
                              timing.queue_ns / 1e9, timing.forward_ns / 1e9))

    async def _spec(self, request: Request, params: SessionParams,
                    record: RequestRecord) -> None:
        assert self.drafts is not None
        rounds = GenerationRounds(list(request.prompt_ids), params, self.limits,
                                  self.config.draft_len, chooser=self.chooser)
        propose = self.drafts.start(request, np.random.default_rng(params.seed))
        session_id: str | None = None
        retry_verify = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        try:
            proposal = rounds.worth_sending(await propose(rounds.committed, rounds.next_k()))
            opened = await self.link.unary("OpenSession", rounds.open_request(proposal), ())
            session_id = opened.session_id
            self._apply(record, rounds, proposal, opened.first_round, time.perf_counter())
            while not rounds.finished:
                proposal = None
                before = len(rounds.committed)
                try:
                    if rounds.wants_continue():  # drafting does not pay: the server decodes
                        t0 = at = time.perf_counter()
                        async with contextlib.aclosing(self.link.stream(
                                "Continue", rounds.continue_request(session_id))) as stream:
                            async for at, result in stream:
                                self._apply(record, rounds, NO_DRAFTS, result, at)
                        record.continued += len(rounds.committed) - before
                        rounds.observe(CONTINUE, len(rounds.committed) - before, at - t0)
                        continue
                    t0 = time.perf_counter()
                    proposal = rounds.worth_sending(
                        await propose(rounds.committed, rounds.next_k()))
                    result = (await self.link.unary(
                        "Verify", rounds.verify_request(session_id, proposal),
                        retry_verify)).result
                    now = time.perf_counter()
                    rounds.observe(SPEC, self._apply(record, rounds, proposal, result, now),
                                   now - t0)
                except grpc.aio.AioRpcError as err:
                    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED \
                            and len(rounds.committed) > before:
                        # A Continue stream cut after progress (the KV budget was full for
                        # its next round): nothing lost; back off and carry on.
                        await self.link.backoff(0, _retry_after_ms(err))
                        continue
                    # Every reopen commits at least one token (its first round), so the
                    # generation always progresses; the bound only guards a broken server.
                    if not _is_evicted(err) or \
                            rounds.reopens >= MAX_REOPENS + request.max_new_tokens:
                        raise
                    record.reopens += 1
                    session_id = None
                    if proposal is None:  # evicted during a Continue stream
                        proposal = rounds.worth_sending(
                            await propose(rounds.committed, rounds.next_k()))
                    opened = await self.link.unary("OpenSession",
                                                   rounds.reopen_request(proposal), ())
                    session_id = opened.session_id
                    self._apply(record, rounds, proposal, opened.first_round,
                                time.perf_counter())
            session_id = None  # finished: the server closed it
        finally:
            if session_id is not None:  # cut short: free the server's KV cache now
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                    await asyncio.wait_for(self.link.stub.CloseSession(
                        pb.CloseSessionRequest(session_id=session_id),
                        timeout=CLOSE_TIMEOUT_S), CLOSE_TIMEOUT_S)

    async def _lookahead(self, request: Request, params: SessionParams,
                         record: RequestRecord) -> None:
        """One Lookahead stream per generation (reopened over the committed text after an
        eviction): the server decodes back to back; after every step the client drafts
        ahead of what it has and sends that lookahead."""
        assert self.drafts is not None
        rounds = GenerationRounds(list(request.prompt_ids), params, self.limits,
                                  self.config.draft_len)
        propose = self.drafts.start(request, np.random.default_rng(params.seed))
        stalled = 0
        while not rounds.finished:
            before = len(rounds.committed)
            first = await propose(rounds.committed, rounds.lookahead_len(opening=True))
            outbox = Outbox()
            try:
                async with contextlib.aclosing(self.link.duplex(
                        "Lookahead", pb.LookaheadRequest(open=rounds.open_request(first)),
                        outbox)) as stream:
                    async for at, step in stream:
                        new = rounds.apply_step(step)
                        record.output.extend(new)
                        self._event(record, at, len(new), 1, step.timing)
                        record.drafted += step.num_drafted
                        record.accepted += step.num_accepted
                        record.drafting_forwards += step.num_drafted > 0
                        if rounds.finished:
                            break  # the server keeps the stream open until we end it
                        if rounds.lookahead_len():
                            outbox.put(rounds.lookahead_request(
                                await propose(rounds.committed, rounds.lookahead_len())))
                if not rounds.finished:
                    raise ProtocolError("the Lookahead stream ended before the generation "
                                        "finished")
            except grpc.aio.AioRpcError as err:
                progressed = len(rounds.committed) > before
                stalled = 0 if progressed else stalled + 1
                exhausted = err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and progressed
                if not (_is_evicted(err) or exhausted or _lost_to_a_write(err)) \
                        or stalled >= MAX_REOPENS:
                    raise
                record.reopens += 1
                if exhausted:  # the KV budget was full for its next forward: back off
                    await self.link.backoff(0, _retry_after_ms(err))

    def _apply(self, record: RequestRecord, rounds: GenerationRounds, proposal: Proposal,
               result: pb.RoundResult, at: float) -> int:
        """Applies one round's result delivered at ``at``; returns the tokens it added."""
        new = rounds.apply(proposal, result)
        record.output.extend(new)
        self._event(record, at, len(new), result.target_forwards, result.timing)
        record.drafted += len(proposal.tokens)
        record.accepted += result.num_accepted
        record.drafting_forwards += bool(proposal.tokens) and result.target_forwards > 0
        return len(new)

    async def _baseline(self, request: Request, params: SessionParams,
                        record: RequestRecord) -> None:
        resumes = [0]
        try:
            async with contextlib.aclosing(generate_tokens(
                    self.link, list(request.prompt_ids), params, self.limits.vocab_size,
                    resumes)) as stream:
                async for at, ids, timing in stream:
                    record.output.extend(ids)
                    self._event(record, at, len(ids), 1, timing)
        finally:
            record.reopens += resumes[0]


async def generate_tokens(link: DeviceLink, prompt_ids: list[int], params: SessionParams,
                          vocab_size: int, resumes: list[int]
                          ) -> AsyncIterator[tuple[float, list[int], pb.Timing]]:
    """Cloud-only generation as (delivery time, new tokens, server timing), resumed when
    cut short.

    A stream cut by an eviction (NOT_FOUND "evicted") or, after progress, by
    RESOURCE_EXHAUSTED (backing off first) resumes as a new Generate over the prompt plus
    the tokens received, for the tokens that remain; the output is unchanged.
    ``resumes[0]`` counts the resumptions; at most MAX_REOPENS in a row without a token.
    """
    received: list[int] = []
    stalled = 0
    while True:
        remaining = params.max_new_tokens - len(received)
        request = pb.GenerateRequest(
            prompt_token_ids=prompt_ids + received,
            sampling=pb.SamplingParams(temperature=params.temperature, top_k=params.top_k,
                                       top_p=params.top_p, seed=params.seed),
            max_new_tokens=remaining, stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos)
        before = len(received)
        try:
            async with contextlib.aclosing(link.stream("Generate", request)) as stream:
                async for at, msg in stream:
                    ids = list(msg.token_ids)
                    if any(not 0 <= t < vocab_size for t in ids) \
                            or len(received) + len(ids) > params.max_new_tokens:
                        raise ProtocolError(f"Generate sent {ids} after {len(received)} tokens")
                    received.extend(ids)
                    yield at, ids, msg.timing
            return
        except grpc.aio.AioRpcError as err:
            progressed = len(received) > before
            exhausted = err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and progressed
            stalled = 0 if progressed else stalled + 1
            if not (_is_evicted(err) or exhausted) or stalled >= MAX_REOPENS \
                    or len(received) >= params.max_new_tokens:
                raise
            resumes[0] += 1
            if exhausted:
                await link.backoff(resumes[0] - 1, _retry_after_ms(err))


# -- the run ----------------------------------------------------------------------------------


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _summarize(records: list[RequestRecord], window_s: float,
               end: float) -> tuple[dict, list[float], list[float]]:
    tokens = forwards = trips = up = down = 0
    queue_s = forward_s = 0.0
    tpot_ms: list[float] = []
    ttft_ms: list[float] = []
    drafted = accepted = drafting_forwards = 0
    for r in records:
        events = [e for e in r.events if e[0] <= end]
        n = sum(e[1] for e in events)
        tokens += n
        forwards += sum(e[2] for e in events)
        trips += sum(e[3] for e in events)
        up += sum(e[4] for e in events)
        down += sum(e[5] for e in events)
        queue_s += sum(e[6] for e in events)
        forward_s += sum(e[7] for e in events)
        drafted += r.drafted
        drafting_forwards += r.drafting_forwards
        accepted += r.accepted
        if n >= 1:
            ttft_ms.append((events[0][0] - r.start) * 1000)
        if n >= 2:
            tpot_ms.append((events[-1][0] - events[0][0]) / (n - 1) * 1000)

    def per_token(x: float) -> float | None:
        return x / tokens if tokens else None

    out = {
        "tokens": tokens,
        "tokens_per_s": tokens / window_s,
        "requests_started": len(records),
        "requests_completed": sum(r.completed for r in records),
        "requests_failed": sum(r.failed is not None for r in records),
        "requests_failed_by_status": dict(Counter(r.failed for r in records if r.failed)),
        "reopens": sum(r.reopens for r in records),
        "round_trips_per_token": per_token(trips),
        "target_forwards_per_token": per_token(forwards),
        "bytes_per_token": per_token(up + down),
        "bytes_up_per_token": per_token(up),
        "bytes_down_per_token": per_token(down),
        "drafted_per_token": per_token(drafted),
        "acceptance_rate": accepted / drafted if drafted else None,
        # Share of the target forwards that verified drafts (spec mode).
        "drafting_forward_share": drafting_forwards / forwards if forwards else None,
        # Share of the tokens that came from Continue streams (spec mode).
        "continued_share": per_token(sum(r.continued for r in records)),
        # Server-side time (RoundResult / GenerateResponse timing) per token delivered.
        "server_queue_ms_per_token": per_token(queue_s * 1000),
        "server_forward_ms_per_token": per_token(forward_s * 1000),
    }
    for q in PERCENTILES:
        out[f"tpot_ms_p{q}"] = _pct(tpot_ms, q)
    for q in PERCENTILES:
        out[f"ttft_ms_p{q}"] = _pct(ttft_ms, q)
    out["tpot_samples"] = len(tpot_ms)
    return out, tpot_ms, ttft_ms


def check_compatible(info: pb.GetInfoResponse, tokenizer: EdgeTokenizer) -> None:
    if info.tokenizer_fingerprint != tokenizer.fingerprint:
        raise ValueError(f"the verifier serves {info.target_model!r} whose tokenizer differs "
                         "from the draft's; token ids would mean different text")


async def run_fleet_async(address: str, config: FleetConfig, draft_dir: Path,
                          replay_cache: Path | None = None) -> dict:
    require_loopback(address)
    tokenizer = EdgeTokenizer(draft_dir)
    async with grpc.aio.insecure_channel(address) as channel:
        info = await pb_grpc.VerifierStub(channel).GetInfo(pb.GetInfoRequest(),
                                                           timeout=config.deadline_s)
    check_compatible(info, tokenizer)
    limits = ServerLimits.from_info(info)
    workload = build_workload(tokenizer, config, limits.max_context)
    prof = profile(config.profile)

    models: list = []

    def model_factory():
        if not models:
            from edge_client.draft_model import OnnxDraftModel

            models.append(OnnxDraftModel(draft_dir, intra_op_threads=1))
        return models[0]

    book = None
    recorded = 0
    k = min(config.draft_len, limits.max_draft_len)
    if config.protocol == "lookahead":  # GenerationRounds.lookahead_len
        k = min(2 * config.draft_len + 1, limits.max_draft_len)
    if config.mode == "spec" and config.drafts == "replay":
        identity = {"format": REPLAY_FORMAT, "target": info.target_model,
                    "tokenizer": info.tokenizer_fingerprint,
                    "draft": draft_identity(draft_dir), "k": k}
        path = replay_cache
        if path is None:
            import hashlib
            import json

            from shared.paths import cache_dir

            digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
            path = cache_dir() / "fleet-replay" / f"{digest[:16]}.json"
        book = ReplayBook(path, identity)
        recorded = await record_replay(book, address, workload.all_requests(
            config.workload, config.clients), model_factory, k, limits.vocab_size,
            progress=config.progress)

    sampling = DraftSampling(temperature=config.temperature)
    errors: list[Counter] = []
    devices: list[Device] = []
    drafts: list[DraftSource] = []
    if config.warm_up:
        await _warm_up(address, config, workload, limits, model_factory, book, sampling)
    start = time.perf_counter()
    end = start + config.duration_s
    for i in range(config.clients):
        rng = np.random.default_rng([config.seed, i])
        err = Counter()
        errors.append(err)
        kind = workload.kind_of(config.workload, i)
        source = (DraftSource(config.drafts, model_factory, sampling, book, config.confidence)
                  if config.mode == "spec" else None)
        if source is not None:
            drafts.append(source)
        link = DeviceLink(address, NetEm(prof, np.random.default_rng([config.seed, i, 1])),
                          config.deadline_s, end, rng, err)
        devices.append(Device(i, kind, config, link, limits, source,
                              workload.schedule(kind, i, config.max_requests), rng))
    tasks = [asyncio.ensure_future(d.run(config.ramp_s * i / config.clients))
             for i, d in enumerate(devices)]
    await _progress(config, tasks, devices, end)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for d in devices:
        await d.link.close()
    return _report(address, config, info, prof, devices, drafts, errors, end - start, end,
                   recorded)


async def _warm_up(address: str, config: FleetConfig, workload: Workload, limits: ServerLimits,
                   model_factory: Callable, book: ReplayBook | None,
                   sampling: DraftSampling) -> None:
    """One short uncounted request per request kind, so that first-call costs (connection
    set-up, the server's first forward of a shape) stay out of the window."""
    kinds = sorted({workload.kind_of(config.workload, i) for i in range(config.clients)})
    for kind in kinds:
        request = next(workload.schedule(kind, 0, 1))
        request = dataclasses.replace(request, max_new_tokens=min(
            request.max_new_tokens, 2 * config.draft_len + 2))
        link = DeviceLink(address, NetEm(profile("none"), np.random.default_rng(0)),
                          config.deadline_s, time.perf_counter() + config.deadline_s,
                          np.random.default_rng(0), Counter())
        source = (DraftSource(config.drafts, model_factory, sampling, book, config.confidence)
                  if config.mode == "spec" else None)
        device = Device(-1, kind, dataclasses.replace(config, think_ms=0.0), link, limits,
                        source, iter([request]), np.random.default_rng(0))
        try:
            await asyncio.wait_for(device.run(0.0), config.deadline_s)
        finally:
            await link.close()


async def _progress(config: FleetConfig, tasks: list[asyncio.Task], devices: list[Device],
                    end: float) -> None:
    """Waits out the window (or all clients ending early), with a progress bar on stderr."""
    from tqdm import tqdm

    bar = tqdm(total=round(config.duration_s), unit="s", file=sys.stderr,
               disable=not config.progress, desc=f"{config.mode} x{config.clients}",
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}")
    all_done = asyncio.ensure_future(asyncio.wait(tasks))
    try:
        while (left := end - time.perf_counter()) > 0 and not all_done.done():
            await asyncio.wait([all_done], timeout=min(0.5, left))
            tokens = sum(e[1] for d in devices for r in d.records for e in r.events)
            errors = sum(sum(d.link.errors.values()) for d in devices)
            bar.n = min(config.duration_s, config.duration_s - max(0.0, end -
                                                                   time.perf_counter()))
            bar.set_postfix(tokens=tokens, errors=errors, refresh=True)
    finally:
        all_done.cancel()
        bar.close()


def _report(address: str, config: FleetConfig, info: pb.GetInfoResponse,
            prof: NetworkProfile, devices: list[Device], drafts: list[DraftSource],
            errors: list[Counter], window_s: float, end: float, recorded: int) -> dict:
    per_client = []
    all_records: list[RequestRecord] = []
    for d, err in zip(devices, errors, strict=True):
        summary, _, _ = _summarize(d.records, window_s, end)
        summary.update(client=d.index, workload=d.kind, errors=dict(err),
                       network_retransmits=d.link.netem.retransmits,
                       backoff_s=d.link.backoff_s)
        if d.drafts is not None:
            summary.update(draft_s=d.drafts.draft_s, replay_hits=d.drafts.hits,
                           replay_misses=d.drafts.misses)
        per_client.append(summary)
        all_records += d.records
    aggregate, tpot, ttft = _summarize(all_records, window_s, end)
    total_errors: Counter = Counter()
    for err in errors:
        total_errors.update(err)
    aggregate["errors"] = dict(total_errors)
    aggregate["network_retransmits"] = sum(d.link.netem.retransmits for d in devices)
    if drafts:
        aggregate["draft_s"] = sum(s.draft_s for s in drafts)
        aggregate["replay_hits"] = sum(s.hits for s in drafts)
        aggregate["replay_misses"] = sum(s.misses for s in drafts)
    return {
        "clients": config.clients,
        "duration_s": window_s,
        "profile": asdict(prof),
        "workload": config.workload,
        "mode": config.mode,
        "drafts": config.drafts if config.mode == "spec" else None,
        "protocol": config.protocol if config.mode == "spec" else None,
        "replay_recorded_requests": recorded,
        "draft_len": config.draft_len,
        "confidence": (config.confidence and config.temperature == 0
                       if config.mode == "spec" else None),
        "adaptive": (config.adaptive if config.mode == "spec" and config.protocol == "rounds"
                     else None),
        "temperature": config.temperature,
        "chat_tokens": config.chat_tokens,
        "ime_document": config.ime_document,
        "address": address,
        "target_model": info.target_model,
        "aggregate": aggregate,
        "per_client": per_client,
        "samples": {"tpot_ms": tpot, "ttft_ms": ttft},
    } | ({"outputs": [{"client": d.index, "prompt_key": r.prompt_key,
                        "max_new_tokens": r.max_new_tokens, "tokens": r.output,
                        "completed": r.completed} for d in devices for r in d.records]}
         if config.keep_outputs else {})


def run_fleet(address: str, config: FleetConfig, draft_dir: Path,
              replay_cache: Path | None = None) -> dict:
    return asyncio.run(run_fleet_async(address, config, Path(draft_dir),
                                       None if replay_cache is None else Path(replay_cache)))


def result_line(result: dict) -> str:
    a = result["aggregate"]

    def f(x, spec=".0f"):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    return (f"{result['mode']:8s} {result['profile']['name']:7s} x{result['clients']:<3d} "
            f"{f(a['tokens_per_s'], '.1f')} tok/s  TPOT p50/p95/p99 {f(a['tpot_ms_p50'])}/"
            f"{f(a['tpot_ms_p95'])}/{f(a['tpot_ms_p99'])} ms  TTFT p50 {f(a['ttft_ms_p50'])} ms"
            f"  {f(a['round_trips_per_token'], '.2f')} RT/tok  "
            f"{f(a['target_forwards_per_token'], '.2f')} fwd/tok  "
            f"{f(a['bytes_per_token'])} B/tok  errors {a['errors'] or 0}")


# -- command line -----------------------------------------------------------------------------


def add_common_args(p) -> None:
    """Flags shared by ``edge-client fleet`` and ``edge-client bench-fleet``."""
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", metavar="HOST:PORT",
                       help="a running verifier on this machine (loopback only)")
    where.add_argument("--embedded", action="store_true",
                       help="start a verifier in this process on a free loopback port")
    where.add_argument("--spawn", action="store_true",
                       help="start edgespec-verifier in a child process on a free loopback "
                            "port: the clients' CPU and GIL stay apart from the server's")
    p.add_argument("--target", default=None,
                   help="with --embedded/--spawn: target checkpoint (default: prepared "
                        "SmolLM2)")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="with --embedded/--spawn: session limit (default: max(64, 2 x "
                        "clients))")
    p.add_argument("--kv-budget-mb", type=float, default=None,
                   help="with --embedded/--spawn: the verifier's KV cache budget (default: "
                        "unbounded)")
    p.add_argument("--verifier-threads", type=int, default=None,
                   help="with --spawn: the verifier's torch threads (default: one per core)")
    p.add_argument("--verifier-arg", action="append", default=None, metavar="ARG",
                   help="with --embedded/--spawn: one more edgespec-verifier argument, e.g. "
                        "--verifier-arg=--prefix-cache-mb=0 (repeatable; given last)")
    p.add_argument("--draft-dir", type=Path, default=None,
                   help="ONNX draft directory; its tokenizer is used in both modes")
    p.add_argument("--workload", choices=WORKLOADS, default="chat")
    p.add_argument("--drafts", choices=DRAFT_SOURCES, default="replay",
                   help="spec mode: run the ONNX draft on each client, or replay drafts "
                        "recorded once from it (greedy only; keeps edge CPU out of the run)")
    p.add_argument("--protocol", choices=PROTOCOLS, default="lookahead",
                   help="spec mode: one Lookahead stream per generation (the server decodes "
                        "back to back; the client streams drafts ahead; the default), or a "
                        "Verify round trip per round (with Continue streams when drafting "
                        "does not pay)")
    p.add_argument("--draft-len", type=int, default=4, help="K, drafts per round")
    p.add_argument("--no-confidence", action="store_true",
                   help="greedy drafts go without the draft's confidences, so the server's "
                        "suggested draft length alone decides how many it verifies (A/B)")
    p.add_argument("--no-adaptive", action="store_true",
                   help="spec clients draft whenever the server's suggestion allows, instead "
                        "of choosing drafting or server-side decoding by measured rate")
    p.add_argument("--chat-tokens", type=int, default=128, help="max new tokens per chat answer")
    p.add_argument("--prompts", type=int, default=8,
                   help="distinct chat prompts / IME sentences the clients cycle through")
    p.add_argument("--ime-document", action="store_true",
                   help="IME: type the sentences as one document, so each prompt holds all "
                        "the text before it (long contexts; default: each sentence alone)")
    p.add_argument("--think-ms", type=float, default=None,
                   help="pause before each request (default: 0 chat, 300 IME)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deadline", type=float, default=30.0, help="per-call deadline, seconds")
    p.add_argument("--max-requests", type=int, default=FleetConfig.max_requests,
                   help="per client; the run ends when every client is done or at --duration")
    p.add_argument("--replay-cache", type=Path, default=None,
                   help="recorded drafts file (default: $EDGESPEC_CACHE/fleet-replay/...)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def add_fleet_args(p) -> None:
    add_common_args(p)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--duration", type=float, default=30.0, help="measured window, seconds")
    p.add_argument("--profile", choices=list(PROFILES), default="4g")
    p.add_argument("--mode", choices=MODES, default="spec")
    p.add_argument("--json", type=Path, required=True, metavar="PATH")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG",
                   help="also write the latency CDF of this run")


def config_from_args(args, clients: int, profile_name: str, mode: str,
                     duration_s: float) -> FleetConfig:
    return FleetConfig(
        clients=clients, duration_s=duration_s, profile=profile_name, workload=args.workload,
        mode=mode, drafts=args.drafts, protocol=args.protocol, draft_len=args.draft_len,
        confidence=not args.no_confidence, adaptive=not args.no_adaptive,
        chat_tokens=args.chat_tokens, ime_document=args.ime_document,
        prompts=args.prompts, think_ms=args.think_ms, temperature=args.temperature,
        seed=args.seed, deadline_s=args.deadline, max_requests=args.max_requests,
        progress=not args.no_progress)


def write_json(path: Path, data: dict) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def cmd_fleet(args) -> int:
    from edge_client.fleet_verifier import fleet_verifier
    from shared.paths import default_draft_dir

    config = config_from_args(args, args.clients, args.profile, args.mode, args.duration)
    with fleet_verifier(args, args.clients) as verifier:
        result = run_fleet(verifier.address, config, args.draft_dir or default_draft_dir(),
                           args.replay_cache)
    result["verifier"] = verifier.report.as_dict()
    write_json(args.json, result)
    if args.plot is not None:
        from edge_client.bench_fleet import plot_latency_cdf

        plot_latency_cdf([result], args.plot)
    print(result_line(result), file=sys.stderr)
    return 0
