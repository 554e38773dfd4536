"""edgespec-distill end to end on tiny random models: data -> train -> export -> int8 -> edge.

Also the resume semantics every stage promises: gen-data skips finished shards, and a training
run stopped at step N and rerun with more steps continues from its checkpoint, landing on the
same weights as one uninterrupted run.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, ModelDrafter
from edge_client.tools.distill.data import GenConfig, gen_data
from edge_client.tools.distill.evaluate import onnx_logits_fn, torch_logits_fn
from edge_client.tools.distill.export import ExportConfig, export
from edge_client.tools.distill.model import ArchConfig, build_draft, load_run
from edge_client.tools.distill.prompts import DistillPrompt, prompt_split
from edge_client.tools.distill.quantize import untie_lm_head
from edge_client.tools.distill.shards import list_shards, load_samples
from edge_client.tools.distill.train import TrainConfig, train
from edge_client.tools.distill.vocab import VocabMap

SUB_VOCAB = 48  # of the tiny 96: exercises the reduced-vocabulary path
TINY_ARCH = ArchConfig(init="scratch", hidden=32, layers=1, heads=4, kv_heads=2,
                       intermediate=64, sub_vocab=SUB_VOCAB, max_positions=128)


def _prompts(n: int, offset: int = 0) -> list[DistillPrompt]:
    out = []
    for i in range(offset, offset + n):
        words = " ".join(f"t{3 + (7 * i + 5 * j) % 40}" for j in range(3 + i % 4))
        out.append(DistillPrompt(words, "chat" if i % 2 else "ime", chat=bool(i % 2)))
    return out


@pytest.fixture(scope="module")
def data(tiny_llama_pair, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill")
    base = GenConfig(target=tiny_llama_pair.target_dir, out=root / "train", shard_size=4,
                     batch_size=3, max_new_tokens=10, top_k=8, sample_fraction=0.5)
    gen_data(base, _prompts(8))
    gen_data(replace(base, out=root / "heldout", sample_fraction=0.0), _prompts(3, offset=50))
    return {"root": root, "train": root / "train", "heldout": root / "heldout",
            "target": tiny_llama_pair.target_dir}


def _train_cfg(data, run: Path, steps: int, **kw) -> TrainConfig:
    return TrainConfig(run_dir=run, data=data["train"], heldout=data["heldout"],
                       target=data["target"], arch=kw.pop("arch", TINY_ARCH), steps=steps,
                       batch_size=3, lr=1e-2, warmup=1, eval_every=0, log_every=1,
                       ckpt_every_s=1e9, lr_steps=6, **kw)


def test_prompt_split_is_deterministic_and_disjoint():
    train_set, heldout = prompt_split("train"), prompt_split("heldout")
    assert len(heldout) >= 100 and len(train_set) >= 1000
    assert not {p.text for p in train_set} & {p.text for p in heldout}
    assert prompt_split("heldout") == heldout
    assert {p.kind for p in train_set} == {"chat", "code", "list", "fact", "ime"}
    assert all(not p.chat for p in train_set if p.kind == "ime")


@pytest.mark.parametrize("split", ["extra", "extra2", "extra3", "extra4"])
def test_extra_split_adds_training_topics_without_touching_heldout(split):
    from edge_client.tools.distill import prompts as dp

    heldout, extra = prompt_split("heldout"), prompt_split(split)
    assert len(extra) >= 1000
    earlier = dp.EXTRA_SPLITS[:dp.EXTRA_SPLITS.index(split)]
    others = prompt_split("train") + heldout + [p for e in earlier for p in prompt_split(e)]
    assert not {p.text for p in extra} & {p.text for p in others}
    # the held-out split is exactly what the base topics give, extra topics or not
    base = [p for p, key in dp._all_prompts() if dp._topic_bucket(key) in dp.HELDOUT_BUCKETS]
    assert heldout == list(dict.fromkeys(base))
    # no extra prompt shares a topic key with a held-out prompt
    heldout_keys = {k for _, k in dp._all_prompts() if dp._topic_bucket(k) in dp.HELDOUT_BUCKETS}
    extra_texts = {p.text for p in extra}
    assert not {k for p, k in dp._extra_prompts(split) if p.text in extra_texts} & heldout_keys
    assert {p.kind for p in extra} == {"chat", "code", "list", "fact", "ime"}
    with pytest.raises(ValueError, match="split must be one of"):
        prompt_split("validation")  # type: ignore[arg-type]


def test_gen_data_records_sparse_p_per_generated_token(data):
    shards = list_shards(data["train"])
    assert [p.name for p in shards] == ["shard-00000.npz", "shard-00001.npz"]
    samples = load_samples(shards)
    assert len(samples) == 8 and {s.sampled for s in samples} == {True, False}
    for s in samples:
        assert 1 <= len(s.gen_ids) <= 10
        assert s.topk_ids.shape == s.topk_logp.shape == (len(s.gen_ids), 8)
        p = np.exp(s.topk_logp.astype(np.float64))
        assert np.all(np.diff(s.topk_logp.astype(np.float64), axis=1) <= 1e-3)  # descending
        assert np.all(p.sum(1) <= 1 + 1e-2)
        if not s.sampled:  # greedy rows took p's argmax
            np.testing.assert_array_equal(s.gen_ids, s.topk_ids[:, 0])
    manifest = json.loads((data["train"] / "manifest.json").read_text())
    assert manifest["total_prompts"] == 8


def test_gen_data_resume_skips_finished_shards(data, tiny_llama_pair):
    first, second = list_shards(data["train"])
    before = first.stat().st_mtime_ns
    kept = second.read_bytes()
    second.unlink()
    gen_data(GenConfig(target=tiny_llama_pair.target_dir, out=data["train"], shard_size=4,
                       batch_size=3, max_new_tokens=10, top_k=8, sample_fraction=0.5),
             _prompts(8))
    assert first.stat().st_mtime_ns == before
    assert second.read_bytes() == kept  # regenerated identically (seeded)
    # Resuming with other settings would mix incompatible shards: refused, nothing written.
    with pytest.raises(ValueError, match="--shard-size 4 \\(not 5\\)"):
        gen_data(GenConfig(target=tiny_llama_pair.target_dir, out=data["train"], shard_size=5,
                           batch_size=3, max_new_tokens=10, top_k=8, sample_fraction=0.5),
                 _prompts(8))
    assert list_shards(data["train"]) == [first, second]


def test_train_export_quantize_and_draft_on_the_edge(data, tmp_path):
    state = train(_train_cfg(data, tmp_path / "run", steps=4))
    assert state["step"] == 4
    vmap = VocabMap.load(tmp_path / "run" / "vocab_map.npz")
    assert vmap.size <= SUB_VOCAB and vmap.full_vocab_size == 96
    assert (vmap.sub_to_full < 0).sum() == 1

    results = export(ExportConfig(tmp_path / "run", tmp_path / "draft", data["heldout"],
                                  data["target"], fp32_out=tmp_path / "fp32",
                                  twin_out=tmp_path / "twin"))
    assert results["target_step_ms"] > 0
    out = tmp_path / "draft"
    for name in ("model.onnx", "vocab_map.npz", "tokenizer.json", "MODEL_CARD.md", "config.json"):
        assert (out / name).is_file(), name
    assert results["int8"]["tokens"] == results["fp32"]["tokens"] > 0
    card = (out / "MODEL_CARD.md").read_text()
    assert "greedy_alpha" in card and "| total |" in card

    # fp32 ONNX equals the PyTorch draft, through the vocabulary map.
    ck = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    model = build_draft(TINY_ARCH, data["target"], vmap, 0)
    model.load_state_dict(ck["model"])
    ids = np.array([1, 5, 9, 80, 33, 2])  # 80 may be outside the subset: fed as <unk>
    ref = torch_logits_fn(model.eval(), vmap)(ids)
    got = onnx_logits_fn(tmp_path / "fp32")(ids)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], atol=1e-4, rtol=1e-4)

    # The tied LM head is untied for quantization (so int8 covers it too); untying alone
    # changes no logit.
    import onnx

    heads = [n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node
             if "lm_head" in n.name]
    assert heads and "MatMul" not in heads and not (out / "untied.onnx").exists()
    untied = tmp_path / "untied"
    shutil.copytree(tmp_path / "fp32", untied)
    assert untie_lm_head(tmp_path / "fp32" / "model.onnx", untied / "model.onnx")
    assert not untie_lm_head(untied / "model.onnx", tmp_path / "again.onnx")  # already untied
    np.testing.assert_allclose(onnx_logits_fn(untied)(ids)[finite], got[finite], atol=1e-5)

    # The full-vocabulary PyTorch twin: the same logits on kept ids, 0 elsewhere.
    twin = AutoModelForCausalLM.from_pretrained(tmp_path / "twin").eval()
    with torch.no_grad():
        twin_logits = twin(torch.tensor([ids])).logits[0].numpy()
    assert twin_logits.shape == ref.shape
    np.testing.assert_allclose(twin_logits[finite], ref[finite], atol=1e-4, rtol=1e-4)
    assert np.all(twin_logits[~finite] == 0)

    # The int8 draft runs in the edge runtime, full-vocabulary in and out.
    edge = OnnxDraftModel(out, intra_op_threads=1)
    assert edge.vocab_size == 96
    logits = edge.forward(edge.new_cache(), ids.tolist())
    assert logits.shape == (6, 96) and np.isneginf(logits).sum(1).min() >= 96 - SUB_VOCAB
    for temperature in (0.0, 0.8):
        drafter = ModelDrafter(edge, DraftSampling(temperature=temperature),
                               np.random.default_rng(0))
        proposal = drafter.propose([1, 5, 9], k=3)
        assert len(proposal.tokens) == 3
        assert all(t in set(vmap.sub_to_full[vmap.sub_to_full >= 0]) for t in proposal.tokens)


def test_train_resume_continues_from_checkpoint(data, tmp_path):
    interrupted, straight = tmp_path / "a", tmp_path / "b"
    assert train(_train_cfg(data, interrupted, steps=3))["step"] == 3
    state = train(_train_cfg(data, interrupted, steps=6))
    assert state["step"] == 6 and state["epoch"] >= 1  # 8 samples / batch 3: epoch 0 has 3
    steps = [json.loads(line)["step"] for line in (interrupted / "metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4, 5, 6]  # nothing redone, nothing skipped

    train(_train_cfg(data, straight, steps=6))
    a = torch.load(interrupted / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(straight / "ckpt.pt", weights_only=False)["model"]
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5)


def test_target_init_copies_embeddings_and_layers(data, tmp_path):
    from transformers import AutoModelForCausalLM

    arch = ArchConfig(init="target", target_layers=(1,), sub_vocab=SUB_VOCAB, max_positions=128)
    vmap = VocabMap(np.concatenate([np.arange(10, 10 + SUB_VOCAB - 1), [-1]]), 96)
    draft = build_draft(arch, data["target"], vmap, 0)
    target = AutoModelForCausalLM.from_pretrained(data["target"])
    emb = target.get_input_embeddings().weight
    rows = draft.get_input_embeddings().weight[:-1]
    torch.testing.assert_close(rows, emb[10 : 10 + SUB_VOCAB - 1])
    assert draft.lm_head.weight.data_ptr() == draft.get_input_embeddings().weight.data_ptr()
    torch.testing.assert_close(draft.model.layers[0].mlp.up_proj.weight,
                               target.model.layers[1].mlp.up_proj.weight)


def test_on_policy_data_is_written_by_the_draft_and_labelled_by_the_target(data, tmp_path):
    """gen-data --draft-run: the continuations are the run's draft's own greedy choices (ids in
    its head only), and every recorded top-k is the target's distribution at that position,
    the same numbers a token-by-token forward of the target gives."""
    run = tmp_path / "run"
    train(_train_cfg(data, run, steps=2))
    out = tmp_path / "onpolicy"
    cfg = GenConfig(target=data["target"], out=out, shard_size=4, batch_size=3,
                    max_new_tokens=8, top_k=8, sample_fraction=0.5, draft_run=run)
    gen_data(cfg, _prompts(5, offset=20))
    samples = load_samples(list_shards(out))
    assert len(samples) == 5 and {s.sampled for s in samples} == {True, False}

    draft, vmap = load_run(run, data["target"])
    head = set(vmap.sub_to_full[vmap.sub_to_full >= 0].tolist())
    draft_logits = torch_logits_fn(draft, vmap)
    target = AutoModelForCausalLM.from_pretrained(data["target"]).eval()
    for s in samples:
        assert set(s.gen_ids.tolist()) <= head
        seq = np.concatenate([s.prompt_ids, s.gen_ids])
        if not s.sampled:  # greedy rows are the draft's argmax, not the target's
            q = draft_logits(seq)[len(s.prompt_ids) - 1 : -1]
            np.testing.assert_array_equal(s.gen_ids, q.argmax(-1))
        with torch.no_grad():
            logp = torch.log_softmax(target(torch.tensor([seq])).logits[0].float(), -1)
        want = logp[len(s.prompt_ids) - 1 : -1].topk(8, dim=-1)
        np.testing.assert_array_equal(s.topk_ids, want.indices.numpy())
        np.testing.assert_allclose(s.topk_logp.astype(np.float32), want.values.numpy(),
                                   atol=2e-2)

    # A resumed directory must keep its writer.
    with pytest.raises(ValueError, match="--draft-run"):
        gen_data(replace(cfg, draft_run=None), _prompts(5, offset=20))

    # A second run starts from the first one's weights and reads both data directories.
    follow = tmp_path / "follow"
    state = train(replace(_train_cfg(data, follow, steps=1), data=[data["train"], out],
                          init_from=run, lr=1e-9, warmup=0))
    assert state["step"] == 1
    assert len(torch.load(follow / "ckpt.pt", weights_only=False)["state"]["epoch_shards"]) == 4
    before = torch.load(run / "ckpt.pt", weights_only=False)["model"]
    after = torch.load(follow / "ckpt.pt", weights_only=False)["model"]
    for name in before:  # a 1e-9 learning rate: the weights are the first run's
        torch.testing.assert_close(after[name], before[name], atol=1e-5, rtol=1e-5)

    # The exported card accounts for the whole lineage: both data dirs, both training runs.
    export(ExportConfig(follow, tmp_path / "draft", data["heldout"], data["target"],
                        quantize=False, measure_target=False, twin_out=tmp_path / "twin"))
    card = (tmp_path / "draft" / "MODEL_CARD.md").read_text()
    assert f"started from the weights of run `{run}`" in card
    assert "| gen-data `train` |" in card and "| gen-data `onpolicy` |" in card
    assert "| train `run` |" in card and "| train `follow` |" in card
    assert f"written by run `{run}`'s draft" in card


def test_gen_data_features_are_the_hidden_states_that_decided_each_token(data, tmp_path):
    """``--features`` records, for gen token j, the target's final hidden state at the position
    that decided it: a teacher-forced forward over prompt + continuation gives the same states
    (to float16), and the same tokens are written as without features."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = GenConfig(target=data["target"], out=tmp_path / "feat", shard_size=4, batch_size=3,
                    max_new_tokens=10, top_k=8, sample_fraction=0.5, features=True)
    gen_data(cfg, _prompts(8))
    with_feat = load_samples(list_shards(cfg.out))
    plain = load_samples(list_shards(data["train"]))
    model = AutoModelForCausalLM.from_pretrained(data["target"], dtype=torch.float32).eval()
    assert len(with_feat) == len(plain) == 8
    for s, ref in zip(with_feat, plain, strict=True):
        np.testing.assert_array_equal(s.gen_ids, ref.gen_ids)
        assert s.features.shape == (len(s.gen_ids), model.config.hidden_size)
        assert s.features.dtype == np.float16
        seq = torch.from_numpy(np.concatenate([s.prompt_ids, s.gen_ids]).astype(np.int64))
        with torch.inference_mode():
            hidden = model.model(input_ids=seq[None]).last_hidden_state[0]
        # Position P-1+j decided gen token j.
        want = hidden[len(s.prompt_ids) - 1 : len(seq) - 1].numpy()
        np.testing.assert_allclose(s.features.astype(np.float32), want, rtol=2e-2, atol=2e-2)
        greedy_ids = model.lm_head(torch.from_numpy(s.features.astype(np.float32))).argmax(-1)
        np.testing.assert_array_equal(greedy_ids.numpy(), s.topk_ids[:, 0])
    with pytest.raises(ValueError, match="other settings"):
        gen_data(replace(cfg, features=False), _prompts(8))


