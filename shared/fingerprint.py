"""A fingerprint of the target's weights, for drafts conditioned on its hidden state.

A feature-conditioned draft head (``edge_client.feature_draft``) reads the target's hidden
states, so it is only valid for the very weights it was trained on: the tokenizer fingerprint
(``shared.tokenizer_fingerprint``) cannot tell two fine-tunes of one base apart. The verifier
advertises this fingerprint, the head's metadata carries the one it was trained against, and
the edge refuses the head when they differ.

What is hashed: the tensors named by ``fingerprint_tensor_names`` (the token embedding, the
final norm, and the first and last decoder layers, which any fine-tune moves), each as its
name, its shape and its values rounded to bfloat16 (round to nearest even), little-endian, in
C order. The rounding makes a checkpoint and the same weights served in bfloat16 agree
(features at either precision serve the head alike); float16 serving may round differently.

Numpy only: the verifier converts its torch tensors (``t.detach().float().cpu().numpy()``),
the offline tools read the checkpoint's safetensors, and both call ``weights_fingerprint``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np

_HEADER = b"edgespec-target-weights-v1\n"


def fingerprint_tensor_names(num_layers: int) -> tuple[str, ...]:
    """The Hugging Face Llama names of the hashed tensors, in hashing order."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    last = num_layers - 1
    return ("model.embed_tokens.weight",
            "model.norm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            f"model.layers.{last}.self_attn.o_proj.weight",
            f"model.layers.{last}.mlp.down_proj.weight")


def weights_fingerprint(tensors: Mapping[str, np.ndarray], num_layers: int) -> str:
    """``sha256:<hex>`` over the tensors ``fingerprint_tensor_names(num_layers)`` names."""
    h = hashlib.sha256(_HEADER)
    for name in fingerprint_tensor_names(num_layers):
        if name not in tensors:
            raise KeyError(f"weights fingerprint needs tensor {name!r}")
        values = np.ascontiguousarray(tensors[name], dtype=np.float32)
        h.update(name.encode("utf-8") + b"\0")
        h.update(np.asarray(values.shape, dtype="<i8").tobytes())
        h.update(_bfloat16_bits(values).astype("<u2").tobytes())
    return "sha256:" + h.hexdigest()


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> the bits of the nearest bfloat16 (ties to even), as uint16."""
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)
