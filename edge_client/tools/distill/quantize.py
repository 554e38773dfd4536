"""ONNX graph edits behind the int8 export: an untied LM head (so dynamic quantization covers
it), weight-only int8 for the MatMuls whose activations stay fp32, and for size 4-bit
MatMulNBits weights and one shared table for the embedding and the head (``quantize_draft``
runs them in order). Measured on v7: docs/benchmarks.md "Draft size"."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def weight_only_int8(onnx_path: Path, node_names: Sequence[str]) -> None:
    """Stores the weights of the named fp32 MatMuls as int8 (symmetric, one scale per output
    column) behind a DequantizeLinear, in place. onnxruntime folds the dequantization into a
    constant when the session loads, so the MatMul still runs in fp32 on fp32 activations:
    a quarter of the bytes on disk, the accuracy of fp32."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(onnx_path))
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    wanted = set(node_names)
    nodes = []
    for node in graph.node:
        if node.name in wanted and node.op_type == "MatMul" and node.input[1] in weights:
            name = node.input[1]
            w = numpy_helper.to_array(weights[name]).astype(np.float32)  # [in, out]
            scale = np.abs(w).max(axis=0) / 127.0
            scale[scale == 0] = 1.0
            q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
            graph.initializer.remove(weights[name])
            graph.initializer.extend([
                numpy_helper.from_array(q, f"{name}_int8"),
                numpy_helper.from_array(scale.astype(np.float32), f"{name}_int8_scale"),
                numpy_helper.from_array(np.zeros(q.shape[1], np.int8), f"{name}_int8_zero")])
            nodes.append(helper.make_node(
                "DequantizeLinear", [f"{name}_int8", f"{name}_int8_scale", f"{name}_int8_zero"],
                [f"{name}_dequantized"], name=f"{node.name}_dequantize", axis=1))
            node.input[1] = f"{name}_dequantized"
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(onnx_path))


def untie_lm_head(onnx_in: Path, onnx_out: Path) -> bool:
    """Writes ``onnx_in`` to ``onnx_out`` with the LM head's weight as its own constant when
    the head is tied (a MatMul on a Transpose of the embedding initializer). Returns False,
    writing nothing, when the head already has a constant weight or is not found."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_in))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    heads = [n for n in graph.node if n.op_type == "MatMul" and "lm_head" in n.name]
    if len(heads) != 1 or heads[0].input[1] in inits:
        return False
    head = heads[0]
    transpose = producer.get(head.input[1])
    if transpose is None or transpose.op_type != "Transpose" \
            or transpose.input[0] not in inits:
        return False
    weight = numpy_helper.to_array(inits[transpose.input[0]])
    perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
    name = "lm_head.weight_untied"
    graph.initializer.append(numpy_helper.from_array(
        np.ascontiguousarray(np.transpose(weight, perm)), name))
    head.input[1] = name
    if not any(transpose.output[0] in n.input for n in graph.node):
        graph.node.remove(transpose)
    onnx.save(model, str(onnx_out))
    return True


def matmuls_named(onnx_path: Path, patterns: Sequence[str]) -> list[str]:
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return [n.name for n in graph.node
            if n.op_type == "MatMul" and any(p in n.name for p in patterns)]


def int4_matmuls(onnx_in: Path, onnx_out: Path, node_names: Sequence[str],
                 block_size: int = 32, accuracy_level: int = 0) -> list[str]:
    """Writes ``onnx_in`` to ``onnx_out`` with the named fp32 MatMuls (constant weights) as
    onnxruntime's 4-bit weight-only MatMulNBits: symmetric blocks of ``block_size`` input
    rows, one fp32 scale each (0.5 + 4/block_size bytes a weight). ``accuracy_level`` 0
    keeps fp32 activations; 4 lets the kernel quantize them to int8 per block. Returns the
    names of the MatMuls it converted."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(onnx_in))
    wanted = set(node_names)
    inits = {t.name for t in model.graph.initializer}
    # nodes_to_include does not narrow the op-type match, so everything else is excluded.
    others = [n.name for n in model.graph.node if n.op_type == "MatMul" and n.name not in wanted]
    done = [n.name for n in model.graph.node if n.name in wanted and n.op_type == "MatMul"
            and n.input[1] in inits]
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=block_size, is_symmetric=True,
                                     accuracy_level=accuracy_level or None,
                                     nodes_to_exclude=others)
    quantizer.process()
    onnx.save(quantizer.model.model, str(onnx_out))
    return done


def _embedding_gather(graph, inits: dict, vocab: int, hidden: int):
    """The Gather reading the [vocab, hidden] embedding initializer, and the node whose output
    is the looked-up embedding (a DequantizeLinear after it when the table is int8)."""
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] in inits
               and list(inits[n.input[0]].dims) == [vocab, hidden]]
    if len(gathers) != 1:
        return None, None
    gather = gathers[0]
    users = [n for n in graph.node if gather.output[0] in n.input]
    if len(users) == 1 and users[0].op_type == "DequantizeLinear":
        return gather, users[0]
    return gather, gather