@pytest.mark.parametrize("bad", [dict(engine="vllm", features=True),
                                 dict(engine="vllm", draft_run=Path("run")),
                                 dict(engine="sglang"), dict(dtype="bfloat16")])
def test_gen_data_refuses_settings_its_engine_cannot_honour(bad, tmp_path):
    with pytest.raises(ValueError, match="engine|dtype"):
        gen_data(GenConfig(target=None, out=tmp_path / "d", **bad), _prompts(2))


def test_train_reports_tokens_seen_and_each_category_of_a_realistic_heldout(data, tmp_path):
    """A held-out directory written by ``bench.realistic_data`` (its categories.json) gets
    greedy alpha per category at every evaluation; the rows' figures agree with a direct
    evaluate over each category's rows, and the overall one with the plain evaluation."""
    from edge_client.tools.distill.evaluate import evaluate, realistic_categories

    heldout = tmp_path / "realistic"
    shutil.copytree(data["heldout"], heldout)
    rows = len(load_samples(list_shards(heldout)))
    categories = ["email", "ime", "email"][:rows]
    (heldout / "categories.json").write_text(json.dumps({"categories": categories}))
    assert realistic_categories(heldout, rows) == categories
    assert realistic_categories(heldout, rows + 1) == []  # another directory's rows
    assert realistic_categories(data["heldout"], rows) == []

    run = tmp_path / "run"
    train(replace(_train_cfg(data, run, steps=2), heldout=heldout, eval_every=1))
    evals = [r for r in map(json.loads, (run / "metrics.jsonl").open()) if "heldout" in r]
    assert [r["step"] for r in evals] == [1, 2]
    assert 0 < evals[0]["tokens_seen"] < evals[1]["tokens_seen"]
    model, vmap = load_run(run, data["target"])
    samples = load_samples(list_shards(heldout))
    last = evals[-1]["by_category"]
    assert last["all"] == evals[-1]["heldout"]["greedy_alpha"]
    for cat in set(categories):
        mine = [s for s, c in zip(samples, categories, strict=True) if c == cat]
        assert last[cat] == evaluate(torch_logits_fn(model, vmap), mine)["greedy_alpha"]


