"""The draft-size options of the distill export (quantize.share_embedding, quantize.int4_matmuls)
on a tiny tied Llama: the file shrinks, the embedding rows are the head's quantized columns, the
logits stay those of the plain int8 export within a stated tolerance, and the edge drafts."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import TINY_VOCAB, tiny_llama_config, write_tiny_tokenizer
from onnx import numpy_helper

from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, ModelDrafter
from edge_client.tools.distill.cli import parse_args
from edge_client.tools.distill.evaluate import onnx_logits_fn
from edge_client.tools.distill.quantize import quantize_draft, share_embedding

HIDDEN = 64  # two 4-bit blocks of 32 per column
IDS = np.array([1, 5, 9, 80, 33, 2, 17, 64, 95, 3, 40, 41])


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    from edge_client.tools.export_draft import export_onnx

    root = tmp_path_factory.mktemp("size")
    config = tiny_llama_config(1)
    config.hidden_size, config.intermediate_size = HIDDEN, 128
    config.tie_word_embeddings = True  # as the distilled drafts are
    torch.manual_seed(3)
    LlamaForCausalLM(config).eval().save_pretrained(root / "pt", safe_serialization=True)
    write_tiny_tokenizer(root / "pt")
    return export_onnx(root / "pt", root / "fp32")


def _variant(fp32_dir: Path, out: Path, **kw) -> tuple[Path, dict]:
    shutil.copytree(fp32_dir, out, ignore=shutil.ignore_patterns("model.onnx"))
    return out, quantize_draft(fp32_dir / "model.onnx", out / "model.onnx", **kw)


def _embedding_rows(model_dir: Path, ids: np.ndarray) -> np.ndarray:
    """The looked-up embeddings of ``ids``: the graph's embedding output made a graph output."""
    import onnxruntime as ort

    model = onnx.load(str(model_dir / "model.onnx"))
    gather = next(n for n in model.graph.node
                  if n.op_type == "Gather" and "embed_tokens" in n.name)
    name = "/model/embed_tokens/Gather_output_0"
    assert any(name in n.output for n in model.graph.node), gather.name
    model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT,
                                                                 None))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    n = len(ids)
    feeds = {"input_ids": ids[None].astype(np.int64),
             "attention_mask": np.ones((1, n), np.int64),
             "position_ids": np.arange(n, dtype=np.int64)[None]}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values"):
            feeds[i.name] = np.zeros([1, i.shape[1], 0, i.shape[3]], np.float32)
    return sess.run([name], feeds)[0][0]


def _fp32_table(fp32_dir: Path) -> np.ndarray:
    model = onnx.load(str(fp32_dir / "model.onnx"))
    return next(numpy_helper.to_array(t) for t in model.graph.initializer
                if list(t.dims) == [TINY_VOCAB, HIDDEN])


def _initializer(model_dir: Path, suffix: str) -> np.ndarray:
    model = onnx.load(str(model_dir / "model.onnx"))
    return next(numpy_helper.to_array(t) for t in model.graph.initializer
                if t.name.endswith(suffix))


def test_shared_embedding_stores_one_table_and_keeps_the_logits(fp32_dir, tmp_path):
    plain, done = _variant(fp32_dir, tmp_path / "int8")
    assert done == {"untied": True, "int4": [], "shared_embedding": False}
    shared, done = _variant(fp32_dir, tmp_path / "shared", share=True)
    assert done["shared_embedding"]
    saved = (plain / "model.onnx").stat().st_size - (shared / "model.onnx").stat().st_size
    assert saved >= 0.9 * TINY_VOCAB * HIDDEN  # the int8 table (1 byte an entry) is gone,
    # less the few hundred bytes of the lookup nodes
    assert not share_embedding(shared / "model.onnx")  # nothing left to share

    # Row v is column v of the head's int8 weight, dequantized with its per-column scale:
    # exactly, and within half a quantization step of the fp32 table.
    q = _initializer(shared, "lm_head.weight_untied_quantized").astype(np.float32)
    scale = _initializer(shared, "lm_head.weight_untied_scale")
    zero = _initializer(shared, "lm_head.weight_untied_zero_point").astype(np.float32)
    rows = _embedding_rows(shared, IDS)
    want = ((q - zero) * scale)[:, IDS].T
    np.testing.assert_allclose(rows, want, rtol=1e-6, atol=1e-7)
    assert np.all(np.abs(rows - _fp32_table(fp32_dir)[IDS]) <= scale[IDS, None] / 2 + 1e-6)

    # Logits: the plain export quantizes the table per tensor, the shared one per row; the
    # tolerance is stated against the fp32 logits: the shared draft is no farther from fp32
    # than the plain int8 one, give or take 25%, and agrees with it on most argmaxes.
    ref = onnx_logits_fn(fp32_dir)(IDS)
    a, b = onnx_logits_fn(plain)(IDS), onnx_logits_fn(shared)(IDS)
    err_plain, err_shared = np.abs(a - ref).mean(), np.abs(b - ref).mean()
    assert err_shared <= 1.25 * err_plain
    assert np.abs(b - a).mean() <= 0.1 * ref.std()
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.75


