"""Offline: write a Llama-family checkpoint as one ONNX graph built from onnxruntime's fused
operators (``GroupQueryAttention`` with rotary inside, ``SkipSimplifiedLayerNormalization``,
one packed QKV projection per layer) instead of tracing it through PyTorch.

Why: optimum's traced export of the draft has 1,730 nodes for 37 matrix products, and
onnxruntime's profiler puts about 35 % of a draft step in the small shape, mask and rotary
nodes around them (docs/LOG.md 2026-12-03). This graph has a dozen nodes a layer.

It keeps the contract ``edge_client.draft_model.OnnxDraftModel`` runs: inputs ``input_ids``
[batch, seq], ``attention_mask`` [batch, past + seq] (all ones: the attention reads the
sequence length from it, so left padding is not supported) and
``past_key_values.{i}.key/.value`` [batch, kv_heads, past, head_dim]; outputs ``logits``
[batch, seq, vocab] and ``present.{i}.key/.value``. There is no ``position_ids``: positions
follow from the past length. Node names follow optimum's (``/model/layers.{i}/mlp/gate_proj/
MatMul``, ``/lm_head/MatMul``) so the quantization passes select the same layers.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np

from edge_client.tools.export_draft import TOKENIZER_FILES
from shared.atomic_dir import staging_dir

log = logging.getLogger(__name__)

# IR 8 and opset 17, as the traced export writes: onnxruntime releases older than the one
# that wrote the file load it too (1.20 refuses the IR 10+ that onnx 1.23 writes by default).
_IR_VERSION = 8
_OPSET = 17
_MS = "com.microsoft"
_COPIED = ("config.json", *TOKENIZER_FILES)


class UnsupportedArchitecture(ValueError):
    """The checkpoint uses something this graph does not express."""


def _check_config(cfg: dict) -> None:
    problems = []
    if cfg.get("model_type") != "llama":
        problems.append(f"model_type {cfg.get('model_type')!r} (want 'llama')")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r}")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        problems.append("biases in attention or MLP")
    if cfg.get("rope_scaling"):
        problems.append(f"rope_scaling {cfg['rope_scaling']!r}")
    head_dim = _head_dim(cfg)
    if head_dim % 16:
        # onnxruntime's CPU GroupQueryAttention kernel takes multiples of 16 only.
        problems.append(f"head_dim {head_dim} (GroupQueryAttention wants a multiple of 16)")
    if problems:
        raise UnsupportedArchitecture("fused graph export: unsupported " + "; ".join(problems))


def _head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))


def _load_weights(pt_dir: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    files = sorted(pt_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {pt_dir}")
    weights: dict[str, np.ndarray] = {}
    for f in files:
        weights.update({k: v.astype(np.float32) for k, v in load_file(str(f)).items()})
    return weights


def _rotary_caches(cfg: dict, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of position x inverse frequency, [max_positions, head_dim / 2]: the
    non-interleaved (rotate-half) rotary that Hugging Face's Llama applies."""
    theta = float(cfg.get("rope_theta", 10000.0))
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.outer(np.arange(int(cfg["max_position_embeddings"]), dtype=np.float64),
                      inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def build_fused_model(cfg: dict, weights: dict[str, np.ndarray]):
    """The ONNX ModelProto for a Llama config and its weights (Hugging Face names)."""
    from onnx import TensorProto, helper, numpy_helper

    _check_config(cfg)
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = _head_dim(cfg)
    layers = int(cfg["num_hidden_layers"])
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    embed = weights["model.embed_tokens.weight"]
    vocab = embed.shape[0]
    head_w = weights.get("lm_head.weight", embed)  # tied when the checkpoint has no head

    inits: list = []
    nodes: list = []
    # Activation types and shapes, declared: onnx's shape inference stops at the com.microsoft
    # operators, and the quantizer needs every MatMul input's type.
    typed: list = []

    def init(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(op: str, inputs: list[str], name: str, n_out: int = 1, domain: str = "",
             outputs: list[str] | None = None, width: int | None = None,
             **attrs) -> list[str]:
        """Adds a node; ``width``: its float outputs (0, and 3 of a skip norm) are
        [batch_size, sequence_length, width]."""
        outs = outputs or [f"{name}/output_{k}" for k in range(n_out)]
        nodes.append(helper.make_node(op, inputs, outs, name=name, domain=domain, **attrs))
        if width is not None:
            typed.extend(helper.make_tensor_value_info(
                outs[k], TensorProto.FLOAT, ["batch_size", "sequence_length", width])
                for k in (0, 3) if k < len(outs) and outs[k])
        return outs

    def matmul(x: str, weight_out_in: np.ndarray, scope: str, wname: str) -> str:
        # Hugging Face stores [out, in]; MatMul wants [in, out].
        w = init(wname, weight_out_in.T)
        return node("MatMul", [x, w], f"{scope}/MatMul", width=int(weight_out_in.shape[0]))[0]

    # The attention reads each row's length from the mask: seqlens_k = sum(mask) - 1 and the
    # total length is the mask's width.
    one = init("/model/constants/one", np.array([1], np.int64))
    summed = node("ReduceSum", ["attention_mask", one], "/model/attn_mask/ReduceSum",
                  keepdims=0)[0]
    minus = node("Sub", [summed, one], "/model/attn_mask/Sub")[0]
    seqlens_k = node("Cast", [minus], "/model/attn_mask/SeqlensK", to=TensorProto.INT32)[0]
    shape = node("Shape", ["attention_mask"], "/model/attn_mask/Shape")[0]
    width = node("Gather", [shape, init("/model/constants/axis1", np.array(1, np.int64))],
                 "/model/attn_mask/Width", axis=0)[0]
    total = node("Cast", [width], "/model/attn_mask/TotalLength", to=TensorProto.INT32)[0]
    cos, sin = _rotary_caches(cfg, head_dim)
    init("cos_cache", cos)
    init("sin_cache", sin)

    x = node("Gather", [init("model.embed_tokens.weight", embed), "input_ids"],
             "/model/embed_tokens/Gather", width=hidden)[0]
    residual, mlp_out = x, None
    for i in range(layers):
        p, s = f"model.layers.{i}.", f"/model/layers.{i}"
        ln_in = init(f"{p}input_layernorm.weight", weights[f"{p}input_layernorm.weight"])
        if mlp_out is None:
            h = node("SimplifiedLayerNormalization", [x, ln_in], f"{s}/input_layernorm",
                     width=hidden, epsilon=eps, axis=-1, stash_type=1)[0]
        else:
            h, _, _, residual = node("SkipSimplifiedLayerNormalization",
                                     [residual, mlp_out, ln_in], f"{s}/input_layernorm",
                                     n_out=4, domain=_MS, width=hidden, epsilon=eps)
        qkv_w = np.concatenate([weights[f"{p}self_attn.{n}_proj.weight"] for n in "qkv"])
        qkv = matmul(h, qkv_w, f"{s}/attn/qkv_proj", f"{p}self_attn.qkv_proj.weight")
        attn = node("GroupQueryAttention",
                    [qkv, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value",
                     seqlens_k, total, "cos_cache", "sin_cache"],
                    f"{s}/attn/GroupQueryAttention", domain=_MS, width=heads * head_dim,
                    outputs=[f"{s}/attn/GroupQueryAttention/output_0",
                             f"present.{i}.key", f"present.{i}.value"],
                    num_heads=heads, kv_num_heads=kv_heads, scale=head_dim ** -0.5,
                    do_rotary=1, rotary_interleaved=0)[0]
        o = matmul(attn, weights[f"{p}self_attn.o_proj.weight"], f"{s}/attn/o_proj",
                   f"{p}self_attn.o_proj.weight")
        ln_post = init(f"{p}post_attention_layernorm.weight",
                       weights[f"{p}post_attention_layernorm.weight"])
        h, _, _, residual = node("SkipSimplifiedLayerNormalization", [residual, o, ln_post],
                                 f"{s}/post_attention_layernorm", n_out=4, domain=_MS,
                                 width=hidden, epsilon=eps)
        gate = matmul(h, weights[f"{p}mlp.gate_proj.weight"], f"{s}/mlp/gate_proj",
                      f"{p}mlp.gate_proj.weight")
        up = matmul(h, weights[f"{p}mlp.up_proj.weight"], f"{s}/mlp/up_proj",
                    f"{p}mlp.up_proj.weight")
        inter = int(weights[f"{p}mlp.up_proj.weight"].shape[0])
        sig = node("Sigmoid", [gate], f"{s}/mlp/act_fn/Sigmoid", width=inter)[0]
        act = node("Mul", [gate, sig], f"{s}/mlp/act_fn/Mul", width=inter)[0]
        prod = node("Mul", [act, up], f"{s}/mlp/Mul", width=inter)[0]
        mlp_out = matmul(prod, weights[f"{p}mlp.down_proj.weight"], f"{s}/mlp/down_proj",
                         f"{p}mlp.down_proj.weight")
    final = node("SkipSimplifiedLayerNormalization",
                 [residual, mlp_out, init("model.norm.weight", weights["model.norm.weight"])],
                 "/model/norm", domain=_MS, width=hidden, epsilon=eps)[0]
    node("MatMul", [final, init("lm_head.weight", head_w.T)], "/lm_head/MatMul",
         outputs=["logits"])

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    kv_past = ["batch_size", kv_heads, "past_sequence_length", head_dim]
    kv_total = ["batch_size", kv_heads, "total_sequence_length", head_dim]
    graph_inputs = [
        helper.make_tensor_value_info("input_ids", i64, ["batch_size", "sequence_length"]),
        helper.make_tensor_value_info("attention_mask", i64,
                                      ["batch_size", "total_sequence_length"])]
    graph_outputs = [helper.make_tensor_value_info(
        "logits", f32, ["batch_size", "sequence_length", vocab])]
    for i in range(layers):
        for kind in ("key", "value"):
            graph_inputs.append(helper.make_tensor_value_info(
                f"past_key_values.{i}.{kind}", f32, kv_past))
            graph_outputs.append(helper.make_tensor_value_info(
                f"present.{i}.{kind}", f32, kv_total))
    graph = helper.make_graph(nodes, "edgespec_fused_llama", graph_inputs, graph_outputs,
                              initializer=inits, value_info=typed)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET),
                                                   helper.make_opsetid(_MS, 1)],
                             producer_name="edgespec.fused_graph", ir_version=_IR_VERSION)


def export_fused_onnx(pt_dir: Path, onnx_dir: Path) -> Path:
    """``export_draft.export_onnx``'s contract with the fused graph: ``onnx_dir/model.onnx``
    plus the checkpoint's config and tokenizer files."""
    import onnx

    pt_dir, onnx_dir = Path(pt_dir), Path(onnx_dir)
    t0 = time.perf_counter()
    cfg = json.loads((pt_dir / "config.json").read_text())
    model = build_fused_model(cfg, _load_weights(pt_dir))
    with staging_dir(onnx_dir) as staged:
        onnx.save(model, str(staged / "model.onnx"))
        for name in _COPIED:
            if (pt_dir / name).is_file():
                shutil.copy2(pt_dir / name, staged / name)
    log.info("fused graph of %s written to %s in %.1f s", pt_dir, onnx_dir,
             time.perf_counter() - t0)
    return onnx_dir