def test_a_batch_of_prompts_longer_than_max_len_still_trains_on_their_continuations():
    """Multi-turn prompts longer than max_len: cut from the left, each row keeps positions
    whose targets are its first generated tokens (a batch of them once had none, and train
    stopped with 'need at least one array to concatenate')."""
    from edge_client.tools.distill.shards import Sample
    from edge_client.tools.distill.train import make_batch

    full_to_sub = np.arange(96)
    rows = [Sample(np.arange(3, 3 + n) % 90 + 3, np.array([5, 6, 7, 8]),
                   np.tile(np.array([[5, 6]]), (4, 1)), np.zeros((4, 2), np.float16), False)
            for n in (40, 55)]
    batch = make_batch(rows, full_to_sub, unk=95, max_len=32)
    assert batch.input_ids.shape == (2, 32)
    assert len(batch.rows) == 8  # all four continuation tokens of both rows
    # the last prompt token of row 0 is the one before the continuation, at column 27
    assert batch.input_ids[0, 27] == rows[0].prompt_ids[-1] and batch.input_ids[0, 28] == 5
    short = Sample(np.array([3, 4]), np.array([5, 6]), np.tile(np.array([[5, 6]]), (2, 1)),
                   np.zeros((2, 2), np.float16), False)
    assert make_batch([short], full_to_sub, unk=95, max_len=32).input_ids.shape == (1, 4)


