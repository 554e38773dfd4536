"""ONNX graph edits behind the int8 export: an untied LM head (so dynamic quantization covers
it) and weight-only int8 for the MatMuls whose activations stay fp32."""

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
