"""Hypothesis strategies over every request the verifier takes: GetInfoRequest,
GenerateRequest, Session streams of SessionRequest (open, verify, lookahead, decode, empty),
raw payloads (undecodable ones, and arbitrary bytes), and the call's metadata.

Values are drawn near the edges that matter: token ids just inside and past the vocabulary,
drafts past ``max_draft_len``, prompts past the context, NaN and infinite probabilities,
unknown enum values, huge round numbers. Half of the messages are plausible (a valid open
followed by rounds numbered in order) so that fuzzing reaches the verifier's later checks,
not only the first one.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError
from hypothesis import strategies as st

from shared import errors
from shared.pb import verifier_pb2 as pb

SERVICE = "/edgespec.v1.VerifierService/"
METHODS = {"GetInfo": pb.GetInfoRequest, "Generate": pb.GenerateRequest,
           "Session": pb.SessionRequest}
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


@dataclass(frozen=True)
class Limits:
    """What the fuzzed verifier serves (its GetInfo)."""

    vocab_size: int
    max_draft_len: int
    max_context: int


@dataclass(frozen=True)
class FuzzRequest:
    """One call: ``method`` with protobuf ``messages`` (one, except for Session) or, when
    ``raw``, the payloads as they are; ``metadata`` replaces the honest key and routing key."""

    method: str
    messages: tuple
    metadata: tuple[tuple[str, str | bytes], ...]
    raw: bool = False

    def carries_key(self, api_key: str) -> bool:
        return ("authorization", f"Bearer {api_key}") in self.metadata

    def describe(self) -> str:
        body = [m.hex()[:80] if self.raw else str(m).replace("\n", " ")[:160]
                for m in self.messages]
        return f"{self.method}{' raw' if self.raw else ''} {body} metadata={self.metadata}"


def token_ids(limits: Limits, max_size: int) -> st.SearchStrategy[list[int]]:
    v = limits.vocab_size
    one = st.one_of(st.integers(0, v - 1), st.integers(0, v - 1), st.integers(0, v - 1),
                    st.sampled_from([v - 1, v, v + 1, UINT32_MAX]), st.integers(0, UINT32_MAX))
    return st.lists(one, max_size=max_size)


floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
probability = st.one_of(st.floats(0, 1, width=32), floats32)


@st.composite
def sparse_q(draw, limits: Limits, drafted: int | None) -> pb.SparseDistribution:
    if drafted is not None and draw(st.booleans()):  # a point mass or a small valid support
        others = draw(st.lists(st.integers(0, limits.vocab_size - 1), max_size=3, unique=True))
        ids = [drafted] + [t for t in others if t != drafted]
        return pb.SparseDistribution(token_ids=ids, probs=[1.0 / len(ids)] * len(ids))
    n = draw(st.integers(0, 6))
    return pb.SparseDistribution(token_ids=draw(token_ids(limits, n)),
                                 probs=draw(st.lists(probability, min_size=0, max_size=n + 1)))


@st.composite
def drafts(draw, limits: Limits) -> pb.Draft:
    tokens = draw(token_ids(limits, limits.max_draft_len + 3))
    message = pb.Draft(token_ids=tokens)
    q_mode = draw(st.sampled_from(["none", "none", "per-token", "any"]))
    if q_mode == "per-token":
        message.q.extend(draw(sparse_q(limits, t)) for t in tokens)
    elif q_mode == "any":
        message.q.extend(draw(st.lists(sparse_q(limits, None), max_size=4)))
    if draw(st.booleans()):
        message.confidence.extend(draw(st.lists(probability, max_size=len(tokens) + 1)))
    return message


@st.composite
def sampling(draw) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), st.floats(0, 2, width=32), floats32)),
        top_k=draw(st.one_of(st.just(0), st.integers(0, 100), st.integers(0, UINT32_MAX))),
        top_p=draw(st.one_of(st.just(0.0), st.floats(0, 1, width=32), floats32)),
        seed=draw(st.integers(0, UINT64_MAX)))


def max_new_tokens() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 8), st.integers(0, 200), st.just(UINT32_MAX))


@st.composite
def open_sessions(draw, limits: Limits) -> pb.OpenSession:
    plausible = draw(st.booleans())
    prompt = draw(st.lists(st.integers(0, limits.vocab_size - 1), min_size=1, max_size=12)
                  if plausible else token_ids(limits, limits.max_context + 8))
    message = pb.OpenSession(
        prompt_token_ids=prompt, sampling=draw(sampling()),
        max_new_tokens=draw(st.integers(1, 8) if plausible else max_new_tokens()),
        stop_token_ids=draw(token_ids(limits, 3)), ignore_eos=draw(st.booleans()),
        drafting=draw(st.sampled_from([1, 2]) if plausible else st.integers(0, 3)))
    if draw(st.booleans()):
        message.first_draft.CopyFrom(draw(drafts(limits)))
    return message


@st.composite
def later_message(draw, limits: Limits, round_no: int) -> pb.SessionRequest:
    """A message after the open; ``round_no`` is the next in-order round number."""
    number = draw(st.one_of(st.just(round_no), st.just(round_no),
                            st.integers(0, 4), st.integers(0, UINT64_MAX)))
    kind = draw(st.sampled_from(["verify", "verify", "decode", "lookahead", "open", "empty"]))
    if kind == "verify":
        return pb.SessionRequest(verify=pb.VerifyRound(round=number, draft=draw(drafts(limits))))
    if kind == "decode":
        return pb.SessionRequest(decode=pb.Decode(
            round=number, max_tokens=draw(st.one_of(st.integers(0, 4), st.integers(0, UINT32_MAX))),
            stop_when_drafting_pays=draw(st.booleans())))
    if kind == "lookahead":
        base = draw(st.one_of(st.integers(0, 24), st.integers(0, UINT32_MAX)))
        return pb.SessionRequest(lookahead=pb.LookaheadDraft(base_length=base,
                                                             draft=draw(drafts(limits))))
    if kind == "open":
        return pb.SessionRequest(open=draw(open_sessions(limits)))
    return pb.SessionRequest()


@st.composite
def session_streams(draw, limits: Limits) -> tuple[pb.SessionRequest, ...]:
    first = (pb.SessionRequest(open=draw(open_sessions(limits))) if draw(st.integers(0, 4))
             else draw(later_message(limits, 0)))
    rest = [draw(later_message(limits, i + 1)) for i in range(draw(st.integers(0, 5)))]
    return (first, *rest)


@st.composite
def generate_requests(draw, limits: Limits) -> pb.GenerateRequest:
    plausible = draw(st.booleans())
    return pb.GenerateRequest(
        prompt_token_ids=draw(st.lists(st.integers(0, limits.vocab_size - 1), min_size=1,
                                       max_size=12) if plausible
                              else token_ids(limits, limits.max_context + 8)),
        sampling=draw(sampling()),
        max_new_tokens=draw(st.integers(1, 8) if plausible else max_new_tokens()),
        stop_token_ids=draw(token_ids(limits, 3)), ignore_eos=draw(st.booleans()))


header_keys = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=12) \
    .filter(lambda k: not k.startswith("grpc-") and not k.endswith("-bin")
            and k not in {"te", "content-type", "user-agent"})
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80)


@st.composite
def metadata(draw, api_key: str) -> tuple[tuple[str, str | bytes], ...]:
    """The honest key and a routing key mostly; otherwise missing, wrong or malformed ones,
    repeated routing keys and unrelated headers (text and binary)."""
    items: list[tuple[str, str | bytes]] = []
    auth = draw(st.sampled_from(["honest", "honest", "honest", "none", "wrong", "malformed"]))
    if auth == "honest":
        items.append(("authorization", f"Bearer {api_key}"))
    elif auth == "wrong":
        items.append(("authorization", f"Bearer {draw(header_values)}"))
    elif auth == "malformed":
        items.append(("authorization", draw(header_values)))
    routing = st.one_of(st.from_regex(errors.ROUTING_KEY_RE, fullmatch=True), header_values)
    items += [(errors.ROUTING_KEY, key) for key in draw(st.lists(routing, max_size=2))]
    items += draw(st.lists(st.tuples(header_keys, header_values), max_size=2))
    if draw(st.booleans()):
        items.append(("x-fuzz-bin", draw(st.binary(max_size=32))))
    return tuple(items)


def undecodable(method: str) -> st.SearchStrategy[bytes]:
    """Payloads that are not a valid encoding of ``method``'s request message."""

    def fails(data: bytes) -> bool:
        try:
            METHODS[method].FromString(data)
        except DecodeError:
            return True
        return False

    truncated = st.sampled_from([b"\x0a\xff", b"\x0a\x05ab", b"\x08", b"\xff\xff\xff\xff",
                                 b"\x12\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80"])
    return st.one_of(truncated, st.binary(min_size=1, max_size=64)).filter(fails)


