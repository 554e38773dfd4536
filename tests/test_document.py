"""Editing sessions end to end, over real gRPC with tiny random models: the protocol (edits,
supersede and cancel, their errors), the document API (edge_client.document), the latency
budget, the draft-only fallback and the acceptance-collapse metric."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch
from stream_helpers import (
    LOOKAHEAD,
    PROMPT,
    SessionCall,
    decode_message,
    draft,
    open_message,
    reference_greedy,
    stream_error,
    verify_message,
)
from test_editing import common_prefix, one_torch_thread, random_edit  # noqa: F401 - autouse

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from edge_client.client import AsyncEdgeClient, EdgeClient, GenerationConfig
from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, ModelDrafter
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

DOC_SEQUENCES = 24  # with tests/test_editing.py's, over 500 random edit sequences
GREEDY = GenerationConfig(draft_len=3, ignore_eos=True)


@pytest.fixture(scope="module")
def verifier(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_sessions=16,
                                                 max_draft_len=8)) as v:
        yield v


@pytest.fixture()
def stub(verifier):
    import grpc

    with grpc.insecure_channel(verifier.address) as channel:
        yield pb_grpc.VerifierServiceStub(channel)


def edit_message(round_no: int, keep: int, append, suggestion: int, max_new_tokens: int,
                 tokens=()) -> pb.SessionRequest:
    return pb.SessionRequest(verify=pb.VerifyRound(
        round=round_no, draft=draft(tokens),
        edit=pb.Edit(keep_length=keep, append_token_ids=list(append), suggestion=suggestion,
                     max_new_tokens=max_new_tokens)))


def cancel_message(suggestion: int) -> pb.SessionRequest:
    return pb.SessionRequest(cancel=pb.CancelSuggestion(suggestion=suggestion))


def metric(verifier, name: str, *labels: str) -> float:
    m = getattr(verifier.server.metrics, name)
    return (m.labels(*labels) if labels else m)._value.get()


def live_sessions(verifier) -> int:
    async def count() -> int:
        return len(verifier.server.service.store)
    return verifier.call(count())


def read_suggestion(call: SessionCall) -> list[pb.Step]:
    """The suggestion's steps; after each unfinished one, the next round (no drafts)."""
    steps = [call.step()]
    while not steps[-1].finished:
        call.send(verify_message(steps[-1].round + 1))
        steps.append(call.step())
    return steps


# -- the protocol ---------------------------------------------------------------------------

def test_an_editable_session_serves_one_suggestion_after_another(verifier, stub, target):
    with SessionCall(stub, open_message(max_new_tokens=3, editable=True)) as call:
        first = read_suggestion(call)
        assert [t for s in first for t in s.token_ids] == reference_greedy(target, PROMPT, 3)
        assert {s.suggestion for s in first} == {0}
        assert live_sessions(verifier) >= 1  # finishing the suggestion kept the session
        text = PROMPT[:4] + [70, 71]
        call.send(edit_message(0, 4, [70, 71], 1, 4, tokens=[5, 6]))
        second = read_suggestion(call)
        assert [t for s in second for t in s.token_ids] == reference_greedy(target, text, 4)
        assert {s.suggestion for s in second} == {1}
        assert second[0].round == 0 and second[0].committed_length == len(text) + len(
            second[0].token_ids)
        # The edit's round fed the two typed tokens and the two drafts, not the kept ones.
        assert second[0].fed_tokens == 2 + 2


@pytest.mark.parametrize("messages, code_reason, field", [
    ([open_message(max_new_tokens=2), edit_message(1, 2, [5], 1, 2)],
     "FAILED_PRECONDITION/OUT_OF_ORDER", None),
    ([open_message(max_new_tokens=2, editable=True), edit_message(1, 99, [5], 1, 2)],
     "INVALID_ARGUMENT/INVALID_ARGUMENT", "verify.edit.keep_length"),
    ([open_message(max_new_tokens=2, editable=True), edit_message(1, 2, [500], 1, 2)],
     "INVALID_ARGUMENT/INVALID_ARGUMENT", "verify.edit.append_token_ids"),
    ([open_message(max_new_tokens=2, editable=True), edit_message(1, 0, [], 1, 2)],
     "INVALID_ARGUMENT/INVALID_ARGUMENT", "verify.edit.keep_length"),
    ([open_message(max_new_tokens=2, editable=True), edit_message(1, 2, [5], 0, 2)],
     "FAILED_PRECONDITION/OUT_OF_ORDER", None),
    ([open_message(drafting=LOOKAHEAD, editable=True)],
     "INVALID_ARGUMENT/INVALID_ARGUMENT", "open.editable"),
], ids=["not-editable", "keep-past-end", "token-out-of-range", "empty-text",
        "suggestion-not-new", "lookahead"])