def test_read_shard_gives_each_sample_its_own_arrays(data):
    """A sample holding a view would keep its shard's whole array alive: one copy of the
    shard per sample (13.6 GB of training RSS at 847k corpus tokens before the fix)."""
    from edge_client.tools.distill.shards import read_shard

    samples = read_shard(list_shards(data["train"])[0])
    assert len(samples) > 1
    for s in samples:
        for arr in (s.prompt_ids, s.gen_ids, s.topk_ids, s.topk_logp):
            assert arr.base is None, "a view into the shard's array"
    assert len(samples[0].topk_logp) == len(samples[0].gen_ids)


def test_an_archives_ids_train_as_one_hot_labels_beside_top_k_rows(data, tmp_path,
                                                                   monkeypatch):
    """A corpus archive's shard (ids only) reads as one-hot labels: on a greedy row they are
    the target's recorded top-1; a batch mixes them with top-k rows (k padded with p = 0) and
    a run trains on both kinds of directory, where the one-hot loss is -log q(y) + w (1 - q(y))."""
    import torch

    from edge_client.tools.distill.corpus_archive import _write_ids
    from edge_client.tools.distill.train import distill_loss, make_batch

    ids_dir = tmp_path / "ids"
    ids_dir.mkdir()
    for shard in list_shards(data["train"]):
        _write_ids(shard, ids_dir / shard.name)
    soft, hard = (load_samples(list_shards(d)) for d in (data["train"], ids_dir))
    assert len(soft) == len(hard) > 0
    for a, b in zip(soft, hard, strict=True):
        assert np.array_equal(a.prompt_ids, b.prompt_ids) and a.sampled == b.sampled
        assert np.array_equal(b.topk_ids[:, 0], b.gen_ids) and not b.topk_logp.any()
        if not a.sampled:
            assert np.array_equal(a.topk_ids[:, 0], b.topk_ids[:, 0])
    vocab = int(max(s.topk_ids.max() for s in soft + hard)) + 2
    batch = make_batch([soft[0], hard[0]], np.arange(vocab), unk=vocab - 1, max_len=64)
    assert batch.teacher_ids.shape[1] == soft[0].topk_ids.shape[1]
    assert torch.allclose(batch.teacher_p.sum(-1), torch.ones(len(batch.rows)), atol=1e-5)
    one_hot = batch.teacher_p[len(soft[0].gen_ids):]
    assert (one_hot[:, 0] == 1).all() and (one_hot[:, 1:] == 0).all()
    logits = torch.randn(len(one_hot), vocab)
    y = batch.teacher_ids[len(soft[0].gen_ids):, 0]
    q_y = torch.softmax(logits, -1).gather(1, y[:, None])[:, 0]
    loss, _, _ = distill_loss(logits, batch.teacher_ids[len(soft[0].gen_ids):], one_hot, 0.5)
    assert torch.isclose(loss, (-q_y.log() + 0.5 * (1 - q_y)).mean(), atol=1e-5)

    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # a relative --data, as on a command line
    train(replace(_train_cfg(data, run, steps=2), data=[data["train"], Path("ids")]))
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records and all(math.isfinite(r["loss"]) for r in records if "loss" in r)
