"""Driving the verifier's Session stream from a test with a raw gRPC stub.

``SessionCall`` is one Session stream whose requests come from a queue the test keeps
writing to while it reads the replies; the message builders keep tests short.
"""

from __future__ import annotations

import queue

import grpc
import pytest
import torch

from shared.errors import ErrorDetails, details_of
from shared.pb import verifier_pb2 as pb

PROMPT = [1, 17, 42, 5, 63, 8]
GREEDY = pb.SamplingParams(temperature=0.0)
ROUNDS = pb.DRAFTING_ROUNDS
LOOKAHEAD = pb.DRAFTING_LOOKAHEAD


def reference_greedy(target, prompt: list[int], n: int) -> list[int]:
    """Plain greedy decoding, one full forward per token (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = target.model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(torch.argmax(logits)))
    return ids[len(prompt):]


def draft(tokens=(), q=None, confidence=None) -> pb.Draft:
    """``q``: one (token ids, probs) pair per token, or None for point masses."""
    message = pb.Draft(token_ids=list(tokens), confidence=list(confidence or ()))
    for ids, probs in q or ():
        message.q.add(token_ids=ids, probs=probs)
    return message


def open_message(prompt=PROMPT, drafting=ROUNDS, first: pb.Draft | list[int] | None = None,
                 sampling=GREEDY, max_new_tokens: int = 0, ignore_eos: bool = True,
                 **kwargs) -> pb.SessionRequest:
    message = pb.OpenSession(prompt_token_ids=list(prompt), sampling=sampling,
                             max_new_tokens=max_new_tokens, ignore_eos=ignore_eos,
                             drafting=drafting, **kwargs)
    if first is not None:
        message.first_draft.CopyFrom(first if isinstance(first, pb.Draft) else draft(first))
    return pb.SessionRequest(open=message)


def verify_message(round_no: int, tokens=(), **kwargs) -> pb.SessionRequest:
    return pb.SessionRequest(verify=pb.VerifyRound(round=round_no, draft=draft(tokens, **kwargs)))


def lookahead_message(base: int, tokens, confidence=None) -> pb.SessionRequest:
    return pb.SessionRequest(lookahead=pb.LookaheadDraft(
        base_length=base, draft=draft(tokens, confidence=confidence)))


def decode_message(round_no: int, max_tokens: int,
                   stop_when_drafting_pays: bool = False) -> pb.SessionRequest:
    return pb.SessionRequest(decode=pb.Decode(round=round_no, max_tokens=max_tokens,
                                              stop_when_drafting_pays=stop_when_drafting_pays))


class SessionCall:
    """One Session stream: ``send`` writes, ``step`` reads, ``close`` half-closes."""

    def __init__(self, stub, *first: pb.SessionRequest, metadata=None,
                 timeout: float = 60) -> None:
        self._queue: queue.Queue = queue.Queue()
        for message in first:
            self.send(message)
        self.call = stub.Session(self._requests(), metadata=metadata, timeout=timeout)

    def _requests(self):
        while (message := self._queue.get()) is not None:
            yield message

    def send(self, message: pb.SessionRequest) -> SessionCall:
        self._queue.put(message)
        return self

    def close(self) -> SessionCall:
        """Half-closes the request stream."""
        self._queue.put(None)
        return self

    def reply(self) -> pb.SessionResponse:
        return next(self.call)

    def step(self) -> pb.Step:
        return self.reply().step

    def rest(self) -> list[pb.SessionResponse]:
        """Every reply left, until the server ends the stream (raises on an error status)."""
        return list(self.call)

    def cancel(self) -> None:
        self.call.cancel()
        self.close()

    def __enter__(self) -> SessionCall:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


def error_of(call, *args, **kwargs) -> ErrorDetails:
    """What ``call(*args, **kwargs)`` fails with; every error carries a message."""
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    details = details_of(info.value)
    assert details.message, "every error carries a message"
    return details


def stream_error(stub, *messages: pb.SessionRequest, metadata=None, half_close=False,
                 timeout: float = 30) -> ErrorDetails:
    """The status a Session stream that sends ``messages`` ends with. It does not half-close
    unless told (a half-close would close the session before the messages are answered)."""
    call = SessionCall(stub, *messages, metadata=metadata, timeout=timeout)
    if half_close:
        call.close()
    try:
        return error_of(call.rest)
    finally:
        call.cancel()