def raw_requests(api_key: str, decodable_too: bool = False) -> st.SearchStrategy[FuzzRequest]:
    """Raw payloads to each method; undecodable only unless ``decodable_too``."""

    @st.composite
    def build(draw) -> FuzzRequest:
        method = draw(st.sampled_from(list(METHODS)))
        payload = st.binary(max_size=64) if decodable_too and draw(st.booleans()) \
            else undecodable(method)
        count = draw(st.integers(1, 3)) if method == "Session" else 1
        return FuzzRequest(method, tuple(draw(payload) for _ in range(count)),
                           draw(metadata(api_key)), raw=True)

    return build()


def structured_requests(limits: Limits, api_key: str) -> st.SearchStrategy[FuzzRequest]:
    @st.composite
    def build(draw) -> FuzzRequest:
        method = draw(st.sampled_from(["GetInfo", "Generate", "Session", "Session"]))
        if method == "GetInfo":
            messages: tuple = (pb.GetInfoRequest(),)
        elif method == "Generate":
            messages = (draw(generate_requests(limits)),)
        else:
            messages = draw(session_streams(limits))
        return FuzzRequest(method, messages, draw(metadata(api_key)))

    return build()


def any_requests(limits: Limits, api_key: str) -> st.SearchStrategy[FuzzRequest]:
    """What the fuzz benchmark draws from: structured requests mostly, raw payloads too."""
    return st.one_of(structured_requests(limits, api_key), structured_requests(limits, api_key),
                     structured_requests(limits, api_key),
                     raw_requests(api_key, decodable_too=True))
