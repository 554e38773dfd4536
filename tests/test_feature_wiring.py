"""The feature drafter wired end to end over real gRPC with the tiny models: the verifier's
capability and its checks, the features it captures, and the client core drafting from them
(rounds, lookahead, documents), greedy and sampled."""

from __future__ import annotations

import asyncio
import random

import grpc
import numpy as np
import pytest
import torch
from feature_heads import export_untrained_head
from stream_helpers import PROMPT, SessionCall, draft, open_message, stream_error, verify_message
from test_edge_client import hf_greedy
from test_editing import common_prefix, one_torch_thread, random_edit  # noqa: F401 - autouse

from cloud_verifier.config import VerifierConfig
from cloud_verifier.sampling import SamplingParams, target_probs
from cloud_verifier.server import EmbeddedVerifier, parse_args
from edge_client.client import AsyncEdgeClient, EdgeClient, GenerationConfig
from edge_client.errors import IncompatibleVerifier
from shared.feature_codec import codec_named
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

FEATURE = GenerationConfig(max_new_tokens=30, draft_len=4, ignore_eos=True, drafter="feature")


@pytest.fixture(scope="module")
def verifier(target):
    with EmbeddedVerifier(target, VerifierConfig(port=0, max_sessions=8)) as v:
        yield v


@pytest.fixture(scope="module")
def plain_verifier(target):
    """A verifier started with --no-features."""
    with EmbeddedVerifier(target, VerifierConfig(port=0, serve_features=False)) as v:
        yield v


@pytest.fixture(scope="module")
def head_dir(tiny_llama_pair, tmp_path_factory):
    return export_untrained_head(tiny_llama_pair.target_dir,
                                 tmp_path_factory.mktemp("feature_head"))


@pytest.fixture()
def stub(verifier):
    with grpc.insecure_channel(verifier.address) as channel:
        yield pb_grpc.VerifierServiceStub(channel)


def final_norm_state(target, context: list[int]) -> np.ndarray:
    """Teacher-forced: the target's hidden state after its final norm at the last position of
    ``context`` (what its LM head reads to decide the next token)."""
    seen = {}
    hook = target.model.model.norm.register_forward_hook(
        lambda module, args, out: seen.setdefault("h", out))
    try:
        with torch.no_grad():
            target.model(torch.tensor([context]))
    finally:
        hook.remove()
    return seen["h"][0, -1].float().numpy()


def test_getinfo_advertises_the_feature_and_no_features_switches_it_off(
        verifier, plain_verifier, tiny_llama_pair, target):
    from edge_client.tools.distill.head_model import target_fingerprint

    for v, served in ((verifier, True), (plain_verifier, False)):
        with grpc.insecure_channel(v.address) as channel:
            info = pb_grpc.VerifierServiceStub(channel).GetInfo(pb.GetInfoRequest())
        assert info.HasField("feature") == served
    cap = pb_grpc.VerifierServiceStub(grpc.insecure_channel(verifier.address)).GetInfo(
        pb.GetInfoRequest()).feature
    assert (cap.layer, cap.hidden_size, cap.codec, cap.group_size) == ("final_norm", 32,
                                                                       "fp16", 0)
    # The verifier's fingerprint of its loaded weights is the checkpoint's (what a head's
    # export records).
    assert cap.target_fingerprint == target_fingerprint(tiny_llama_pair.target_dir)
    args, config = parse_args(["--no-features"])
    assert config.serve_features is False and parse_args([])[1].serve_features is True
    assert parse_args(["--feature-codec", "int8-g16"])[1].feature_codec == "int8-g16"
    with pytest.raises(SystemExit):
        parse_args(["--feature-codec", "int4"])


