"""``import-onnx``: a shipped ONNX draft directory back into a finished training run.

Why this exists: a draft's PyTorch checkpoint can be lost while its ONNX file ships (v7's
was: only the int8 ``model.onnx`` remains). ``train --init-from`` continues from a finished
run directory, so this module rebuilds one from the ONNX: ``run.json`` (the architecture,
from ``config.json``), ``vocab_map.npz`` (the sub-vocabulary, copied) and ``ckpt.pt``
(the weights, read out of the graph).

Weights are found by tracing the graph by node name, not by initializer name (optimum's
export names most of them ``onnx::MatMul_<n>``): the MatMul, MatMulInteger or MatMulNBits named
``/model/layers.<i>/<self_attn|mlp>/<x>_proj/MatMul...`` reads that projection's weight,
``/lm_head/MatMul...`` the LM head's, the Gather in ``/model/embed_tokens/`` the embedding,
the Mul (or the fused graph's [Skip]SimplifiedLayerNormalization) in
``.../<input|post_attention>_layernorm`` and ``/model/norm`` the RMSNorm scales. ONNX MatMul
weights are [in, out]; torch Linear weights are [out, in], so they are transposed. The fused
graph (``tools.fused_graph``) packs each layer's q, k and v into one
``/model/layers.<i>/attn/qkv_proj`` weight, split here by the heads in ``config.json``, and
with ``--share-embedding`` its embedding is a lookup into the LM head's table, so the head
alone gives the tied matrix.

Quantized weights are dequantized as (q - zero_point) * scale: the int8 MatMulInteger
weights of ``quantize_dynamic`` (per output column), the weight-only DequantizeLinear ones of
``quantize.weight_only_int8``, the symmetric 4-bit blocks of ``quantize.int4_matmuls``
(MatMulNBits: nibbles low first, zero point 8) and the uint8 per-tensor embedding table
behind its Gather. The
dequantized value is the original up to half a quantization step. The drafts train with tied
embeddings, but the export stores the LM head apart from the embedding (``untie_lm_head``) and
quantizes both, each with its own step: every original weight lies in both rounding intervals,
so the imported tied matrix takes the middle of their intersection, closer to the original
than either copy alone (falling back to the finer copy where the intervals do not meet).

The imported run has no optimizer state: it is a starting point for ``--init-from`` (and for
``eval`` / ``export``), not a run to resume.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edge_client.tools.distill.common import jsonable, target_vocab_size, write_json
from edge_client.tools.distill.model import ArchConfig, finished_ckpt
from edge_client.tools.distill.vocab import VOCAB_MAP_FILE, VocabMap

log = logging.getLogger("edgespec.distill")

IMPORT_FILE = "import.json"

_PROJ = re.compile(
    r"^/model/layers\.(\d+)/(self_attn|attn|mlp)/(q|k|v|o|qkv|gate|up|down)_proj/MatMul")
_NORM = re.compile(
    r"^/model/(?:layers\.(\d+)/)?(input_layernorm|post_attention_layernorm|norm)(?:/|$)")
_MATMULS = ("MatMul", "MatMulInteger", "MatMulNBits")
_NORM_OPS = ("Mul", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")


@dataclass
class Weight:
    """A weight read out of the graph: its fp32 value and, when it was quantized, the width of
    its rounding interval (broadcastable to ``value``; None: stored exactly)."""

    value: np.ndarray
    step: np.ndarray | None
    source: str  # how it was stored, for import.json


def _check_draft_dir(draft: Path) -> dict:
    if not draft.is_dir():
        raise ValueError(f"{draft} is not a directory")
    missing = [n for n in ("model.onnx", "config.json") if not (draft / n).is_file()]
    if missing:
        raise ValueError(f"{draft} is not an ONNX draft directory: no {', '.join(missing)}")
    cfg = json.loads((draft / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise ValueError(f"{draft}/config.json: model_type {cfg.get('model_type')!r}, "
                         "only Llama drafts can be imported")
    if not cfg.get("tie_word_embeddings", False):
        raise ValueError(f"{draft}: untied embeddings; the distillation code trains tied drafts")
    return cfg


def _arch_from_config(cfg: dict) -> ArchConfig:
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if head_dim * heads != hidden:
        raise ValueError(f"head_dim {head_dim} x {heads} heads != hidden {hidden}: "
                         "build_draft cannot express this architecture")
    # init "onnx": built empty like "scratch"; the weights are all in ckpt.pt.
    return ArchConfig(init="onnx", hidden=hidden, layers=int(cfg["num_hidden_layers"]),
                      heads=heads, kv_heads=int(cfg["num_key_value_heads"]),
                      intermediate=int(cfg["intermediate_size"]), target_layers=(),
                      sub_vocab=int(cfg["vocab_size"]),
                      max_positions=int(cfg["max_position_embeddings"]))


def _check_target(cfg: dict, vmap: VocabMap, target_dir: Path) -> None:
    """build_draft takes rope_theta and rms_norm_eps from the target: they must agree."""
    tcfg = json.loads((target_dir / "config.json").read_text())
    if target_vocab_size(target_dir) != vmap.full_vocab_size:
        raise ValueError(f"vocab_map covers {vmap.full_vocab_size} ids, the target "
                         f"{target_dir} has {target_vocab_size(target_dir)}")
    for key, default in (("rope_theta", 10000.0), ("rms_norm_eps", None)):
        mine, theirs = cfg.get(key, default), tcfg.get(key, default)
        if mine is not None and theirs is not None \
                and not np.isclose(float(mine), float(theirs), rtol=1e-5):
            raise ValueError(f"{key}: the draft has {mine}, the target {theirs}")


class _Graph:
    """Initializers, Constant outputs and node producers/consumers of an ONNX graph."""

    def __init__(self, onnx_path: Path) -> None:
        import onnx
        from onnx import numpy_helper

        self.graph = onnx.load(str(onnx_path)).graph
        self.inits = {t.name: numpy_helper.to_array(t) for t in self.graph.initializer}
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.graph.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
            if n.op_type == "Constant":
                for a in n.attribute:
                    if a.name == "value":
                        self.inits[n.output[0]] = numpy_helper.to_array(a.t)

    def attr(self, node, name: str, default):
        from onnx import helper

        return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name),
                    default)

    def const(self, name: str) -> np.ndarray | None:
        return self.inits.get(name)

    def resolve(self, name: str) -> Weight | None:
        """The value of tensor ``name`` if it is a constant: an initializer, or one behind a
        DequantizeLinear or Transpose of constants."""
        if name in self.inits:
            a = self.inits[name]
            if a.dtype.kind in "iu":
                return None  # an integer tensor is a quantized weight without its scale
            return Weight(a.astype(np.float32), None, "fp32")
        node = self.producer.get(name)
        if node is None:
            return None
        if node.op_type == "DequantizeLinear":
            q, scale = self.const(node.input[0]), self.const(node.input[1])
            zp = self.const(node.input[2]) if len(node.input) > 2 and node.input[2] else None
            if q is None or scale is None:
                return None
            return _dequantize(q, scale, zp, self.attr(node, "axis", 1), "DequantizeLinear")
        if node.op_type == "Transpose":
            inner = self.resolve(node.input[0])
            if inner is None:
                return None
            perm = self.attr(node, "perm", None)
            perm = list(perm) if perm is not None else list(range(inner.value.ndim))[::-1]
            step = None if inner.step is None else np.transpose(
                np.broadcast_to(inner.step, inner.value.shape), perm)
            return Weight(np.transpose(inner.value, perm), step, inner.source + "+Transpose")
        return None

    def matmul_weight(self, node) -> Weight:
        """The constant [in, out] weight of a MatMul or MatMulInteger node."""
        if node.op_type == "MatMul":
            w = self.resolve(node.input[1])
        elif node.op_type == "MatMulInteger":
            w = self._matmul_integer_weight(node)
        elif node.op_type == "MatMulNBits":
            w = self._matmul_nbits_weight(node)
        else:
            w = None
        if w is None:
            raise ValueError(f"node {node.name} ({node.op_type}): no constant weight found")
        return w

    def _matmul_integer_weight(self, node) -> Weight | None:
        q = self.const(node.input[1])
        if q is None:
            return None
        zp = self.const(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        scale = None
        base = node.input[1].removesuffix("_quantized")
        if base != node.input[1]:
            scale = self.const(base + "_scale")
        if scale is None:  # quantize_dynamic multiplies the two scales in <node>_scales_mul
            for n in self.graph.node:
                if n.op_type == "Mul" and n.name == f"{node.name}_scales_mul":
                    scale = next((self.const(i) for i in n.input
                                  if self.const(i) is not None), None)
        if scale is None:
            raise ValueError(f"node {node.name}: the scale of {node.input[1]} is not found")
        return _dequantize(q, scale, zp, 1, "MatMulInteger")

    def _matmul_nbits_weight(self, node) -> Weight | None:
        """MatMulNBits' packed [N, blocks, bytes] 4-bit weight as [K, N] (in, out)."""
        packed, scale = self.const(node.input[1]), self.const(node.input[2])
        if packed is None or scale is None:
            return None
        if (len(node.input) > 3 and node.input[3]) or self.attr(node, "bits", 4) != 4:
            raise ValueError(f"node {node.name}: only symmetric 4-bit MatMulNBits is known")
        k, n, block = (int(self.attr(node, a, 0)) for a in ("K", "N", "block_size"))
        packed = packed.reshape(n, -1)
        nibbles = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1, block)
        scale = scale.astype(np.float32).reshape(n, -1, 1)
        value = ((nibbles.astype(np.float32) - 8.0) * scale).reshape(n, -1)[:, :k]
        step = np.broadcast_to(scale, nibbles.shape).reshape(n, -1)[:, :k]
        return Weight(value.T, step.T, "MatMulNBits 4-bit per-block")

    def gather_table(self, node) -> Weight:
        """The embedding table a Gather reads: fp32, or quantized with a DequantizeLinear on
        the Gather's output (quantize_dynamic's Gather)."""
        table = self.const(node.input[0])
        if table is not None and table.dtype.kind in "iu":
            deq = [n for n in self.consumers.get(node.output[0], [])
                   if n.op_type == "DequantizeLinear"]
            if len(deq) != 1:
                raise ValueError(f"node {node.name}: quantized table without one dequantization")
            scale = self.const(deq[0].input[1])
            zp = self.const(deq[0].input[2]) if len(deq[0].input) > 2 else None
            if scale is None or scale.size != 1 or (zp is not None and zp.size != 1):
                raise ValueError(f"node {node.name}: only per-tensor quantized tables are known")
            return _dequantize(table, scale, zp, 0, "Gather+DequantizeLinear")
        w = self.resolve(node.input[0])
        if w is None:
            raise ValueError(f"node {node.name}: no constant embedding table")
        return w


