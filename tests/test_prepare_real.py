"""`edgespec-prepare`: its stage logic on a tiny target, and the real assets when prepared."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from edge_client.draft_model import OnnxDraftModel
from edge_client.tools import prepare
from shared import paths
from shared.tokenizer_fingerprint import vocab_fingerprint


def test_prepare_stages_skip_when_done(tiny_llama_pair, tmp_path):
    # A tiny checkpoint stands in for the converted target, so no download happens.
    shutil.copytree(tiny_llama_pair.target_dir, tmp_path / paths.TARGET_DIRNAME)
    cache = ["--cache", str(tmp_path)]

    first = prepare.prepare(prepare.parse_args([*cache, "--draft-layers", "1"]))
    assert [(r.name, r.built) for r in first] == [
        ("target", False),
        ("draft-pt", True),
        ("draft-onnx", True),
    ]
    draft = OnnxDraftModel(tmp_path / paths.DRAFT_DIRNAME)
    assert draft.num_layers == 1 and draft.vocab_size == tiny_llama_pair.vocab_size
    assert (tmp_path / paths.DRAFT_PT_DIRNAME / "model.safetensors").is_file()

    again = prepare.prepare(prepare.parse_args([*cache, "--draft-layers", "1"]))
    assert not any(r.built for r in again)

    deeper = prepare.prepare(prepare.parse_args([*cache, "--draft-layers", "2"]))
    assert [r.built for r in deeper] == [False, True, True]
    assert OnnxDraftModel(tmp_path / paths.DRAFT_DIRNAME).num_layers == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_prepare_main_prints_summary(tiny_llama_pair, tmp_path, capsys):
    shutil.copytree(tiny_llama_pair.target_dir, tmp_path / paths.TARGET_DIRNAME)
    assert prepare.main(["--cache", str(tmp_path), "--draft-layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "draft-onnx" in out and "built" in out and str(tmp_path) in out


@pytest.mark.real_model
def test_real_target_loads(real_assets):
    from cloud_verifier.target_model import load_target

    loaded = load_target(None, device="cpu", dtype="float32")
    assert loaded.vocab_size == 49152
    assert loaded.model.config.num_hidden_layers == 30
    assert 2 in loaded.eos_token_ids
    tok = loaded.tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    # The chat template writes <|im_start|> itself; encoding must not add another.
    assert tok("Hello")["input_ids"] == [tok.convert_tokens_to_ids("Hello")]
    assert tok.decode(tok("Hello, world! 42")["input_ids"]) == "Hello, world! 42"


@pytest.mark.real_model
def test_real_draft_runs_and_shares_the_vocabulary(real_assets):
    target, draft_dir = real_assets
    from tokenizers import Tokenizer

    draft = OnnxDraftModel(draft_dir)
    assert draft.vocab_size == 49152
    logits = draft.forward(draft.new_cache(), [1, 9690, 198, 19556])
    assert logits.shape == (4, 49152) and np.isfinite(logits).all()

    def fingerprint(d):
        return vocab_fingerprint(Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab())

    assert fingerprint(draft_dir) == fingerprint(target)