def test_the_verifiers_feature_is_the_teacher_forced_final_norm_state(stub, target):
    """Rounds with drafts accepted and rejected, greedy and sampled, a Decode: each Step's
    feature is the codec's form of the final-norm state after committed[:position], at the
    last committed token's position."""
    codec = codec_named("fp16")
    greedy = hf_greedy(target, PROMPT, 12)
    for sampling in (pb.SamplingParams(), pb.SamplingParams(temperature=1.0, seed=3)):
        first = draft([greedy[0], greedy[1], 7])  # greedy: two accepted, then a correction
        with SessionCall(stub, open_message(PROMPT, first=first, max_new_tokens=12,
                                            sampling=sampling, want_feature=True)) as call:
            committed = list(PROMPT)
            steps = [call.step()]
            steps.append(call.send(verify_message(1, [3, 4])).step())  # most likely rejected
            steps.append(call.send(verify_message(2)).step())  # K = 0
            for step in steps:
                committed += list(step.token_ids)
                f = step.feature
                assert f.position == step.committed_length - 1 == len(committed) - 1
                got = codec.decode(f.values, f.scales, 32)
                want = final_norm_state(target, committed[:f.position])
                np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)
    assert steps[0].num_accepted >= 0 and len(steps[0].feature.values) == 64


def test_a_session_that_did_not_ask_gets_no_feature_and_the_same_bytes(
        stub, plain_verifier, target):
    """Byte for byte (timing aside) what a verifier without features sends. (A prompt no
    other test sends: the prefix cache would change fed_tokens.)"""

    def steps_of(s):
        with SessionCall(s, open_message([70, 71, 72, 73], first=draft([5, 6]),
                                         max_new_tokens=6)) as call:
            out = [call.step()]
            out.append(call.send(verify_message(1, [9])).step())
        for step in out:
            step.ClearField("timing")
        return [step.SerializeToString() for step in out], out

    with grpc.insecure_channel(plain_verifier.address) as channel:
        want, _ = steps_of(pb_grpc.VerifierServiceStub(channel))
    got, steps = steps_of(stub)
    assert not any(step.HasField("feature") for step in steps)
    assert got == want


def test_want_feature_on_a_verifier_without_features_is_refused(plain_verifier):
    with grpc.insecure_channel(plain_verifier.address) as channel:
        err = stream_error(pb_grpc.VerifierServiceStub(channel),
                           open_message(PROMPT, want_feature=True))
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.reason == "FEATURES_UNAVAILABLE"
    assert err.metadata["field"] == "open.want_feature"


@pytest.mark.parametrize("protocol", ["rounds", "lookahead"])
def test_greedy_feature_drafts_give_the_targets_output(verifier, tiny_llama_pair, target,
                                                       head_dir, protocol):
    want = hf_greedy(target, PROMPT, 30)
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir, protocol=protocol,
                    feature_head=head_dir) as c:
        gen = c.generate(PROMPT, FEATURE)
        assert [t for chunk in gen for t in chunk] == want
        plain = c.generate(PROMPT, GenerationConfig(max_new_tokens=30, draft_len=4,
                                                    ignore_eos=True))
        assert list(plain) and plain.stats.feature_bytes == 0
        assert c._async.feature_head().steps_run > 0  # the head drafted
    s = gen.stats
    # Lookahead: the tiny target decodes faster than drafts arrive, so they may all be stale.
    assert 0 <= s.accepted <= s.drafted and (s.drafted > 0 or protocol == "lookahead")
    # One feature per step (fp16: 64 bytes of values plus its framing), all in bytes_down.
    assert s.rounds * 64 < s.feature_bytes < s.bytes_down


def test_document_feature_drafts_after_random_edits_are_the_targets(verifier,
                                                                    tiny_llama_pair,
                                                                    target, head_dir):
    """8 random edit sequences of 3 suggestions with the feature drafter: each suggestion is
    the target's greedy continuation of the edited text (the feature is reused while the text
    before its position is kept, else a K = 0 round fetches a fresh one)."""

    async def run() -> int:
        drafted = 0
        async with AsyncEdgeClient(verifier.address, tiny_llama_pair.draft_dir,
                                   feature_head=head_dir) as client:
            for seq in range(8):
                rng = random.Random(7000 + seq)
                text = [1] + [rng.randrange(3, 96) for _ in range(rng.randint(4, 12))]
                suggestion: list[int] = []
                config = GenerationConfig(draft_len=3, ignore_eos=True, drafter="feature")
                async with client.document(config) as doc:
                    for number in range(3):
                        if number:
                            text = random_edit(rng, text, suggestion, 96)
                        n = rng.randint(2, 6)
                        s = await doc.suggest(text, max_new_tokens=n)
                        assert s.token_ids == hf_greedy(target, text, n), (seq, number)
                        suggestion = s.token_ids
                        drafted += s.stats.drafted
        return drafted

    assert asyncio.run(run()) > 0