def _dequantize(q: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, axis: int,
                source: str) -> Weight:
    """(q - zero_point) * scale, per tensor or along ``axis``."""
    scale = scale.astype(np.float32)
    zp = np.zeros_like(scale, dtype=np.float32) if zp is None else zp.astype(np.float32)
    if scale.ndim == 1 and q.ndim > 1:
        shape = [1] * q.ndim
        shape[axis % q.ndim] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    value = (q.astype(np.float32) - zp) * scale
    kind = "per-tensor" if scale.size == 1 else f"per-axis-{axis % q.ndim}"
    return Weight(value, scale, f"{source} {q.dtype} {kind}")


def combine_tied(a: Weight, b: Weight) -> tuple[np.ndarray, str]:
    """One estimate of a weight stored twice: exact if either copy is, else the middle of the
    intersection of both rounding intervals (the finer copy where they do not meet)."""
    if a.step is None:
        return a.value, f"{a.source} (exact)"
    if b.step is None:
        return b.value, f"{b.source} (exact)"
    sa = np.broadcast_to(a.step, a.value.shape)
    sb = np.broadcast_to(b.step, b.value.shape)
    lo = np.maximum(a.value - sa / 2, b.value - sb / 2)
    hi = np.minimum(a.value + sa / 2, b.value + sb / 2)
    finer = np.where(sa <= sb, a.value, b.value)
    meet = lo <= hi
    out = np.where(meet, (lo + hi) / 2, finer).astype(np.float32)
    return out, (f"intersection of {a.source} and {b.source} "
                 f"({meet.mean():.4f} of entries inside both intervals)")