def test_bad_edits_are_refused_with_their_reason(stub, messages, code_reason, field):
    details = stream_error(stub, *messages)
    assert f"{details.code.name}/{details.reason}" == code_reason
    if field is not None:
        assert details.metadata.get("field") == field


class ForwardGate:
    """Counts the verifier's forwards and can hold the next one until released."""

    def __init__(self, verifier) -> None:
        self.engine = verifier.server.service.engine
        self.ran: list[int] = []  # tokens fed by each forward
        self.hold = threading.Event()
        self.release = threading.Event()
        self.held = threading.Event()

    def __enter__(self) -> ForwardGate:
        inner = self._inner = self.engine._forward

        def gated(model, segments):
            if self.hold.is_set():
                self.hold.clear()
                self.held.set()
                self.release.wait(30)
            self.ran.append(sum(len(s.tokens) for s in segments))
            return inner(model, segments)

        self.engine._forward = gated
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self.engine._forward = self._inner


def wait_for(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def queued(verifier) -> list:
    async def tickets() -> list:
        return [(t.session.id, t.abandoned) for t in verifier.server.service.batcher._queue]
    return verifier.call(tickets())


@pytest.mark.parametrize("interrupt", ["edit", "cancel"])
def test_a_keystroke_drops_the_queued_round_before_its_forward(verifier, stub, target,
                                                               interrupt):
    """Another session's forward is held while our round waits in the queue; the keystroke
    (an edit, or a cancel) arrives; the held forward is released. Our round never runs: the
    forwards that ran are the other session's and, for an edit, the edit's round."""
    with SessionCall(stub, open_message(max_new_tokens=0, editable=True)) as ours, \
            ForwardGate(verifier) as gate:
        ours.step()
        cancelled = metric(verifier, "cancelled_rounds")
        gate.hold.set()
        with SessionCall(stub, open_message(max_new_tokens=1, first=[9, 9])) as other:
            gate.held.wait(30)
            ours.send(verify_message(1, [5, 6, 7]))
            wait_for(lambda: len(queued(verifier)) == 1, "our round to queue")
            if interrupt == "edit":
                ours.send(edit_message(0, 3, [40], 1, 1))
            else:
                ours.send(cancel_message(0))
            wait_for(lambda: queued(verifier)[0][1], "the keystroke to reach the verifier")
            ran_before = len(gate.ran)
            gate.release.set()
            other.step()
            if interrupt == "edit":
                step = ours.step()
                assert list(step.token_ids) == reference_greedy(target, PROMPT[:3] + [40], 1)
                assert step.suggestion == 1 and step.finished
                # The held forward, then the edit's round: the typed token after a cache of
                # the 3 kept ones.
                assert len(gate.ran) == ran_before + 2
                assert gate.ran[ran_before + 1] == step.fed_tokens == 1
            else:
                # The session still takes an edit, and only the edit's forwards run.
                ours.send(edit_message(0, len(PROMPT), [], 1, 1))
                step = ours.step()
                assert step.suggestion == 1 and step.finished
                assert len(gate.ran) == ran_before + 2
        assert metric(verifier, "cancelled_rounds") == cancelled + 1


def test_a_cancel_ends_a_decode_early(verifier, stub):
    """n = 100 decode steps asked; the cancel sent on the first step stops the rest."""
    with SessionCall(stub, open_message(max_new_tokens=0, editable=True)) as call:
        call.step()
        forwards = metric(verifier, "target_forwards")
        call.send(decode_message(1, 100))
        call.step()
        call.send(cancel_message(0))
        call.send(edit_message(0, len(PROMPT), [], 1, 1))
        step = call.step()
        while step.suggestion == 0:  # decode steps already on their way
            step = call.step()
        assert step.suggestion == 1 and step.finished
        assert metric(verifier, "target_forwards") - forwards < 100


def test_acceptance_collapse_is_counted(verifier, stub, target):
    """Drafts that are always wrong: the suggested K falls to 0 and the metrics show it."""
    collapsed = metric(verifier, "speculation_changes", "collapsed")
    want = reference_greedy(target, PROMPT, 40)
    with SessionCall(stub, open_message(max_new_tokens=40)) as call:
        step = call.step()
        done = len(step.token_ids)
        round_no = 1
        while step.suggested_draft_len > 0 and not step.finished:
            wrong = (want[done] + 1) % target.vocab_size
            call.send(verify_message(round_no, [wrong]))
            step = call.step()
            done += len(step.token_ids)
            round_no += 1
        assert step.suggested_draft_len == 0
        assert metric(verifier, "speculation_changes", "collapsed") == collapsed + 1
        assert metric(verifier, "sessions_not_speculating") >= 1
    wait_for(lambda: metric(verifier, "sessions_not_speculating") == 0, "the session to close")


# -- the document API -----------------------------------------------------------------------

def hf_greedy(target, prompt: list[int], n: int) -> list[int]:
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_document_suggestions_after_random_edits_are_the_targets(verifier, tiny_llama_pair,
                                                                 target):
    """DOC_SEQUENCES random edit sequences of 3 suggestions through the document API: every
    suggestion is the target's greedy continuation of the edited text; one session each;
    the verifier's forwards feed only the tokens after the kept ones."""

    async def run() -> int:
        edits = 0
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
            for seq in range(DOC_SEQUENCES):
                rng = random.Random(5000 + seq)
                text = [1] + [rng.randrange(3, 96) for _ in range(rng.randint(4, 12))]
                suggestion: list[int] = []
                async with client.document(GREEDY) as doc:
                    for number in range(3):
                        if number:
                            text = random_edit(rng, text, suggestion, 96)
                        n = rng.randint(1, 5)
                        kept = common_prefix(doc.committed_ids, text)
                        s = await doc.suggest(text, max_new_tokens=n)
                        assert s.token_ids == hf_greedy(target, text, n), (seq, number)
                        assert not s.cancelled and s.unverified_ids == []
                        assert s.stats.kept_tokens == kept and s.stats.reopens == 0
                        # A fresh session's forwards would feed the whole text once, then per
                        # round the last token and the drafts; an edit saves the kept tokens
                        # (but the last one's, when it was the end of the committed text).
                        st = s.stats
                        fresh = len(text) + st.drafted + st.target_forwards - 1
                        assert st.fed_tokens <= fresh - kept + 1
                        suggestion = s.token_ids
                        edits += number > 0
        return edits

    assert asyncio.run(run()) == 2 * DOC_SEQUENCES


def test_a_new_suggest_cancels_the_one_in_flight(verifier, tiny_llama_pair, target):
    async def run():
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir,
                                   rtt_ms=40) as client:
            async with client.document(GREEDY) as doc:
                await doc.suggest(PROMPT, max_new_tokens=2)
                older = asyncio.ensure_future(doc.suggest(PROMPT + [30], max_new_tokens=40))
                while doc._task is None or doc._task.done():  # until it is in flight
                    await asyncio.sleep(0.001)
                newer = await doc.suggest(PROMPT + [31], max_new_tokens=3)
                return await older, newer

    older, newer = asyncio.run(run())
    assert older.cancelled and len(older.token_ids) < 40
    assert not newer.cancelled and newer.token_ids == hf_greedy(target, PROMPT + [31], 3)