def test_a_head_for_other_weights_or_a_verifier_without_features_is_refused(
        verifier, plain_verifier, tiny_llama_pair, head_dir, tmp_path):
    other = export_untrained_head(tiny_llama_pair.target_dir, tmp_path / "other",
                                  fingerprint="sha256:" + "1" * 64)
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir, feature_head=other) as c:
        with pytest.raises(IncompatibleVerifier, match="trained for another target feature"):
            list(c.generate(PROMPT, FEATURE))
    fp16_head = export_untrained_head(tiny_llama_pair.target_dir, tmp_path / "int8",
                                      codec="int8-g16")
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir, feature_head=fp16_head) as c:
        with pytest.raises(IncompatibleVerifier, match="dtype 'int8-g16'"):
            list(c.generate(PROMPT, FEATURE))
    with EdgeClient(plain_verifier.address, tiny_llama_pair.draft_dir,
                    feature_head=head_dir) as c:
        with pytest.raises(IncompatibleVerifier, match="serves no target features"):
            list(c.generate(PROMPT, FEATURE))
        with pytest.raises(IncompatibleVerifier, match="serves no target features"):
            c.document(FEATURE)
        # Independent drafts still run there.
        assert len(list(c.generate(PROMPT, GenerationConfig(max_new_tokens=3)))) > 0


def test_sampled_feature_drafts_follow_the_target_distribution(verifier, tiny_llama_pair,
                                                               target, head_dir):
    """The joint law of generated tokens 2 and 3, which the feature head drafts (token 1 comes
    from the open's K = 0 round, which fetches the first feature), through the full gRPC path.

    n = 2000 generations (seeds 0..1999) at temperature 1, top-k 4, K = 2, against the exact
    target law sum_a p(a) p(b | a) p(c | a, b). Per bin |count - n p| <= 6 sqrt(n p (1 - p)) +
    5, and a pair with p = 0 never appears; and the bound rejects the head's own law (power).
    """
    n, params = 2000, SamplingParams(temperature=1.0, top_k=4)
    vocab = target.vocab_size
    with torch.no_grad():
        p1 = target_probs(target.model(torch.tensor([PROMPT])).logits[0, -1:], params)[0]
        firsts = torch.nonzero(p1).flatten()
        joint = np.zeros((vocab, vocab))
        for a in firsts.tolist():
            ctx = torch.tensor([PROMPT + [a]])
            p2 = target_probs(target.model(ctx).logits[0, -1:], params)[0]
            seconds = torch.nonzero(p2).flatten()
            batch = torch.cat([ctx.expand(len(seconds), -1), seconds[:, None]], dim=1)
            p3 = target_probs(target.model(batch).logits[:, -1], params)  # [S, V]
            joint[seconds.numpy()] += (p1[a] * p2[seconds, None] * p3).numpy()
    counts = np.zeros_like(joint)
    drafted = 0
    with EdgeClient(verifier.address, tiny_llama_pair.draft_dir, feature_head=head_dir) as c:
        for seed in range(n):
            gen = c.generate(PROMPT, GenerationConfig(
                max_new_tokens=4, temperature=1.0, top_k=4, seed=seed, draft_len=2,
                ignore_eos=True, drafter="feature"))
            list(gen)
            counts[gen.token_ids[1], gen.token_ids[2]] += 1
            drafted += gen.stats.drafted
    assert drafted >= n  # the feature head drafted tokens 2 and 3 (K = 2 after the open)
    assert counts[joint == 0].sum() == 0, "a pair with target probability 0 appeared"
    expected = n * joint
    bound = 6 * np.sqrt(n * joint * (1 - joint)) + 5
    worst = np.max(np.abs(counts - expected) - bound)
    assert worst <= 0, f"a bin is off by {worst:.1f} beyond its bound"
    # The test has power: had tokens 2 and 3 followed the head's own law, it would fail.
    head_joint = _head_joint(target, head_dir, p1.numpy(), temperature=1.0, top_k=4)
    assert head_joint.sum() == pytest.approx(1.0, abs=1e-5)
    assert np.max(np.abs(n * head_joint - expected) - bound) > 0