def share_embedding(onnx_path: Path) -> bool:
    """Drops the embedding table, in place, and looks token embeddings up in the quantized LM
    head's weight instead, so one copy of the [vocab, hidden] matrix is stored. The head must be
    an int8 MatMulInteger (``quantize_dynamic``; weight [hidden, vocab], one scale and zero point
    per vocabulary column) or a 4-bit MatMulNBits (``int4_matmuls``; [vocab, blocks, bytes]).
    Row v of the embedding becomes column v of the dequantized head: the tied weights, each
    quantized once. Returns False, changing nothing, when no such head or table is found."""
    import onnx

    model = onnx.load(str(onnx_path))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    heads = [n for n in graph.node if "lm_head" in n.name
             and n.op_type in ("MatMulInteger", "MatMulNBits") and n.input[1] in inits]
    if len(heads) != 1:
        return False
    head = heads[0]
    if head.op_type == "MatMulInteger":
        hidden, vocab = inits[head.input[1]].dims
    else:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in head.attribute}
        hidden, vocab = attrs["K"], attrs["N"]
    gather, last = _embedding_gather(graph, inits, vocab, hidden)
    if gather is None:
        return False
    ids, out = gather.input[1], last.output[0]
    if head.op_type == "MatMulInteger":
        nodes = _int8_lookup(head, inits, ids, out)
    else:
        nodes = _int4_lookup(head, inits, ids, out, attrs)
    if nodes is None:
        return False
    graph.initializer.extend(nodes.pop())
    at = list(graph.node).index(gather)
    dropped = {id(gather), id(last)}
    kept = [n for n in graph.node if id(n) not in dropped]
    del graph.node[:]
    graph.node.extend(kept[:at] + nodes + kept[at:])
    used = {i for n in graph.node for i in n.input}
    for name in {*gather.input, *last.input} - used:
        if name in inits:
            graph.initializer.remove(inits[name])
    onnx.save(model, str(onnx_path))
    return True


def _int8_lookup(head, inits: dict, ids: str, out: str):
    """Gather(axis=1) of the head's int8 columns -> [.., hidden] -> (q - zero) * scale."""
    from onnx import TensorProto, helper, numpy_helper

    weight = head.input[1]
    base = weight.removesuffix("_quantized")
    scale, zero = f"{base}_scale", head.input[3] if len(head.input) > 3 else ""
    if scale not in inits:
        return None
    rank_perm = [1, 2, 0]  # input_ids is [batch, seq]
    p = "/model/embed_tokens/shared"
    extra = [numpy_helper.from_array(np.array([-1], np.int64), f"{p}_last_axis")]
    nodes = [helper.make_node("Gather", [weight, ids], [f"{p}_cols"], name=f"{p}_Gather", axis=1),
             helper.make_node("Transpose", [f"{p}_cols"], [f"{p}_rows"], name=f"{p}_Transpose",
                              perm=rank_perm),
             helper.make_node("Cast", [f"{p}_rows"], [f"{p}_q"], name=f"{p}_Cast",
                              to=TensorProto.FLOAT)]
    q = f"{p}_q"
    zeros = numpy_helper.to_array(inits[zero]) if zero in inits else np.zeros(1)
    if np.any(zeros != 0):
        nodes += [helper.make_node("Gather", [zero, ids], [f"{p}_zp"], name=f"{p}_GatherZero"),
                  helper.make_node("Cast", [f"{p}_zp"], [f"{p}_zpf"], name=f"{p}_CastZero",
                                   to=TensorProto.FLOAT),
                  helper.make_node("Unsqueeze", [f"{p}_zpf", f"{p}_last_axis"], [f"{p}_zpu"],
                                   name=f"{p}_UnsqueezeZero"),
                  helper.make_node("Sub", [q, f"{p}_zpu"], [f"{p}_centred"], name=f"{p}_Sub")]
        q = f"{p}_centred"
    if numpy_helper.to_array(inits[scale]).size == 1:
        nodes.append(helper.make_node("Mul", [q, scale], [out], name=f"{p}_Mul"))
    else:
        nodes += [helper.make_node("Gather", [scale, ids], [f"{p}_s"], name=f"{p}_GatherScale"),
                  helper.make_node("Unsqueeze", [f"{p}_s", f"{p}_last_axis"], [f"{p}_su"],
                                   name=f"{p}_UnsqueezeScale"),
                  helper.make_node("Mul", [q, f"{p}_su"], [out], name=f"{p}_Mul")]
    return nodes + [extra]


