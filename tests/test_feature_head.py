"""The feature head (a draft conditioned on the target's hidden state) on the tiny target:
train-head, resume, export, the edge runtime against torch, q, and the fingerprint checks."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from feature_heads import distill_prompts, one_torch_thread  # noqa: F401

from edge_client.drafter import DraftSampling
from edge_client.errors import IncompatibleVerifier
from edge_client.feature_draft import FeatureHead, read_spec
from edge_client.tools.distill.cli import main as distill_main
from edge_client.tools.distill.data import GenConfig, gen_data
from edge_client.tools.distill.head_export import INPUTS, OUTPUTS
from edge_client.tools.distill.head_model import (
    HeadArch,
    build_head,
    load_head_run,
    target_fingerprint,
    target_tensors,
    wire_round_trip,
)
from edge_client.tools.distill.head_train import (
    ChainIndex,
    HeadTrainConfig,
    chain_loss,
    make_chain_batch,
    train_head,
)
from edge_client.tools.distill.shards import list_shards, load_samples
from edge_client.tools.distill.vocab import VocabMap
from shared.feature_codec import DEFAULT_CODEC, EncodedFeature, codec_named
from shared.fingerprint import fingerprint_tensor_names, weights_fingerprint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SUB_VOCAB = 48  # of the tiny 96: exercises the <unk> slot and the output index map
ARCH = HeadArch(sub_vocab=SUB_VOCAB, intermediate=64, max_chain=16)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    from conftest import save_tiny_llama

    root = tmp_path_factory.mktemp("head")
    target = save_tiny_llama(root / "target", num_layers=2, seed=0)  # no ONNX draft needed
    cfg = GenConfig(target=target, out=root / "train", shard_size=6,
                    batch_size=6, max_new_tokens=16, top_k=8, sample_fraction=0.5,
                    features=True, threads=1)
    gen_data(cfg, distill_prompts(12))
    gen_data(replace(cfg, out=root / "heldout", sample_fraction=0.0), distill_prompts(4, offset=40))
    return {"train": root / "train", "heldout": root / "heldout",
            "target": target, "root": root}


def _cfg(data, run: Path, steps: int, **kw) -> HeadTrainConfig:
    return HeadTrainConfig(run_dir=run, data=data["train"], heldout=data["heldout"],
                           target=data["target"], arch=ARCH, steps=steps, batch_size=16,
                           chain_len=4, lr=1e-2, warmup=1, eval_every=0, log_every=5,
                           ckpt_every_s=1e9, lr_steps=60, threads=1, **kw)


@pytest.fixture(scope="module")
def trained(data) -> Path:
    run = data["root"] / "run"
    train_head(replace(_cfg(data, run, 60), eval_every=60))
    return run


@pytest.fixture(scope="module")
def exported(data, trained) -> Path:
    out = data["root"] / "head"
    assert distill_main(["export-head", "--run-dir", str(trained), "--out", str(out),
                         "--heldout", str(data["heldout"]), "--no-target-timing"]) == 0
    return out


ENCODE = codec_named(DEFAULT_CODEC).encode


def test_feature_codecs_round_trip_is_the_one_training_sees():
    rng = np.random.default_rng(0)
    f = (rng.standard_normal(576) * 3).astype(np.float32)
    f[7] = 20.0  # an outlier dimension, as SmolLM2's features have
    fp16 = codec_named("fp16")
    e = fp16.encode(f)
    assert len(e.values) == 1152 == fp16.nbytes(576) and e.scales == ()
    back = fp16.decode(e.values, e.scales, 576)
    np.testing.assert_array_equal(back, f.astype(np.float16).astype(np.float32))
    g32 = codec_named("int8-g32")
    e = g32.encode(f)
    assert len(e.values) == 576 and len(e.scales) == 18 and g32.nbytes(576) == 648
    back = g32.decode(e.values, e.scales, 576)
    scales = np.repeat(np.asarray(e.scales, np.float32), 32)
    assert (np.abs(back - f) <= scales / 2 + 1e-6).all()
    # Only the outlier's group pays for it: the others keep their own, finer scale.
    assert e.scales[0] == pytest.approx(20 / 127) and max(e.scales[1:]) < 14 / 127
    # The single-scale absmax of before is the one-group case.
    one = codec_named("int8-g576").encode(f)
    assert one.scales == (pytest.approx(20 / 127),)
    for codec in (fp16, g32):
        batch = np.stack([f, -f, np.zeros(576, np.float32)])
        trip = codec.round_trip(batch)
        for row, want in zip(batch, trip, strict=True):
            e = codec.encode(row)
            np.testing.assert_array_equal(codec.decode(e.values, e.scales, 576), want)
        np.testing.assert_array_equal(
            wire_round_trip(torch.from_numpy(batch), codec.name).numpy(), trip)
    assert codec_named("int8-g8").encode(np.zeros(8)).scales == (1.0,)
    with pytest.raises(ValueError, match="bytes"):
        g32.decode(e.values[:-1], e.scales, 576)
    with pytest.raises(ValueError, match="bytes"):
        fp16.decode(fp16.encode(f).values, (1.0,), 576)
    with pytest.raises(ValueError, match="> 0"):
        g32.decode(g32.encode(f).values, (0.0,) * 18, 576)
    with pytest.raises(ValueError, match="multiple of 32"):
        g32.encode(f[:40])
    with pytest.raises(ValueError, match="unknown feature codec"):
        codec_named("int4")


def test_weights_fingerprint_follows_the_weights_not_their_precision(data):
    names = fingerprint_tensor_names(2)
    w = target_tensors(data["target"], set(names))
    fp = weights_fingerprint(w, 2)
    assert fp == target_fingerprint(data["target"]) and fp.startswith("sha256:")
    # The same weights served in bfloat16 give the same fingerprint.
    as_bf16 = {k: torch.from_numpy(v).bfloat16().float().numpy() for k, v in w.items()}
    assert weights_fingerprint(as_bf16, 2) == fp
    moved = dict(w)
    moved["model.layers.1.mlp.down_proj.weight"] = w["model.layers.1.mlp.down_proj.weight"] * 1.1
    assert weights_fingerprint(moved, 2) != fp
    with pytest.raises(KeyError, match="model.norm.weight"):
        weights_fingerprint({k: v for k, v in w.items() if k != "model.norm.weight"}, 2)


def test_training_reduces_the_chain_loss(data, trained):
    samples = load_samples(list_shards(data["train"]))
    _, vmap, _, ck = load_head_run(trained)
    fresh = build_head(ARCH, data["target"], vmap, 0).eval()
    head, *_ = load_head_run(trained)
    full_to_head = np.full(vmap.full_vocab_size, -1)
    real = vmap.sub_to_full >= 0
    full_to_head[vmap.sub_to_full[real]] = np.arange(real.sum())
    starts = ChainIndex(samples).draw(np.random.default_rng(123), 64)
    batch = make_chain_batch(samples, starts, 4, vmap.full_to_sub(), full_to_head)
    with torch.no_grad():
        before, _ = chain_loss(fresh, batch, 1.0, 1.0, DEFAULT_CODEC)
        after, parts = chain_loss(head, batch, 1.0, 1.0, DEFAULT_CODEC)
    assert float(after) < 0.7 * float(before), (float(before), float(after))
    res = ck["state"]["heldout"]
    assert res["samples"] == 4 and 0 <= res["greedy_alpha"] <= 1
    assert res["tokens_per_round"] >= 1
    assert "wall time" in (trained / "CARD.md").read_text()
    # The frozen target rows did not move.
    rows = target_tensors(data["target"], {"lm_head.weight"})["lm_head.weight"]
    np.testing.assert_array_equal(head.lm_head.weight.numpy(), rows[vmap.sub_to_full[real]])


def test_resumed_training_lands_on_the_weights_of_one_uninterrupted_run(data, tmp_path):
    train_head(_cfg(data, tmp_path / "a", 6))
    train_head(_cfg(data, tmp_path / "b", 3))
    state = train_head(_cfg(data, tmp_path / "b", 6))
    assert state["step"] == 6
    a = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)["model"]
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def _torch_chain(head, vmap: VocabMap, feature: np.ndarray, tokens: list[int]):
    """Per step (full-vocab logits, next feature) of a chain fed ``tokens`` (full ids)."""
    full_to_sub = vmap.full_to_sub()
    out_full = vmap.sub_to_full[vmap.sub_to_full >= 0]
    g = torch.from_numpy(feature)[None, None]
    past_k, past_v = head.empty_cache(1)
    out = []
    with torch.no_grad():
        for t in tokens:
            ids = torch.tensor([[full_to_sub[t]]])
            logits, g, past_k, past_v = head(ids, g, past_k, past_v)
            full = np.full(vmap.full_vocab_size, -np.inf, dtype=np.float32)
            full[out_full] = logits[0, 0].numpy()
            out.append((full, g[0, 0].numpy()))
    return out


def test_exported_graph_equals_torch_along_a_chain(data, trained, exported):
    import onnxruntime as ort

    head, vmap, *_ = load_head_run(trained)
    sample = load_samples(list_shards(data["heldout"]))[0]
    feature = ENCODE(sample.features[0].astype(np.float32))
    decoded = codec_named(DEFAULT_CODEC).decode(feature.values, feature.scales, 32)
    tail = [int(t) for t in sample.gen_ids[:3]]  # a feature a round late: 3 known tokens
    spec = read_spec(exported)
    fp32 = FeatureHead(trained / "onnx-fp32", spec, intra_op_threads=1)
    greedy = fp32.propose(feature, tail, 4, DraftSampling(), np.random.default_rng(0))
    chain = _torch_chain(head, vmap, decoded, tail + greedy.tokens[:-1])
    want = [int(np.argmax(logits)) for logits, _ in chain[len(tail) - 1:]]
    assert greedy.tokens == want
    assert greedy.q is None and len(greedy.confidence) == 4

    sess = ort.InferenceSession(str(trained / "onnx-fp32" / "model.onnx"))
    assert [i.name for i in sess.get_inputs()] == list(INPUTS)
    assert [o.name for o in sess.get_outputs()] == list(OUTPUTS)
    g = decoded[None, None]
    past = np.zeros((1, head.kv_heads, 0, head.head_dim), np.float32)
    cache = (past, past)
    real = vmap.sub_to_full >= 0
    for t, (logits, nxt) in zip(tail + greedy.tokens[:-1], chain, strict=True):
        out, g, *cache = sess.run(None, {"input_ids": np.array([[vmap.full_to_sub()[t]]]),
                                         "features": g, "past_key": cache[0],
                                         "past_value": cache[1]})
        np.testing.assert_allclose(out[0, 0], logits[vmap.sub_to_full[real]], rtol=1e-4,
                                   atol=1e-4)
        np.testing.assert_allclose(g[0, 0], nxt, rtol=1e-4, atol=1e-4)

    meta = json.loads((exported / "feature_head.json").read_text())
    assert meta["kind"] == "feature-head" and meta["feature_layer"] == "final_norm"
    assert meta["target_fingerprint"] == target_fingerprint(data["target"])
    assert meta["hidden_size"] == 32 and meta["feature_dtype"] == DEFAULT_CODEC
    results = json.loads((exported / "head_results.json").read_text())
    assert results["int8"]["bytes"] < results["fp32"]["bytes"]
    for name in ("torch", "fp32", "int8"):
        assert 0 <= results[name]["greedy_alpha"] <= 1
    # The runtime replays the same rounds as the batched torch evaluation.
    assert results["fp32"]["greedy_alpha"] == pytest.approx(results["torch"]["greedy_alpha"],
                                                            abs=0.02)
    assert "wall time" in (exported / "MODEL_CARD.md").read_text()


def test_sampled_drafts_carry_the_exact_q_they_were_drawn_from(data, exported):
    head = FeatureHead(exported, read_spec(exported), intra_op_threads=1)
    sample = load_samples(list_shards(data["heldout"]))[1]
    feature = ENCODE(sample.features[0].astype(np.float32))
    tail = [int(sample.gen_ids[0])]
    sampling = DraftSampling(temperature=1.0, top_k=6, max_support=64)
    kept = set(np.load(exported / "vocab_map.npz")["sub_to_full"].tolist()) - {-1}
    prop = head.propose(feature, tail, 3, sampling, np.random.default_rng(1))
    assert len(prop.tokens) == len(prop.q) == 3
    for token, (ids, probs) in zip(prop.tokens, prop.q, strict=True):
        assert 0 < len(ids) <= 6 and len(set(ids.tolist())) == len(ids)
        assert set(ids.tolist()) <= kept and token in ids.tolist()
        assert probs.dtype == np.float32 and (probs > 0).all()
        assert abs(float(probs.sum()) - 1) < 1e-6 and (np.diff(probs) <= 0).all()
    # d_1 follows its q: 2000 draws (seeded), total variation to q below 0.05 (its noise is
    # about 0.02 for a support of 6).
    n, rng = 2000, np.random.default_rng(2)
    ids, probs = prop.q[0]
    counts = {int(i): 0 for i in ids}
    for _ in range(n):
        d = head.propose(feature, tail, 1, sampling, rng)
        np.testing.assert_array_equal(d.q[0][0], ids)
        counts[d.tokens[0]] += 1
    tv = 0.5 * sum(abs(counts[int(i)] / n - float(p)) for i, p in zip(ids, probs, strict=True))
    assert tv < 0.05, tv


def test_a_head_for_other_target_weights_refuses_to_load(exported):
    spec = read_spec(exported)
    other = replace(spec, target_fingerprint="sha256:" + "0" * 64)
    with pytest.raises(IncompatibleVerifier, match="trained for another target feature"):
        FeatureHead(exported, other)
    with pytest.raises(IncompatibleVerifier, match="hidden_size"):
        FeatureHead(exported, replace(spec, hidden_size=576))
    head = FeatureHead(exported, spec, intra_op_threads=1)
    feature = ENCODE(np.ones(32))
    with pytest.raises(ValueError, match="positions"):
        head.propose(feature, [5] * 10, 8, DraftSampling(), np.random.default_rng(0))
    with pytest.raises(ValueError, match="bytes"):
        head.propose(EncodedFeature(feature.values[:32], ()), [5], 2, DraftSampling(),
                     np.random.default_rng(0))
    with pytest.raises(ValueError, match="outside"):
        head.propose(feature, [96], 2, DraftSampling(), np.random.default_rng(0))


def test_train_head_refuses_data_without_features(data, tmp_path):
    plain = GenConfig(target=data["target"], out=tmp_path / "plain", shard_size=4,
                      batch_size=4, max_new_tokens=4, top_k=8, threads=1)
    gen_data(plain, distill_prompts(2))
    with pytest.raises(ValueError, match="gen-data --features"):
        train_head(replace(_cfg(data, tmp_path / "run", 2), data=tmp_path / "plain"))
