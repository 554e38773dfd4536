"""The ONNX draft runtime against PyTorch, its explicit KV cache, and target loading."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cloud_verifier.target_model import load_target
from edge_client.draft_model import DraftKVCache, OnnxDraftModel
from edge_client.tools.export_draft import export_onnx
from shared.tokenizer_fingerprint import vocab_fingerprint

REPO_ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-4


@pytest.fixture(scope="module")
def exported(tiny_llama_pair, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (ONNX dir, PyTorch dir): the 1-layer draft and the 2-layer target."""
    target_onnx = export_onnx(
        tiny_llama_pair.target_dir, tmp_path_factory.mktemp("tiny_target_onnx") / "onnx"
    )
    return {
        "draft": (tiny_llama_pair.draft_dir, tiny_llama_pair.draft_pt_dir),
        "target": (target_onnx, tiny_llama_pair.target_dir),
    }


@pytest.fixture(scope="module", params=["draft", "target"])
def pair(request, exported) -> tuple[OnnxDraftModel, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    onnx_dir, pt_dir = exported[request.param]
    torch_model = AutoModelForCausalLM.from_pretrained(pt_dir, dtype=torch.float32).eval()
    return OnnxDraftModel(onnx_dir, intra_op_threads=1), torch_model


def tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, size=n).tolist()