def _int4_lookup(head, inits: dict, ids: str, out: str, attrs: dict):
    """Gather of the head's packed 4-bit rows [.., blocks, bytes] -> nibbles (low first)
    -> (q - 8) * block scale -> [.., hidden]. Symmetric MatMulNBits only."""
    from onnx import TensorProto, helper, numpy_helper

    if (len(head.input) > 3 and head.input[3]) or attrs.get("bits", 4) != 4:
        return None
    hidden, vocab, block = attrs["K"], attrs["N"], attrs["block_size"]
    if hidden % block:
        return None
    blocks = hidden // block
    weight, scale = head.input[1], head.input[2]
    p = "/model/embed_tokens/shared"

    def const(name, value):
        return numpy_helper.from_array(np.array(value), f"{p}_{name}")

    extra = [const("last_axis", np.array([-1], np.int64)), const("low", np.uint8(15)),
             const("four", np.uint8(4)), const("eight", np.float32(8.0)),
             const("scale_shape", np.array([vocab, blocks], np.int64)),
             const("block_shape", np.array([0, 0, blocks, block], np.int64)),
             const("row_shape", np.array([0, 0, hidden], np.int64))]
    mk = helper.make_node
    nodes = [mk("Gather", [weight, ids], [f"{p}_packed"], name=f"{p}_Gather", axis=0),
             mk("BitwiseAnd", [f"{p}_packed", f"{p}_low"], [f"{p}_lo"], name=f"{p}_And"),
             mk("BitShift", [f"{p}_packed", f"{p}_four"], [f"{p}_hi"], name=f"{p}_Shift",
                direction="RIGHT"),
             mk("Unsqueeze", [f"{p}_lo", f"{p}_last_axis"], [f"{p}_lo1"], name=f"{p}_UnsqLo"),
             mk("Unsqueeze", [f"{p}_hi", f"{p}_last_axis"], [f"{p}_hi1"], name=f"{p}_UnsqHi"),
             mk("Concat", [f"{p}_lo1", f"{p}_hi1"], [f"{p}_pairs"], name=f"{p}_Concat", axis=-1),
             mk("Reshape", [f"{p}_pairs", f"{p}_block_shape"], [f"{p}_nib"],
                name=f"{p}_ReshapeBlocks"),
             mk("Cast", [f"{p}_nib"], [f"{p}_nibf"], name=f"{p}_Cast", to=TensorProto.FLOAT),
             mk("Sub", [f"{p}_nibf", f"{p}_eight"], [f"{p}_q"], name=f"{p}_Sub"),
             mk("Reshape", [scale, f"{p}_scale_shape"], [f"{p}_scales"], name=f"{p}_ReshapeS"),
             mk("Gather", [f"{p}_scales", ids], [f"{p}_s"], name=f"{p}_GatherScale", axis=0),
             mk("Unsqueeze", [f"{p}_s", f"{p}_last_axis"], [f"{p}_su"], name=f"{p}_UnsqS"),
             mk("Mul", [f"{p}_q", f"{p}_su"], [f"{p}_rowsb"], name=f"{p}_Mul"),
             mk("Reshape", [f"{p}_rowsb", f"{p}_row_shape"], [out], name=f"{p}_ReshapeRows")]
    return nodes + [extra]


def quantize_draft(fp32_onnx: Path, out_onnx: Path, keep_fp32: Sequence[str] = ("down_proj",),
                   per_channel: bool = True, share: bool = False, int4: Sequence[str] = (),
                   int4_block: int = 32, int4_accuracy: int = 4) -> dict:
    """fp32 draft ONNX -> the edge's quantized ONNX at ``out_onnx``: the tied head untied,
    the MatMuls named by ``int4`` (name parts) as 4-bit MatMulNBits, the rest dynamically
    quantized to int8 except ``keep_fp32`` (int8 weights, fp32 activations), and with
    ``share`` one table for the embedding and the head. Returns what was done."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    out_onnx = Path(out_onnx)
    work = out_onnx.with_name(out_onnx.stem + ".stage.onnx")
    done: dict = {"untied": untie_lm_head(fp32_onnx, work)}
    source = work if done["untied"] else Path(fp32_onnx)
    try:
        done["int4"] = int4_matmuls(source, work, matmuls_named(source, int4), int4_block,
                                    int4_accuracy) if int4 else []
        source = work if int4 else source
        # reduce_range: per-channel int8 weights without it overflow the u8 x s8 dot
        # products on CPUs without VNNI (measured: greedy acceptance 0.33 -> 0.09).
        quantize_dynamic(source, out_onnx, weight_type=QuantType.QInt8, per_channel=per_channel,
                         reduce_range=True, nodes_to_exclude=matmuls_named(source, keep_fp32))
    finally:
        work.unlink(missing_ok=True)
        for extra in out_onnx.parent.glob("*.onnx.data"):
            extra.unlink()
    weight_only_int8(out_onnx, matmuls_named(out_onnx, keep_fp32))
    done["shared_embedding"] = share_embedding(out_onnx) if share else False
    if share and not done["shared_embedding"]:
        raise ValueError("--share-embedding: no quantized LM head and embedding table found")
    return done
