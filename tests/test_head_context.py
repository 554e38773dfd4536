"""Context heads (``head_context``) on the tiny target: prompt features recorded and
backfilled, the unrolled training passes equal to the device's step-by-step cached drafting,
the held-out metric equal to replayed rounds, and train-head --context end to end."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from feature_heads import context_data, one_torch_thread  # noqa: F401

from edge_client.tools.distill.cli import main as distill_main
from edge_client.tools.distill.head_context import (
    backfill_prompt_features,
    context_sequences,
    evaluate_context,
    make_context_batch,
    unrolled_passes,
)
from edge_client.tools.distill.head_eval import replay_rounds
from edge_client.tools.distill.head_model import HeadArch, build_head
from edge_client.tools.distill.head_train import HeadTrainConfig, train_head
from edge_client.tools.distill.shards import list_shards, load_samples, read_shard, write_shard
from edge_client.tools.distill.vocab import VocabMap

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCH = HeadArch(sub_vocab=48, intermediate=64, max_chain=16)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    return context_data(tmp_path_factory.mktemp("ctx"))


def _head(data, seed: int = 0):
    """A head whose drafts vary with their inputs (a random init scaled up)."""
    samples = load_samples(list_shards(data["train"]))
    ids = np.arange(48, dtype=np.int64)
    ids[-1] = -1
    vmap = VocabMap(ids, 96)
    head = build_head(ARCH, data["target"], vmap, seed).eval()
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.4)
        head.q_proj.weight.normal_(0, 0.3)
        head.k_proj.weight.normal_(0, 0.3)
    return head, vmap, samples


def _teacher_forced(target: Path, ids: np.ndarray) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model.model(torch.from_numpy(ids.astype(np.int64))[None]).last_hidden_state[0]\
            .numpy()


def test_gen_data_records_prompt_features_and_backfill_reproduces_them(data, tmp_path):
    samples = load_samples(list_shards(data["train"]))
    s = samples[3]
    assert s.prompt_features.shape == (len(s.prompt_ids), s.features.shape[1])
    want = _teacher_forced(data["target"], s.prompt_ids)
    assert np.abs(s.prompt_features.astype(np.float32) - want).max() < 0.02
    assert np.abs(s.prompt_features[-1].astype(np.float32)
                  - s.features[0].astype(np.float32)).max() < 0.02
    # An older shard without them, backfilled: the same rows.
    old = tmp_path / "old"
    old.mkdir()
    src = list_shards(data["train"])[0]
    with np.load(src) as z:
        index = z["prompt_index"]
    recorded = read_shard(src)
    write_shard(old / src.name, [replace(r, prompt_features=None) for r in recorded], index)
    res = backfill_prompt_features(old, data["target"], batch_size=4, threads=1)
    assert res["shards"] == 1 and res["max_alignment_error"] < 0.02
    again = read_shard(old / src.name)
    for a, b in zip(recorded, again, strict=True):
        assert np.abs(a.prompt_features.astype(np.float32)
                      - b.prompt_features.astype(np.float32)).max() < 0.02
    assert backfill_prompt_features(old, data["target"])["shards"] == 0  # resumable


def test_unrolled_passes_equal_step_by_step_cached_drafting(data):
    """Pass s at position j must be what the device computes at draft step s: the real pairs
    up to j-s+1 in the cache, then the chain fed its own predicted features."""
    head, vmap, samples = _head(data)
    seqs = context_sequences(samples)
    passes = 4
    for seq in seqs[:3]:
        batch = make_context_batch([seq], vmap.full_to_sub(), 256)
        with torch.inference_mode():
            outs = unrolled_passes(head, batch.ids, batch.features, passes)
            n = batch.ids.shape[1]
            for last_real in range(0, n - passes + 1, 2):
                pk, pv = head.empty_cache(1)
                logits, g, pk, pv = head(batch.ids[:, :last_real + 1],
                                         batch.features[:, :last_real + 1], pk, pv)
                logits, g = logits[:, -1:], g[:, -1:]
                for s in range(1, passes + 1):
                    j = last_real + s - 1
                    torch.testing.assert_close(logits[0, 0], outs[s - 1][0][0, j],
                                               atol=2e-4, rtol=1e-4)
                    torch.testing.assert_close(g[0, 0], outs[s - 1][1][0, j], atol=2e-4,
                                               rtol=1e-4)
                    if j + 1 < n:
                        logits, g, pk, pv = head(batch.ids[:, j + 1:j + 2], g, pk, pv)


def test_held_out_metric_equals_rounds_replayed_with_the_cached_head(data):
    head, vmap, _ = _head(data, seed=1)
    seqs = context_sequences(load_samples(list_shards(data["heldout"])))
    got = evaluate_context(head, vmap, seqs, k=3)
    full_to_sub = vmap.full_to_sub()
    out_full = vmap.sub_to_full[vmap.sub_to_full >= 0]
    counts = []
    for seq in seqs:
        gen = seq.tokens[seq.prompt_len:]

        def drafts_at(a: int, n: int, seq=seq) -> list[int]:
            c = seq.prompt_len + a  # committed t_0 .. t_c: real pairs 0 .. c-1
            ids = torch.from_numpy(full_to_sub[seq.tokens[1:c + 1]])[None]
            feats = torch.from_numpy(seq.features[:c].astype(np.float32))[None]
            with torch.inference_mode():
                pk, pv = head.empty_cache(1)
                logits, g, pk, pv = head(ids, feats, pk, pv)
                logits, g = logits[:, -1:], g[:, -1:]
                out = []
                for _ in range(n):  # the head's own drafts, as on the device
                    out.append(int(out_full[int(logits[0, 0].argmax())]))
                    sub = torch.tensor([[full_to_sub[out[-1]]]])
                    logits, g, pk, pv = head(sub, g, pk, pv)
            return out

        counts.append(replay_rounds(drafts_at, gen, 3))
    accepted = sum(c["accepted"] for c in counts)
    judged = sum(c["judged"] for c in counts)
    assert got["rounds"] == sum(c["rounds"] for c in counts)
    assert got["greedy_alpha"] == round(accepted / judged, 4)


def _cfg(data, run: Path, steps: int, **kw) -> HeadTrainConfig:
    return HeadTrainConfig(run_dir=run, data=data["train"], heldout=data["heldout"],
                           target=data["target"], arch=ARCH, steps=steps, batch_size=4,
                           lr=1e-2, warmup=1, eval_every=0, log_every=5, ckpt_every_s=1e9,
                           lr_steps=40, threads=1, context=True, passes=3, **kw)


def test_context_training_learns_resumes_and_refuses_what_it_cannot_do(data, tmp_path,
                                                                        caplog):
    run = tmp_path / "run"
    train_head(replace(_cfg(data, run, 40), eval_every=40))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert losses[-1] < 0.7 * losses[0], losses  # 40 steps of 4 sequences each
    held = [m["heldout"] for m in metrics if "heldout" in m]
    assert held and held[-1]["rounds"] > 0
    assert json.loads((run / "run.json").read_text())["context"] is True

    # Resumed halfway, it lands on the same weights as one run through.
    split = tmp_path / "split"
    train_head(_cfg(data, split, 20))
    train_head(_cfg(data, split, 40))
    whole = torch.load(run / "ckpt.pt", weights_only=False)["model"]
    parts = torch.load(split / "ckpt.pt", weights_only=False)["model"]
    for name, value in whole.items():
        torch.testing.assert_close(parts[name], value)

    with pytest.raises(ValueError, match="same --context"):
        train_head(replace(_cfg(data, run, 41), context=False))
    assert distill_main(["export-head", "--run-dir", str(run), "--out",
                         str(tmp_path / "x")]) != 0
    assert "is a context head" in caplog.text and not (tmp_path / "x").exists()
    stripped = tmp_path / "stripped"
    stripped.mkdir()
    src = list_shards(data["train"])[0]
    with np.load(src) as z:
        index = z["prompt_index"]
    write_shard(stripped / src.name,
                [replace(r, prompt_features=None) for r in read_shard(src)], index)
    with pytest.raises(ValueError, match="prompt-features"):
        train_head(replace(_cfg(data, tmp_path / "r2", 2), data=stripped, heldout=None))
