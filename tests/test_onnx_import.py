"""import-onnx: an exported draft (int8 or fp32 ONNX) back into a run dir ``train --init-from``
accepts, on the tiny models of test_distill_smoke (a few training steps, then export).

Tolerances, stated once: the imported weights are the originals to within half a quantization
step (checked as 1/100 of each tensor's largest weight; half the 7-bit reduce-range step is
1/127, measured 0.0077-0.0078; the per-tensor uint8 embedding 0.0038); from the fp32 ONNX
they are exact (1e-6). Against the int8 ONNX, whose activations
are also quantized at run time, logits agree to within ``INT8_LOGIT_ATOL`` and the argmax on
at least ``INT8_ARGMAX_AGREE`` of the positions; against the fp32 ONNX to 1e-4.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_distill_smoke import SUB_VOCAB, TINY_ARCH, _train_cfg, data  # noqa: F401  (data: fixture)

from edge_client.tools.distill.cli import main as distill_main
from edge_client.tools.distill.evaluate import onnx_logits_fn, torch_logits_fn
from edge_client.tools.distill.export import ExportConfig, export
from edge_client.tools.distill.model import ArchConfig, load_run
from edge_client.tools.distill.onnx_import import Weight, combine_tied, import_onnx
from edge_client.tools.distill.train import train

INT8_LOGIT_ATOL = 0.05  # measured max |diff| 0.0094 (mean 0.0016, logit std 0.25)
INT8_ARGMAX_AGREE = 0.9  # measured 1.0 on 48 positions
# The fused graph wants head_dim a multiple of 16 (GroupQueryAttention's CPU kernel), and
# rotary tables past the export's step timing (128 + 32 positions).
FUSED_ARCH = ArchConfig(init="scratch", hidden=64, layers=1, heads=4, kv_heads=2,
                        intermediate=128, sub_vocab=SUB_VOCAB, max_positions=256)


@pytest.fixture(scope="module")
def exported(data, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("onnx_import")
    train(_train_cfg(data, root / "run", steps=4))
    export(ExportConfig(root / "run", root / "draft", None, data["target"],
                        fp32_out=root / "fp32", twin_out=root / "twin", measure_target=False))
    ck = torch.load(root / "run" / "ckpt.pt", weights_only=False)
    return {"root": root, "int8": root / "draft", "fp32": root / "fp32", "orig": ck["model"]}


def _ids(vmap, n=48, seed=0):
    kept = vmap.sub_to_full[vmap.sub_to_full >= 0]
    return np.random.default_rng(seed).choice(kept, size=n)


def test_int8_draft_imports_to_the_original_weights_and_the_onnx_logits(data, exported):  # noqa: F811
    run = exported["root"] / "imported-int8"
    report = import_onnx(exported["int8"], run, data["target"], check_tokens=16)
    for name in ("ckpt.pt", "run.json", "vocab_map.npz", "import.json", "SOURCE_MODEL_CARD.md"):
        assert (run / name).is_file(), name
    saved = json.loads((run / "run.json").read_text())
    arch = saved["arch"]
    assert arch["init"] == "onnx"
    for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "max_positions"):
        assert arch[key] == getattr(TINY_ARCH, key), key
    assert saved["imported_from"] == str(exported["int8"])
    assert report["fidelity"]["argmax_agree"] >= INT8_ARGMAX_AGREE

    model, vmap = load_run(run, data["target"])
    state = model.state_dict()
    assert set(state) == set(exported["orig"])
    quantized = 0
    for k, orig in exported["orig"].items():
        got = state[k]
        err = float((got - orig).abs().max())
        if "norm" in k:
            assert err <= 1e-6, k  # RMSNorm scales are stored in fp32
        else:
            assert err <= float(orig.abs().max()) / 100, (k, err)
            quantized += 1
    assert quantized == 2 + 7 * TINY_ARCH.layers  # embedding, its tied head, 7 projections a layer
    sources = json.loads((run / "import.json").read_text())["sources"]
    assert "intersection" in sources["model.embed_tokens.weight"]  # embedding and head, int8
    assert "DequantizeLinear" in sources["model.layers.0.mlp.down_proj.weight"]  # weight-only
    assert "MatMulInteger" in sources["model.layers.0.self_attn.q_proj.weight"]

    ids = _ids(vmap)
    ref = onnx_logits_fn(exported["int8"])(ids)
    got = torch_logits_fn(model, vmap)(ids)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(ref))
    finite = np.isfinite(ref)
    diff = np.abs(got[finite] - ref[finite])
    assert diff.max() <= INT8_LOGIT_ATOL, diff.max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= INT8_ARGMAX_AGREE


def test_fp32_draft_imports_exactly(data, exported):  # noqa: F811
    run = exported["root"] / "imported-fp32"
    import_onnx(exported["fp32"], run, data["target"], check_tokens=0)
    model, vmap = load_run(run, data["target"])
    for k, orig in exported["orig"].items():
        torch.testing.assert_close(model.state_dict()[k], orig, atol=1e-6, rtol=0)
    ids = _ids(vmap, seed=1)
    ref, got = onnx_logits_fn(exported["fp32"])(ids), torch_logits_fn(model, vmap)(ids)
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got[finite], ref[finite], atol=1e-4, rtol=1e-4)


def test_imported_run_is_a_train_init_from_source(data, exported, tmp_path):  # noqa: F811
    src = exported["root"] / "imported-cli"
    assert distill_main(["import-onnx", "--draft", str(exported["int8"]), "--out", str(src),
                         "--target", str(data["target"]), "--check-tokens", "0"]) == 0
    state = train(_train_cfg(data, tmp_path / "ft", steps=2, init_from=src))
    assert state["step"] == 2
    assert json.loads((tmp_path / "ft" / "run.json").read_text())["init_from"] == str(src)
    assert json.loads((tmp_path / "ft" / "run.json").read_text())["arch"]["init"] == "onnx"


def test_a_dir_that_is_not_a_draft_is_refused_clearly(data, exported, tmp_path, caplog):  # noqa: F811
    with pytest.raises(ValueError, match="not an ONNX draft directory: no model.onnx, config.json"):
        import_onnx(tmp_path, tmp_path / "out", data["target"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.onnx").write_bytes(b"")
    with pytest.raises(ValueError, match="model_type 'gpt2', only Llama drafts"):
        import_onnx(tmp_path, tmp_path / "out", data["target"])
    with pytest.raises(ValueError, match="is not a directory"):
        import_onnx(tmp_path / "missing", tmp_path / "out", data["target"])
    # The CLI says it in one line and exits 2, writing nothing.
    assert distill_main(["import-onnx", "--draft", str(data["train"]),
                         "--out", str(tmp_path / "out")]) == 2
    assert "not an ONNX draft directory" in caplog.text
    assert not (tmp_path / "out").exists()


def test_tied_copies_combine_to_the_middle_of_both_rounding_intervals():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(64, 16)).astype(np.float32)
    sa = np.float32(np.abs(w).max() / 127)  # per tensor, like the embedding's Gather
    sb = (np.abs(w).max(0) / 63).astype(np.float32)  # per column, 7-bit, like the LM head
    a = Weight(np.round(w / sa) * sa, sa, "a")
    b = Weight(np.round(w / sb) * sb, sb, "b")
    est, how = combine_tied(a, b)
    assert "intersection" in how
    for copy, step in ((a, sa), (b, sb)):
        assert np.abs(est - w).mean() < np.abs(copy.value - w).mean()
        assert np.all(np.abs(est - w) <= np.broadcast_to(step, w.shape) / 2 + 1e-6)
    exact, how = combine_tied(Weight(w, None, "fp32"), b)
    assert exact is w and "exact" in how


def test_export_of_an_imported_run_carries_the_source_card(data, exported, tmp_path):  # noqa: F811
    run = tmp_path / "imported"
    import_onnx(exported["int8"], run, data["target"], check_tokens=0)
    export(ExportConfig(run, tmp_path / "again", None, data["target"], fp32_out=tmp_path / "f",
                        twin_out=tmp_path / "twin", measure_target=False))
    card = (tmp_path / "again" / "MODEL_CARD.md").read_text()
    source = (exported["int8"] / "MODEL_CARD.md").read_text()
    assert f"the ONNX draft `{exported['int8']}`, imported" in card
    assert "- steps 0," not in card  # no training of its own to report
    # The source card follows, its headings one level down.
    head, tail = card.split("## Source card", 1)
    assert "## Training" in head and "\n### Training\n" in tail
    assert source.splitlines()[0].startswith("# ") and "\n#" + source.splitlines()[0] in tail
    assert "- steps 4," in tail  # the source's own training, as written when it was exported


def test_the_fused_graph_with_a_shared_table_and_int4_imports_too(data, tmp_path):  # noqa: F811
    """The shipped kind of draft: ``--graph fused --share-embedding --int4 gate_proj``. Its
    packed qkv splits back into q, k and v, its 4-bit gate_proj dequantizes to within half a
    block step (symmetric 4-bit: 1/14 of the block's largest weight at most, checked as 1/10 of
    the tensor's), the tied matrix comes from the shared table alone, and the imported model
    gives the ONNX's argmax."""
    train(_train_cfg(data, tmp_path / "run", steps=2, arch=FUSED_ARCH))
    export(ExportConfig(tmp_path / "run", tmp_path / "draft", None, data["target"],
                        fp32_out=tmp_path / "fp32", twin_out=tmp_path / "twin",
                        measure_target=False, graph="fused", share_embedding=True,
                        int4=("gate_proj",)))
    orig = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)["model"]
    report = import_onnx(tmp_path / "draft", tmp_path / "imported", data["target"],
                         check_tokens=16)
    sources = report["sources"]
    assert "packed qkv" in sources["model.layers.0.self_attn.k_proj.weight"]
    assert "MatMulNBits" in sources["model.layers.0.mlp.gate_proj.weight"]
    assert sources["model.embed_tokens.weight"].startswith("shared with lm_head")
    model, vmap = load_run(tmp_path / "imported", data["target"])
    state = model.state_dict()
    assert set(state) == set(orig)
    for k, ref in orig.items():
        err = float((state[k] - ref).abs().max())
        bound = 1e-6 if "norm" in k else float(ref.abs().max()) / (10 if "gate" in k else 100)
        assert err <= bound, (k, err, bound)
    assert report["fidelity"]["argmax_agree"] >= INT8_ARGMAX_AGREE