def test_cancel_from_another_thread_returns_a_cancelled_suggestion(verifier, tiny_llama_pair,
                                                                   target):
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir, rtt_ms=100) as client, \
            client.document(GREEDY) as doc:
        timer = threading.Timer(0.3, doc.cancel)
        timer.start()
        s = doc.suggest(PROMPT, max_new_tokens=60)  # at least 60 / 4 round trips of 0.1 s
        timer.join()
        assert s.cancelled and len(s.token_ids) < 60
        assert s.token_ids == hf_greedy(target, PROMPT, 60)[:len(s.token_ids)]
        again = doc.suggest(PROMPT + [12], max_new_tokens=3)
        assert again.token_ids == hf_greedy(target, PROMPT + [12], 3)


def test_on_update_streams_the_suggestion_as_its_tokens_come(verifier, tiny_llama_pair,
                                                             target):
    """A 12-token greedy suggestion at K = 3 takes several rounds (the tiny draft's drafts
    are mostly rejected): on_update sees it grow, each time a strict extension of the last
    and a prefix of the whole, and the last one equals what suggest() returns, after a
    first update that is the draft's preview."""
    updates = []

    async def run():
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
            async with client.document(GREEDY) as doc:
                return await doc.suggest(PROMPT, max_new_tokens=12, on_update=updates.append)

    whole = asyncio.run(run())
    assert whole.token_ids == hf_greedy(target, PROMPT, 12)
    # The text ends inside a word ("t8"): the document waits, showing the draft's preview.
    assert updates[0].preview and updates[0].token_ids == []
    updates = updates[1:]
    assert len(updates) >= 2 and len(updates) == whole.stats.target_forwards
    sizes = [len(u.token_ids) for u in updates]
    assert sizes == sorted(set(sizes)) and sizes[-1] == 12
    assert all(u.token_ids == whole.token_ids[:len(u.token_ids)] and not u.cancelled
               and u.text == whole.text[:len(u.text)] for u in updates)


