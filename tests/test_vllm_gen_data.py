"""``gen-data --engine vllm`` on the real SmolLM2 target, in the vLLM environment (``make
test-vllm``): the shards record the target's own distribution at temperature 1 at every
generated token (checked against a teacher-forced forward of the built-in target), greedy rows
follow the argmax, a rerun skips finished shards, sampled rows come back the same from the same
seed, and the manifest says which engine wrote each shard.

Under CI a missing vLLM fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import require_vllm

from edge_client.tools.distill.data import GenConfig, gen_data
from edge_client.tools.distill.prompts import prompt_split
from edge_client.tools.distill.shards import list_shards, read_shard

pytestmark = pytest.mark.vllm

TOP_K = 8
NEW_TOKENS = 24
PROMPTS = 12


@pytest.fixture(scope="module")
def writer(real_assets):
    require_vllm()
    from edge_client.tools.distill.data_vllm import VllmWriter

    return VllmWriter.start(real_assets[0], "float32", threads=0)


@pytest.fixture(scope="module")
def data(writer, real_assets, tmp_path_factory):
    cfg = GenConfig(target=real_assets[0], out=tmp_path_factory.mktemp("vllm-data"),
                    shard_size=6, max_new_tokens=NEW_TOKENS, top_k=TOP_K,
                    sample_fraction=0.5, temperature=0.8, seed=3, engine="vllm")
    prompts = prompt_split("train")[:PROMPTS]
    gen_data(cfg, prompts, vllm_writer=writer)
    return cfg, prompts


def test_shards_hold_the_targets_distribution_at_every_generated_token(data, real_assets):
    import torch

    from cloud_verifier.target_model import load_target

    cfg, _ = data
    target = load_target(real_assets[0], device="cpu")
    model, eos = target.model, set(target.eos_token_ids)
    shards = list_shards(cfg.out)
    assert len(shards) == 2
    samples = [s for p in shards for s in read_shard(p)]
    assert len(samples) == PROMPTS
    assert {s.sampled for s in samples} == {True, False}  # both kinds were written
    worst_gap = 0.0
    for s in samples:
        g = len(s.gen_ids)
        assert s.topk_ids.shape == s.topk_logp.shape == (g, TOP_K)
        assert g == NEW_TOKENS or int(s.gen_ids[-1]) in eos
        assert np.all(np.diff(s.topk_logp.astype(np.float32), axis=1) <= 0)
        ids = torch.from_numpy(np.concatenate([s.prompt_ids, s.gen_ids]).astype(np.int64))
        with torch.inference_mode():
            logits = model(input_ids=ids[None]).logits[0, len(s.prompt_ids) - 1:-1].float()
        ref_logp, ref_ids = torch.log_softmax(logits, -1).topk(TOP_K, -1)
        got = s.topk_logp.astype(np.float32)
        gap = np.abs(got - ref_logp.numpy())
        worst_gap = max(worst_gap, float(gap.max()))
        # float16 storage (~1e-3 relative) plus the engines' own rounding.
        assert gap.max() < 0.05, (s.prompt_ids[:8], gap.max())
        # Ids agree except where two candidates are within rounding of each other.
        same = s.topk_ids == ref_ids.numpy()
        near_tie = np.abs(np.diff(ref_logp.numpy(), axis=1, prepend=np.inf)) < 0.02
        near_tie |= np.roll(near_tie, -1, axis=1)
        assert np.all(same | near_tie)
        if not s.sampled:
            top1_clear = (ref_logp[:, 0] - ref_logp[:, 1]).numpy() > 0.02
            assert np.all((s.gen_ids == s.topk_ids[:, 0]) | ~top1_clear)
    print(f"largest |log p| gap against the built-in forward: {worst_gap:.4f}")


def test_a_rerun_skips_finished_shards_and_sampling_repeats_from_its_seed(data, writer):
    import json

    cfg, prompts = data
    shards = list_shards(cfg.out)
    before = {p.name: p.stat().st_mtime_ns for p in shards}
    gen_data(cfg, prompts, vllm_writer=writer)
    assert {p.name: p.stat().st_mtime_ns for p in list_shards(cfg.out)} == before
    manifest = json.loads((cfg.out / "manifest.json").read_text())
    assert {m["engine"] for m in manifest["shards"].values()} == {"vllm-float32"}
    assert manifest["total_tokens"] == sum(len(s.gen_ids) for p in shards for s in read_shard(p))

    first = read_shard(shards[0])
    shards[0].unlink()
    gen_data(cfg, prompts, vllm_writer=writer)
    again = read_shard(shards[0])
    for a, b in zip(first, again, strict=True):
        assert a.sampled == b.sampled
        assert np.array_equal(a.gen_ids, b.gen_ids)


def test_seeded_rows_with_more_prompt_than_a_step_holds(writer):
    """48 sampled rows of 300+ prompt tokens each, far more than one engine step takes: with
    vLLM's chunked prefill a seeded request's partial prefill crashed the CPU engine ("CPU
    Generator does not use offset"; the first corpus run died of it). The writer starts vLLM
    without chunking: every row comes back, and again the same from the same seeds."""
    from edge_client.tools.distill.data_vllm import VllmRow

    rows = [VllmRow(i, [(i * 7 + j) % 40000 + 100 for j in range(300 + i)], True)
            for i in range(48)]
    first = writer.generate(rows, 8, TOP_K, 0.8, seed=5)
    again = writer.generate(rows, 8, TOP_K, 0.8, seed=5)
    assert [len(s.gen_ids) for s in first] == [8] * len(rows)
    assert all(np.array_equal(a.gen_ids, b.gen_ids) for a, b in zip(first, again, strict=True))


def test_labels_from_prompt_logprobs_match_what_generation_recorded(data, writer):
    """A corpus restore labels archived ids with ``VllmWriter.label``: one prefill of prompt +
    continuation, p's top-k read from vLLM's prompt logprobs. On a shard that vLLM wrote in
    float32 they are the recorded ones: the top-1 at every position (ties below 1e-3 aside)
    and log p within 1e-2 (the prefill and the decode steps batch differently)."""
    from edge_client.tools.distill.shards import Sample

    cfg, _ = data
    rows = [s for p in list_shards(cfg.out) for s in read_shard(p)]
    bare = [Sample(s.prompt_ids, s.gen_ids, np.zeros((0, 0), np.int64),
                   np.zeros((0, 0), np.float16), s.sampled) for s in rows]
    labelled = writer.label(bare, TOP_K)
    positions = 0
    for s, got in zip(rows, labelled, strict=True):
        assert got.topk_ids.shape == s.topk_ids.shape and np.array_equal(got.gen_ids, s.gen_ids)
        clear = (s.topk_logp[:, 0].astype(np.float32) - s.topk_logp[:, 1]) > 1e-3
        assert np.array_equal(got.topk_ids[clear, 0], s.topk_ids[clear, 0])
        np.testing.assert_allclose(got.topk_logp[:, 0].astype(np.float32),
                                   s.topk_logp[:, 0].astype(np.float32), atol=1e-2)
        positions += len(s.gen_ids)
    assert positions >= PROMPTS  # every row had tokens to compare