def torch_logits(model: torch.nn.Module, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().numpy()  # [n, V]


def test_metadata_from_graph(pair, tiny_llama_pair):
    onnx_model, torch_model = pair
    assert onnx_model.vocab_size == tiny_llama_pair.vocab_size
    assert onnx_model.num_layers == torch_model.config.num_hidden_layers
    assert onnx_model.max_context == 128
    cache = onnx_model.new_cache()
    assert cache.length == 0 and cache.num_layers == onnx_model.num_layers
    assert cache.keys[0].shape == (1, 2, 0, 8) and cache.keys[0].dtype == np.float32


def test_full_forward_matches_torch(pair):
    onnx_model, torch_model = pair
    ids = tokens(12, onnx_model.vocab_size)
    cache = onnx_model.new_cache()
    logits = onnx_model.forward(cache, ids)
    assert logits.shape == (12, onnx_model.vocab_size) and logits.dtype == np.float32
    assert cache.length == 12
    np.testing.assert_allclose(logits, torch_logits(torch_model, ids), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("chunks", [[5, 1, 1, 1, 1, 1, 1, 1], [3, 2, 3, 2, 2], [1] * 12])
def test_incremental_forward_matches_full(pair, chunks):
    onnx_model, _ = pair
    ids = tokens(sum(chunks), onnx_model.vocab_size, seed=1)
    full = onnx_model.forward(onnx_model.new_cache(), ids)

    cache, rows, start = onnx_model.new_cache(), [], 0
    for size in chunks:
        rows.append(onnx_model.forward(cache, ids[start : start + size]))
        start += size
        assert cache.length == start
    np.testing.assert_allclose(np.concatenate(rows), full, atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("keep", [0, 4, 7])
def test_crop_then_refeed_equals_fresh_forward(pair, keep):
    onnx_model, _ = pair
    vocab = onnx_model.vocab_size
    first = tokens(10, vocab, seed=2)
    replacement = [(t + 1) % vocab for t in first[keep:]][:4]  # differs at every position

    cache = onnx_model.new_cache()
    onnx_model.forward(cache, first)
    cache.crop(keep)
    assert cache.length == keep
    assert all(k.shape[2] == keep for k in (*cache.keys, *cache.values))
    rolled_back = onnx_model.forward(cache, replacement)

    fresh = onnx_model.forward(onnx_model.new_cache(), first[:keep] + replacement)
    np.testing.assert_allclose(rolled_back, fresh[keep:], atol=ATOL, rtol=ATOL)
    assert cache.length == keep + len(replacement)


def test_crop_to_full_length_is_a_no_op(pair):
    onnx_model, _ = pair
    cache = onnx_model.new_cache()
    onnx_model.forward(cache, tokens(3, onnx_model.vocab_size))
    before = [k.copy() for k in cache.keys]
    cache.crop(3)
    assert all(np.array_equal(a, b) for a, b in zip(before, cache.keys, strict=True))


@pytest.mark.parametrize("bad", [-1, 6])
def test_crop_out_of_range_raises(pair, bad):
    onnx_model, _ = pair
    cache = onnx_model.new_cache()
    onnx_model.forward(cache, tokens(5, onnx_model.vocab_size))
    with pytest.raises(ValueError, match="crop"):
        cache.crop(bad)
    assert cache.length == 5


@pytest.mark.parametrize("bad", [[-1], [3, 96], [10**9]])
def test_token_id_out_of_range_raises(pair, bad):
    onnx_model, _ = pair
    cache = onnx_model.new_cache()
    with pytest.raises(ValueError, match="out of range"):
        onnx_model.forward(cache, bad)
    assert cache.length == 0


def test_empty_token_list_raises(pair):
    onnx_model, _ = pair
    with pytest.raises(ValueError, match="non-empty"):
        onnx_model.forward(onnx_model.new_cache(), [])


def test_cache_from_another_model_is_rejected(exported):
    draft = OnnxDraftModel(exported["draft"][0])
    target = OnnxDraftModel(exported["target"][0])
    with pytest.raises(ValueError, match="layers"):
        draft.forward(target.new_cache(), [3])


def test_last_position_only_graph_is_fed_one_token_at_a_time(pair, monkeypatch):
    # Simulate an export whose logits hold only the last position.
    onnx_model, _ = pair
    ids = tokens(6, onnx_model.vocab_size, seed=3)
    full = onnx_model.forward(onnx_model.new_cache(), ids)
    monkeypatch.setattr(onnx_model, "_last_only", True)
    calls = []
    run = onnx_model._run
    monkeypatch.setattr(onnx_model, "_run", lambda c, x: calls.append(x.size) or run(c, x))
    cache = onnx_model.new_cache()
    np.testing.assert_allclose(onnx_model.forward(cache, ids), full, atol=ATOL, rtol=ATOL)
    assert calls == [1] * 6 and cache.length == 6


def test_cache_rejects_mismatched_arrays():
    k = np.zeros((1, 2, 3, 8), np.float32)
    with pytest.raises(ValueError):
        DraftKVCache([k], [np.zeros((1, 2, 4, 8), np.float32)])
    with pytest.raises(ValueError):
        DraftKVCache([], [])


def test_edge_import_does_not_load_torch():
    code = (
        "import sys, edge_client.draft_model\n"
        "heavy = [m for m in ('torch', 'transformers', 'optimum') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)


def test_load_target_on_tiny_checkpoint(tiny_llama_pair):
    from tokenizers import Tokenizer

    loaded = load_target(tiny_llama_pair.target_dir, device="cpu")
    assert loaded.device == torch.device("cpu")
    assert loaded.dtype == torch.float32
    assert next(loaded.model.parameters()).dtype == torch.float32
    assert not loaded.model.training
    assert loaded.vocab_size == tiny_llama_pair.vocab_size
    assert loaded.max_context == 128
    assert loaded.eos_token_ids == (2,)
    assert loaded.name == "target"
    # The edge hashes the raw tokenizer.json; both sides must agree.
    edge_vocab = Tokenizer.from_file(str(tiny_llama_pair.target_dir / "tokenizer.json")).get_vocab()
    assert loaded.tokenizer_fingerprint == vocab_fingerprint(edge_vocab)
    assert loaded.tokenizer_fingerprint == vocab_fingerprint(
        Tokenizer.from_file(str(tiny_llama_pair.draft_dir / "tokenizer.json")).get_vocab()
    )


def test_load_target_dtype_override(tiny_llama_pair):
    loaded = load_target(tiny_llama_pair.target_dir, device="cpu", dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_target(tiny_llama_pair.target_dir, device="cpu", dtype="int3")


def test_load_target_default_missing_points_to_prepare(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESPEC_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="edgespec-prepare"):
        load_target(None, device="cpu")


# --- reduced-vocabulary drafts (vocab_map.npz) ------------------------------------------------

SUB_VOCAB = 40


@pytest.fixture(scope="module")
def reduced(tmp_path_factory) -> tuple[Path, torch.nn.Module, np.ndarray]:
    """A draft whose graph has 40 ids standing for 39 of the tiny 96 plus an <unk> slot."""
    from conftest import tiny_llama_config, write_tiny_tokenizer
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("reduced")
    config = tiny_llama_config(1)
    config.vocab_size = SUB_VOCAB
    torch.manual_seed(2)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "pt", safe_serialization=True)
    write_tiny_tokenizer(root / "pt")
    onnx_dir = export_onnx(root / "pt", root / "onnx")
    sub_to_full = np.concatenate([[0, 1, 2], np.arange(10, 10 + 2 * (SUB_VOCAB - 4), 2), [-1]])
    np.savez(onnx_dir / "vocab_map.npz", sub_to_full=sub_to_full, full_vocab_size=96)
    return onnx_dir, model, sub_to_full


def test_vocab_map_keeps_full_vocabulary_ids_and_logits(reduced):
    onnx_dir, model, sub_to_full = reduced
    draft = OnnxDraftModel(onnx_dir, intra_op_threads=1)
    assert draft.vocab_size == 96
    full_ids = [1, 10, 12, 95, 3, 2]  # 95 and 3 are outside the subset: fed as <unk>
    unk = SUB_VOCAB - 1
    sub_ids = [1, 3, 4, unk, unk, 2]
    logits = draft.forward(draft.new_cache(), full_ids)
    assert logits.shape == (6, 96) and logits.dtype == np.float32

    kept = sub_to_full[:-1]
    outside = np.setdiff1d(np.arange(96), kept)
    assert np.all(np.isneginf(logits[:, outside]))
    ref = torch_logits(model, sub_ids)  # [6, 40]
    np.testing.assert_allclose(logits[:, kept], ref[:, :-1], atol=ATOL, rtol=ATOL)
    assert set(np.argmax(logits, axis=1)) <= set(kept.tolist())


def test_vocab_map_incremental_and_crop(reduced):
    draft = OnnxDraftModel(reduced[0], intra_op_threads=1)
    ids = [1, 10, 12, 14, 3, 16, 18]
    full = draft.forward(draft.new_cache(), ids)
    cache = draft.new_cache()
    draft.forward(cache, ids[:3] + [95, 96 - 1])
    cache.crop(3)
    rows = [draft.forward(cache, ids[3:5]), draft.forward(cache, ids[5:])]
    np.testing.assert_allclose(np.concatenate(rows), full[3:], atol=ATOL, rtol=ATOL)


def test_vocab_map_without_unk_refuses_ids_outside(reduced, tmp_path):
    import shutil

    onnx_dir, _, sub_to_full = reduced
    copy = tmp_path / "copy"
    shutil.copytree(onnx_dir, copy)
    no_unk = np.concatenate([sub_to_full[:-1], [90]])
    np.savez(copy / "vocab_map.npz", sub_to_full=no_unk, full_vocab_size=96)
    draft = OnnxDraftModel(copy, intra_op_threads=1)
    draft.forward(draft.new_cache(), [90, 1])
    with pytest.raises(ValueError, match="vocabulary"):
        draft.forward(draft.new_cache(), [3])
    with pytest.raises(ValueError, match="out of range"):
        draft.forward(draft.new_cache(), [96])


def test_vocab_map_must_match_the_graph(reduced, tmp_path):
    import shutil

    onnx_dir, _, sub_to_full = reduced
    for bad in (sub_to_full[:-2], np.concatenate([sub_to_full[:-2], [10, -1]])):
        copy = tmp_path / f"bad{len(bad)}"
        shutil.copytree(onnx_dir, copy)
        np.savez(copy / "vocab_map.npz", sub_to_full=bad, full_vocab_size=96)
        with pytest.raises(ValueError, match="vocab map"):
            OnnxDraftModel(copy)


@pytest.mark.parametrize("shuffled", [False, True])
def test_compact_logits_are_the_full_rows_finite_columns_in_id_order(reduced, tmp_path,
                                                                     shuffled):
    """forward_compact = forward's finite columns, ascending full ids, also when the map
    lists its ids out of order (the columns are then reordered); so argmax and the
    truncated q over them pick the same full ids as over forward's rows, ties included."""
    import shutil

    from edge_client.sampling import truncated_distribution

    onnx_dir, _, sub_to_full = reduced
    if shuffled:
        copy = tmp_path / "shuffled"
        shutil.copytree(onnx_dir, copy)
        np.savez(copy / "vocab_map.npz", sub_to_full=sub_to_full[::-1].copy(),
                 full_vocab_size=96)
        onnx_dir = copy
    draft = OnnxDraftModel(onnx_dir, intra_op_threads=1)
    ids = [1, 10, 12, 95, 3, 2]
    full = draft.forward(draft.new_cache(), ids)
    compact, vocab = draft.forward_compact(draft.new_cache(), ids)
    assert list(vocab) == sorted(sub_to_full[sub_to_full >= 0].tolist())
    assert compact.shape == (6, SUB_VOCAB - 1) and compact.dtype == np.float32
    np.testing.assert_array_equal(compact, full[:, vocab])
    tied = full[-1].copy()
    tied[vocab[[3, 7]]] = tied.max() + 1  # a tie for the top: the lower id wins both ways
    row = tied[vocab]
    assert vocab[np.argmax(row)] == np.argmax(tied) == vocab[3]
    cols, probs = truncated_distribution(row, 0.7, 0, 0.9, 8)
    want_ids, want_probs = truncated_distribution(tied, 0.7, 0, 0.9, 8)
    assert list(vocab[cols]) == list(want_ids)
    np.testing.assert_allclose(probs, want_probs, rtol=1e-6)


def test_compact_logits_without_a_vocab_map_are_the_whole_row(pair):
    draft = pair[0]
    ids = [3, 5, 7]
    full = draft.forward(draft.new_cache(), ids)
    compact, vocab = draft.forward_compact(draft.new_cache(), ids)
    np.testing.assert_array_equal(compact, full)
    assert list(vocab) == list(range(full.shape[1]))


def test_the_acceptance_trace_rows_are_the_full_forward_rows(reduced):
    """draft_trace times forward_compact and widens its rows: they equal forward's, -inf
    outside the draft's vocabulary included."""
    from edge_client.bench.acceptance import draft_trace

    draft = OnnxDraftModel(reduced[0], intra_op_threads=1)
    prompt, path = [1, 10, 12], [14, 3, 16, 95]
    rows, steps = draft_trace(draft, prompt, path)
    cache = draft.new_cache()
    want = [draft.forward(cache, prompt)[-1]] + [draft.forward(cache, [t])[-1] for t in path[:-1]]
    np.testing.assert_array_equal(rows, np.stack(want))
    assert len(steps) == len(path) - 1 and all(s > 0 for s in steps)