def test_keys_typed_within_the_settle_time_send_no_work(verifier, tiny_llama_pair, target):
    """Five keys 20 ms apart with a 150 ms settle time: the first four suggestions end
    cancelled before any RPC (no session opened, no forward); the fifth, after which the
    user pauses, is the target's. Every forward the verifier ran is the fifth's. A cancel()
    during the wait also ends it with no work."""
    keys = [PROMPT + [20 + i] for i in range(5)]
    config = replace(GREEDY, settle_ms=150)

    async def run():
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
            async with client.document(config) as doc:
                sessions, forwards = live_sessions(verifier), metric(verifier, "target_forwards")
                burst = []
                for text in keys[:-1]:
                    burst.append(asyncio.ensure_future(doc.suggest(text, max_new_tokens=3)))
                    await asyncio.sleep(0.02)
                    assert live_sessions(verifier) == sessions  # nothing sent yet
                last = await doc.suggest(keys[-1], max_new_tokens=3)
                ran = metric(verifier, "target_forwards") - forwards
                superseded = await asyncio.gather(*burst)
                loop = asyncio.get_running_loop()
                loop.call_later(0.05, doc.cancel)
                before = metric(verifier, "target_forwards")
                stopped = await doc.suggest(keys[-1] + [9], max_new_tokens=3)
                return superseded, last, ran, stopped, metric(verifier, "target_forwards") - before

    superseded, last, ran, stopped, after_cancel = asyncio.run(run())
    assert all(s.cancelled and s.token_ids == [] and s.stats.target_forwards == 0
               for s in superseded)
    assert not last.cancelled and last.token_ids == hf_greedy(target, keys[-1], 3)
    assert ran == last.stats.target_forwards > 0
    assert stopped.cancelled and stopped.stats.target_forwards == 0 and after_cancel == 0


def draft_greedy(tiny_llama_pair, text: list[int], n: int) -> list[int]:
    """The tiny draft's own greedy continuation (the ONNX model alone), as GREEDY drafts
    (stopping where its joint confidence falls below stop_confidence)."""
    drafter = ModelDrafter(OnnxDraftModel(tiny_llama_pair.draft_dir),
                           GREEDY.draft_sampling(GREEDY.max_support), np.random.default_rng(0))
    return drafter.propose(text, n).tokens


def test_a_wait_previews_the_drafts_continuation_with_no_work(verifier, tiny_llama_pair,
                                                              target):
    """While a suggestion waits for the typing to settle, on_update first shows the draft's
    greedy continuation, unverified and marked as a preview, before any session or forward;
    a key that supersedes it has still had its preview. After the wait the verified
    suggestion (the target's) follows as before. No previews when turned off or sampled."""
    config = replace(GREEDY, drafter="model")
    keys = [PROMPT + [20], PROMPT + [20, 31]]

    async def run(cfg):
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
            async with client.document(cfg) as doc:
                sessions, forwards = live_sessions(verifier), metric(verifier, "target_forwards")
                seen: list[list] = [[], []]
                work: list[tuple] = []

                def show(i):
                    def shown(s):
                        seen[i].append(s)
                        if s.preview:
                            work.append((live_sessions(verifier) - sessions,
                                         metric(verifier, "target_forwards") - forwards))
                    return shown

                first = asyncio.ensure_future(doc.suggest(keys[0], 3, settle_ms=300,
                                                          on_update=show(0)))
                await asyncio.sleep(0.15)
                last = await doc.suggest(keys[1], 3, settle_ms=100, on_update=show(1))
                return await first, last, seen, work

    first, last, seen, work = asyncio.run(run(config))
    assert first.cancelled and first.stats.target_forwards == 0
    assert [s.preview for s in seen[0]] == [True]
    assert seen[0][0].token_ids == [] and not seen[0][0].cancelled
    assert seen[0][0].unverified_ids == draft_greedy(tiny_llama_pair, keys[0], 3)
    assert seen[1][0].preview and seen[1][0].unverified_ids == draft_greedy(tiny_llama_pair,
                                                                            keys[1], 3)
    assert work == [(0, 0), (0, 0)]  # both previews came before any session or forward
    assert not any(s.preview for s in seen[1][1:]) and len(seen[1]) > 1
    assert not last.preview and last.token_ids == hf_greedy(target, keys[1], 3)
    for cfg in (replace(config, preview=False), replace(config, temperature=1.0, seed=1)):
        first, last, seen, _ = asyncio.run(run(cfg))
        assert not any(s.preview for s in seen[0] + seen[1]) and seen[0] == []