def _head_joint(target, head_dir, p1: np.ndarray, temperature: float,
                top_k: int) -> np.ndarray:
    """The law of tokens 2 and 3 had they been the head's own samples: token 1 from the
    target (the open's round), then the head's chain from the feature that decided it."""
    from edge_client.drafter import DraftSampling
    from edge_client.feature_draft import FeatureHead, read_spec

    head = FeatureHead(head_dir, read_spec(head_dir))
    captured = []
    hook = target.model.model.norm.register_forward_hook(
        lambda _m, _i, out: captured.append(out[0, -1].detach().float().numpy()))
    try:
        with torch.no_grad():
            target.model(torch.tensor([PROMPT]))
    finally:
        hook.remove()
    feature = head.codec.encode(captured[-1])
    sampling = DraftSampling(temperature, top_k, 1.0, 0)
    rng = np.random.default_rng(0)

    def law(tail: list[int]) -> np.ndarray:
        ids, probs = head.propose(feature, tail, 1, sampling, rng).q[0]
        dense = np.zeros(len(p1))
        dense[ids] = probs
        return dense

    joint = np.zeros((len(p1), len(p1)))
    for a in np.flatnonzero(p1):
        q2 = law([int(a)])
        for b in np.flatnonzero(q2):
            joint[b] += p1[a] * q2[b] * law([int(a), int(b)])
    return joint


def _batching_run(target, batched: bool, features: bool) -> tuple[list, list]:
    """test_batching's 8 sessions of mixed lengths and K, sampled, the even ones asking for
    features: (committed per session, per round the decoded features of the askers)."""
    from test_batching import DRAFT_LENGTHS, ROUNDS, drafts_for, prompt

    from cloud_verifier.engine import VerifierEngine
    from cloud_verifier.features import feature_serving
    from cloud_verifier.sessions import SessionStore

    serving = feature_serving(target.model, "fp16", packed=True) if features else None
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context,
                            features=serving)
    store = SessionStore(max_sessions=8, ttl_s=60, on_close=engine.release)
    sessions = [store.create("me", SamplingParams(1.0, 20, 1.0, seed=i),
                             prompt(i, target.vocab_size), 0, frozenset()) for i in range(8)]
    for i, s in enumerate(sessions):
        s.want_feature = i % 2 == 0
    got = []
    for _ in range(ROUNDS):
        rounds = [(s, drafts_for(s.committed, DRAFT_LENGTHS[i], target.vocab_size, True))
                  for i, s in enumerate(sessions)]
        outcomes = engine.run_batch(rounds) if batched else [engine.run_round(s, d)
                                                             for s, d in rounds]
        for i, o in enumerate(outcomes):
            assert (o.feature is not None) == (features and i % 2 == 0)
            if o.feature is not None:
                assert o.feature_position == len(sessions[i].committed) - 1
                got.append(codec_named("fp16").decode(o.feature.values, o.feature.scales, 32))
    return [s.committed for s in sessions], got


def test_features_change_no_output_and_batched_equals_one_at_a_time(target):
    committed, batched = _batching_run(target, batched=True, features=True)
    alone_committed, alone = _batching_run(target, batched=False, features=True)
    assert committed == alone_committed == _batching_run(target, True, False)[0]
    assert len(batched) == len(alone) == 4 * 6
    for a, b in zip(batched, alone, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-3)