def test_int4_matmuls_and_a_shared_4bit_head(fp32_dir, tmp_path):
    shared, _ = _variant(fp32_dir, tmp_path / "shared", share=True)
    small, done = _variant(fp32_dir, tmp_path / "int4", share=True, int4_accuracy=4,
                           int4=("mlp/gate_proj", "mlp/up_proj", "mlp/down_proj", "lm_head"))
    assert sorted(done["int4"]) == sorted(["/lm_head/MatMul"] + [
        f"/model/layers.0/mlp/{p}_proj/MatMul" for p in ("gate", "up", "down")])
    assert done["shared_embedding"]
    graph = onnx.load(str(small / "model.onnx")).graph
    nbits = [n.name for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nbits) == 4 and all("mlp" in n or "lm_head" in n for n in nbits)
    assert not any("mlp" in n.name and n.op_type == "MatMulInteger" for n in graph.node)
    levels = {onnx.helper.get_attribute_value(a) for n in graph.node
              if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}
    assert levels == {4}  # int8 activations inside the 4-bit kernel (the export default)
    # 1 -> 0.625 bytes a weight (4 bits + an fp32 scale per 32) for the MLP and the head
    weights = 3 * HIDDEN * 128 + TINY_VOCAB * HIDDEN
    saved = (shared / "model.onnx").stat().st_size - (small / "model.onnx").stat().st_size
    assert saved >= 0.3 * weights

    # The embedding is unpacked from the head's 4-bit blocks (low nibble first, zero point 8):
    # within one step (|block scale|: symmetric 4 bits map -amax to -8, so +amax clips at 7)
    # of the fp32 table, half a step on average; a wrong nibble order would be far off.
    scales = _initializer(small, "lm_head.weight_untied_scales").reshape(TINY_VOCAB, -1)
    rows = _embedding_rows(small, IDS)
    step = np.repeat(np.abs(scales[IDS]), 32, axis=1)
    err = np.abs(rows - _fp32_table(fp32_dir)[IDS])
    assert np.all(err <= step + 1e-6) and err.mean() <= 0.3 * step.mean()

    # 4 bits cost precision: the logits stay near the int8 ones (stated tolerance: mean
    # |difference| under a third of the logits' spread on this random model).
    ref = onnx_logits_fn(shared)(IDS)
    got = onnx_logits_fn(small)(IDS)
    assert np.abs(got - ref).mean() <= ref.std() / 3


@pytest.mark.parametrize("int4", [(), ("mlp/", "lm_head")])
def test_edge_drafts_with_the_small_exports(fp32_dir, tmp_path, int4):
    out, _ = _variant(fp32_dir, tmp_path / "draft", share=True, int4=int4)
    edge = OnnxDraftModel(out, intra_op_threads=1)
    assert edge.vocab_size == TINY_VOCAB
    whole = edge.forward(edge.new_cache(), IDS.tolist())
    assert whole.shape == (len(IDS), TINY_VOCAB)
    # Prefill then one token at a time through the KV cache: the same logits up to the
    # dynamic (per-call) activation quantization of the int8 MatMuls.
    cache = edge.new_cache()
    steps = [edge.forward(cache, IDS[:4].tolist())]
    steps += [edge.forward(cache, [int(t)]) for t in IDS[4:]]
    stepped, finite = np.concatenate(steps), np.isfinite(whole)
    assert np.array_equal(np.isfinite(stepped), finite)
    assert np.abs(stepped[finite] - whole[finite]).mean() <= 0.1 * whole[finite].std()
    assert (stepped.argmax(-1) == whole.argmax(-1)).mean() >= 0.75
    for temperature in (0.0, 0.8):
        drafter = ModelDrafter(edge, DraftSampling(temperature=temperature),
                               np.random.default_rng(0))
        assert len(drafter.propose([1, 5, 9], k=3).tokens) == 3


def test_export_cli_takes_the_size_options():
    args = parse_args(["export", "--run-dir", "r", "--out", "o", "--share-embedding",
                       "--int4", "mlp/", "lm_head", "--int4-block", "64"])
    assert args.share_embedding and args.int4 == ["mlp/", "lm_head"] and args.int4_block == 64
    args = parse_args(["export", "--run-dir", "r", "--out", "o"])
    assert not args.share_embedding and args.int4 == [] and args.int4_accuracy == 4