def test_a_document_waits_inside_a_word_and_not_after_one(verifier, tiny_llama_pair, target):
    """With a word settle time far longer than the test (60 s): a text ending inside a word
    (its last character alphanumeric), as a string or as token ids whose last token decodes
    to such text, waits: a cancel() after 100 ms ends it with no session opened and no
    forward. A text ending in a space, and ids ending in a token that decodes to "<unk>",
    are sent at once and get the target's suggestion; a per-call settle_ms=0 is the whole
    wait even mid-word. (The tiny tokenizer's words are t3 .. tN.)"""
    config = replace(GREEDY, word_settle_ms=60_000)

    async def waits(doc, text) -> tuple:
        asyncio.get_running_loop().call_later(0.1, doc.cancel)
        s = await asyncio.wait_for(doc.suggest(text, 3), 10)
        return s.cancelled, s.stats.target_forwards

    async def run():
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
            async with client.document(config) as doc:
                sessions, forwards = live_sessions(verifier), metric(verifier, "target_forwards")
                waited = [await waits(doc, "t5 t7"), await waits(doc, PROMPT)]
                work = (live_sessions(verifier) - sessions,
                        metric(verifier, "target_forwards") - forwards)
                at_once = [await asyncio.wait_for(doc.suggest(text, 3, **kw), 10) for text, kw in
                           (("t5 t7 ", {}), (PROMPT + [0], {}), ("t5 t7 t9", {"settle_ms": 0}))]
                return waited, work, at_once

    waited, work, at_once = asyncio.run(run())
    assert waited == [(True, 0), (True, 0)] and work == (0, 0)
    assert all(not s.cancelled and s.stats.target_forwards > 0 for s in at_once)
    assert at_once[0].token_ids == hf_greedy(target, [5, 7], 3)


def test_settle_and_budget_are_checked(verifier, tiny_llama_pair):
    with pytest.raises(ValueError, match="settle_ms"):
        GenerationConfig(settle_ms=-1)
    with pytest.raises(ValueError, match="word_settle_ms"):
        GenerationConfig(word_settle_ms=-1)

    async def run():
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir) as client:
            async with client.document(GREEDY) as doc:
                with pytest.raises(ValueError, match="settle_ms"):
                    await doc.suggest(PROMPT, settle_ms=-5)
                with pytest.raises(ValueError, match="budget_ms"):
                    await doc.suggest(PROMPT, budget_ms=0)

    asyncio.run(run())


def test_a_budget_returns_what_is_verified_and_the_drafts_in_flight(verifier,
                                                                    tiny_llama_pair, target):
    """A 300 ms round trip and a 60 ms budget: nothing is verified in time; the suggestion
    is the drafts that were on their way, marked unverified. Without a budget, verified."""
    model = OnnxDraftModel(tiny_llama_pair.draft_dir)
    # A round of a 3-token suggestion carries 2 drafts (the third token is its bonus).
    drafts = ModelDrafter(model, DraftSampling(), np.random.default_rng(0)).propose(PROMPT, 2)

    async def run():
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir,
                                   rtt_ms=300) as client:
            async with client.document(GREEDY) as doc:
                quick = await doc.suggest(PROMPT, max_new_tokens=3, budget_ms=60)
                full = await doc.suggest(PROMPT, max_new_tokens=3)
                return quick, full

    quick, full = asyncio.run(run())
    assert quick.token_ids == [] and quick.unverified_ids == drafts.tokens
    assert quick.stats.unverified_tokens == 2 and quick.unverified_text
    assert full.token_ids == hf_greedy(target, PROMPT, 3) and full.unverified_ids == []


def test_cli_generate_fallback_flag_and_per_chunk_flags(verifier, tiny_llama_pair, capsys):
    from edge_client import cli

    assert cli.main(["generate", "--server", verifier.address, "--draft-dir",
                     str(tiny_llama_pair.draft_dir), "--prompt", "t5 t6", "--raw",
                     "--max-new-tokens", "5", "--fallback", "draft-only", "--json", "-"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["stats"]["unverified_tokens"] == 0
    assert report["unverified_token_ids"] == []
    assert [t for c in report["chunks"] for t in c["token_ids"]] == report["token_ids"]
    assert all(c["verified"] for c in report["chunks"])


def test_document_api_is_exported():
    import edge_client
    from edge_client import document

    for name in ("AsyncDocument", "Document", "Suggestion", "SuggestionStats"):
        assert getattr(edge_client, name) is getattr(document, name)
    with pytest.raises(AttributeError):
        edge_client.NoSuchThing  # noqa: B018
