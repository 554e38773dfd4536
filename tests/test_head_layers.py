"""Context heads that fuse several target layers (``head_layers``, EAGLE-3's features) on the
tiny target: the layer files equal a teacher-forced forward's states and resume, the fused
head starts as the head that reads f_j alone, its unrolled passes equal step-by-step cached
drafting, and train-head --context --feature-layers learns, resumes and refuses bad uses."""

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
    context_sequences,
    make_context_batch,
    unrolled_passes,
)
from edge_client.tools.distill.head_layers import (
    backfill_layer_features,
    layers_path,
    load_layer_features,
    parse_layers,
)
from edge_client.tools.distill.head_model import HeadArch, build_head
from edge_client.tools.distill.head_train import HeadTrainConfig, train_head
from edge_client.tools.distill.shards import list_shards, load_samples
from edge_client.tools.distill.vocab import VocabMap

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAYERS = (0, 1)  # the tiny target's two decoder layers
ARCH = HeadArch(sub_vocab=48, intermediate=64, max_chain=16, feature_layers=LAYERS)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    data = context_data(tmp_path_factory.mktemp("layers"))
    for d in ("train", "heldout"):
        backfill_layer_features(data[d], data["target"], LAYERS, batch_size=4, threads=1)
    return data


def _sequences(data, split: str = "train"):
    shards = list_shards(data[split])
    return context_sequences(load_samples(shards), load_layer_features(shards, LAYERS))


def test_layer_files_hold_a_teacher_forced_forwards_states_and_resume(data):
    from transformers import AutoModelForCausalLM

    seqs = _sequences(data)
    model = AutoModelForCausalLM.from_pretrained(data["target"], dtype=torch.float32).eval()
    for seq in seqs[:4]:
        with torch.inference_mode():
            hs = model.model(torch.from_numpy(seq.tokens[None, :-1]),
                             output_hidden_states=True).hidden_states
        assert seq.layer_features.shape == (len(seq.tokens) - 1, len(LAYERS),
                                            seq.features.shape[1])
        for n, layer in enumerate(LAYERS):
            want = hs[layer + 1][0].numpy()
            assert np.abs(seq.layer_features[:, n].astype(np.float32) - want).max() < 0.02
    # Done shards are skipped; another layer set is its own file, asked for by name.
    assert backfill_layer_features(data["train"], data["target"], LAYERS)["shards"] == 0
    with pytest.raises(ValueError, match="layer-features --layers 1 "):
        load_layer_features(list_shards(data["train"]), (1,))
    assert all(layers_path(p).exists() for p in list_shards(data["train"]))
    assert not any("layers-" in p.name for p in list_shards(data["train"]))


def test_parse_layers_refuses_what_is_not_a_layer_set():
    assert parse_layers("2,15,27", 30) == (2, 15, 27)
    for bad in ("", "2,2", "-1", "a,b", "30"):
        with pytest.raises(ValueError):
            parse_layers(bad, 30)


def _heads(data, seed: int = 0):
    ids = np.arange(48, dtype=np.int64)
    ids[-1] = -1
    vmap = VocabMap(ids, 96)
    fused = build_head(ARCH, data["target"], vmap, seed).eval()
    plain = build_head(replace(ARCH, feature_layers=()), data["target"], vmap, seed).eval()
    return fused, plain, vmap


def test_a_fused_head_starts_as_the_head_that_reads_the_final_feature_alone(data):
    fused, plain, vmap = _heads(data)
    state = {k: v for k, v in fused.state_dict().items() if k in plain.state_dict()}
    plain.load_state_dict(state)
    batch = make_context_batch(_sequences(data)[:3], vmap.full_to_sub(), 64)
    with torch.inference_mode():
        a = unrolled_passes(fused, batch.ids, batch.features, 3, batch.layers)
        b = unrolled_passes(plain, batch.ids, batch.features, 3)
        for (la, fa), (lb, fb) in zip(a, b, strict=True):
            torch.testing.assert_close(la, lb)
            torch.testing.assert_close(fa, fb)
        with pytest.raises(ValueError, match="give their states"):
            unrolled_passes(fused, batch.ids, batch.features, 3)


def test_fused_unrolled_passes_equal_step_by_step_cached_drafting(data):
    """The device fuses the real positions' layers into g, then feeds the chain its own
    predicted features: pass s at position j must be draft step s there."""
    fused, _, vmap = _heads(data, seed=2)
    with torch.no_grad():  # make the layers matter
        fused.fuse.weight.normal_(0, 0.1)
        fused.fc.weight.normal_(0, 0.4)
    passes = 3
    for seq in _sequences(data)[:2]:
        batch = make_context_batch([seq], vmap.full_to_sub(), 256)
        with torch.inference_mode():
            outs = unrolled_passes(fused, batch.ids, batch.features, passes, batch.layers)
            g_real = fused.real_features(batch.features, batch.layers)
            n = batch.ids.shape[1]
            for last_real in range(0, n - passes + 1, 3):
                pk, pv = fused.empty_cache(1)
                logits, g, pk, pv = fused(batch.ids[:, :last_real + 1],
                                          g_real[:, :last_real + 1], pk, pv)
                logits, g = logits[:, -1:], g[:, -1:]
                for s in range(1, passes + 1):
                    j = last_real + s - 1
                    torch.testing.assert_close(logits[0, 0], outs[s - 1][0][0, j],
                                               atol=2e-4, rtol=1e-4)
                    if j + 1 < n:
                        logits, g, pk, pv = fused(batch.ids[:, j + 1:j + 2], g, pk, pv)


def _cfg(data, run: Path, steps: int, **kw) -> HeadTrainConfig:
    return HeadTrainConfig(run_dir=run, data=data["train"], heldout=data["heldout"],
                           target=data["target"], arch=ARCH, steps=steps, batch_size=4,
                           lr=1e-2, warmup=1, eval_every=0, log_every=5, ckpt_every_s=1e9,
                           lr_steps=30, threads=1, context=True, passes=3, **kw)


def test_fused_context_training_learns_resumes_and_refuses_bad_uses(data, tmp_path):
    run = tmp_path / "run"
    train_head(replace(_cfg(data, run, 30), eval_every=30))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert losses[-1] < 0.7 * losses[0], losses  # 30 steps of 4 sequences each
    assert [m for m in metrics if "heldout" in m][-1]["heldout"]["rounds"] > 0
    saved = json.loads((run / "run.json").read_text())
    assert saved["arch"]["feature_layers"] == list(LAYERS)
    ck = torch.load(run / "ckpt.pt", weights_only=False)["model"]
    # The layers' blocks of the fusion left zero: the head learned to read them.
    assert float(ck["fuse.weight"][:, ck["fuse.weight"].shape[0]:].abs().max()) > 1e-3

    split = tmp_path / "split"
    train_head(_cfg(data, split, 15))
    train_head(_cfg(data, split, 30))
    parts = torch.load(split / "ckpt.pt", weights_only=False)["model"]
    for name, value in ck.items():
        torch.testing.assert_close(parts[name], value)

    with pytest.raises(ValueError, match="needs --context"):
        train_head(replace(_cfg(data, tmp_path / "chain", 2), context=False))
    with pytest.raises(ValueError, match="layer-features"):
        train_head(replace(_cfg(data, tmp_path / "other", 2), heldout=None,
                           arch=replace(ARCH, feature_layers=(1,))))
    assert distill_main(["train-head", "--run-dir", str(tmp_path / "cli"), "--data",
                         str(data["train"]), "--context", "--feature-layers", "0,0"]) != 0