def read_weights(onnx_path: Path, arch: ArchConfig, vocab: int) -> tuple[dict, dict]:
    """{torch parameter name: fp32 array} and {name: how it was stored} from the graph."""
    g = _Graph(onnx_path)
    found: dict[str, Weight] = {}
    emb = head = None
    head_reads = {i for n in g.graph.node if (n.name or "").startswith("/lm_head/")
                  for i in n.input}
    shared = False  # the embedding is a lookup into the LM head's own table
    for node in g.graph.node:
        name = node.name or ""
        m = _PROJ.match(name)
        if m and node.op_type in _MATMULS:
            w = g.matmul_weight(node)
            w = Weight(w.value.T, None if w.step is None else
                       np.broadcast_to(w.step, w.value.shape).T, w.source)
            module = "self_attn" if m[2] == "attn" else m[2]
            parts = _split_qkv(w, arch) if m[3] == "qkv" else {m[3]: w}
            for proj, part in parts.items():
                found[f"model.layers.{m[1]}.{module}.{proj}_proj.weight"] = part
        elif name.startswith("/lm_head/MatMul") and node.op_type in _MATMULS:
            head = g.matmul_weight(node)  # [H, V]
        elif name.startswith("/model/embed_tokens/") and node.op_type == "Gather":
            if node.input[0] in head_reads:
                shared = True
            elif emb is None:
                emb = g.gather_table(node)  # [V, H]
        elif (m := _NORM.match(name)) and node.op_type in _NORM_OPS:
            vec = [g.const(i) for i in node.input]
            vec = [v for v in vec if v is not None and v.ndim == 1 and v.size == arch.hidden]
            if len(vec) == 1:
                key = (f"model.layers.{m[1]}.{m[2]}.weight" if m[1] is not None
                       else "model.norm.weight")
                found[key] = Weight(vec[0].astype(np.float32), None, "fp32")
    if head is not None and head.value.shape != (arch.hidden, vocab):
        raise ValueError(f"LM head {head.value.shape}, expected ({arch.hidden}, {vocab})")
    sources = {k: w.source for k, w in found.items()}
    if shared and head is not None:
        tied, sources["model.embed_tokens.weight"] = head.value.T, "shared with lm_head " + \
            head.source
    elif emb is None:
        raise ValueError(f"{onnx_path}: no /model/embed_tokens/ Gather")
    elif emb.value.shape != (vocab, arch.hidden):
        raise ValueError(f"embedding {emb.value.shape}, config says ({vocab}, {arch.hidden})")
    elif head is None:
        tied, sources["model.embed_tokens.weight"] = emb.value, emb.source
    else:
        head_t = Weight(head.value.T, None if head.step is None else
                        np.broadcast_to(head.step, head.value.shape).T, "lm_head " + head.source)
        tied, sources["model.embed_tokens.weight"] = combine_tied(
            Weight(emb.value, emb.step, "embedding " + emb.source), head_t)
    weights = {k: w.value for k, w in found.items()}
    weights["model.embed_tokens.weight"] = weights["lm_head.weight"] = tied
    sources["lm_head.weight"] = "tied to model.embed_tokens.weight"
    return weights, sources


def _split_qkv(w: Weight, arch: ArchConfig) -> dict[str, Weight]:
    """The fused graph's packed [q; k; v] rows [out, in] back into the three projections."""
    head_dim = arch.hidden // arch.heads
    sizes = (arch.heads * head_dim, arch.kv_heads * head_dim, arch.kv_heads * head_dim)
    if w.value.shape[0] != sum(sizes):
        raise ValueError(f"qkv_proj has {w.value.shape[0]} rows, the heads in config.json "
                         f"give {sum(sizes)}")
    cuts = np.cumsum(sizes)[:-1]
    steps = [None] * 3 if w.step is None else np.split(
        np.broadcast_to(w.step, w.value.shape), cuts)
    return {p: Weight(v, st, w.source + " (packed qkv)")
            for p, v, st in zip("qkv", np.split(w.value, cuts), steps, strict=True)}


def import_onnx(draft: Path, out: Path, target: Path | None = None,
                check_tokens: int = 64) -> dict:
    """Writes a finished run dir at ``out`` from the ONNX draft dir ``draft``; returns the
    report also written to ``out/import.json`` (sources of the weights, and the fidelity
    of the imported torch model against the ONNX on ``check_tokens`` random draft ids)."""
    import torch

    from edge_client.tools.distill.common import default_target
    from edge_client.tools.distill.model import build_draft
    from shared.atomic_dir import staging_dir

    t0 = time.perf_counter()
    draft, out = Path(draft), Path(out)
    cfg = _check_draft_dir(draft)
    target_dir = Path(target) if target is not None else default_target()
    arch = _arch_from_config(cfg)
    vmap = VocabMap.load(draft / VOCAB_MAP_FILE) if (draft / VOCAB_MAP_FILE).is_file() \
        else VocabMap.identity(arch.sub_vocab)
    if vmap.size != arch.sub_vocab:
        raise ValueError(f"vocab_map has {vmap.size} ids, config.json vocab_size {arch.sub_vocab}")
    _check_target(cfg, vmap, target_dir)

    weights, sources = read_weights(draft / "model.onnx", arch, vmap.size)
    model = build_draft(arch, target_dir, vmap, 0)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        raise ValueError(f"{draft}: weights not found in the graph: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}; unexpected: {extra[:8]}")
    state = {}
    for k, ref in expected.items():
        if tuple(ref.shape) != weights[k].shape:
            raise ValueError(f"{k}: graph gives {weights[k].shape}, the model wants "
                             f"{tuple(ref.shape)}")
        state[k] = torch.from_numpy(np.ascontiguousarray(weights[k])).to(ref.dtype)
    model.load_state_dict(state)
    model.eval()
    fidelity = check_fidelity(model, vmap, draft, check_tokens) if check_tokens else {}

    report = {"draft": str(draft), "imported": time.strftime("%F %T"),
              "params": int(sum(p.numel() for p in model.parameters())),
              "fidelity": fidelity, "sources": sources,
              "seconds": round(time.perf_counter() - t0, 1)}
    ck = finished_ckpt(model.state_dict(), arch, "imported_from", draft)
    with staging_dir(out) as staged:
        torch.save(ck, staged / "ckpt.pt")
        vmap.save(staged / VOCAB_MAP_FILE)
        write_json(staged / "run.json", {"arch": asdict(arch), "target": str(target_dir),
                                         "seed": 0, "imported_from": str(draft),
                                         "created": time.strftime("%F %T")})
        write_json(staged / IMPORT_FILE, jsonable(report))
        if (draft / "MODEL_CARD.md").is_file():
            shutil.copy2(draft / "MODEL_CARD.md", staged / "SOURCE_MODEL_CARD.md")
    log.info("imported %s (%.2fM params) into %s; fidelity %s", draft,
             report["params"] / 1e6, out, fidelity)
    return report


def check_fidelity(model, vmap: VocabMap, draft: Path, tokens: int, seed: int = 0) -> dict:
    """Logits of the imported torch model against the ONNX draft's on ``tokens`` random kept
    ids: max |diff| over kept ids, the logits' std, and argmax agreement."""
    from edge_client.tools.distill.evaluate import onnx_logits_fn, torch_logits_fn

    rng = np.random.default_rng(seed)
    kept = vmap.sub_to_full[vmap.sub_to_full >= 0]
    ids = rng.choice(kept, size=tokens).astype(np.int64)
    ref = onnx_logits_fn(draft)(ids)
    got = torch_logits_fn(model, vmap)(ids)
    cols = kept
    diff = np.abs(ref[:, cols] - got[:, cols])
    return {"tokens": tokens, "max_abs_diff": round(float(diff.max()), 5),
            "mean_abs_diff": round(float(diff.mean()), 5),
            "logit_std": round(float(ref[:, cols].std()), 5),
            "argmax_agree": round(float((ref.argmax(-1) == got.argmax(-1)).mean()), 4)}
