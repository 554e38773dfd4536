"""One target forward over the new tokens of many sessions, packed without padding.

Sessions differ in context length and in K, so their new tokens are concatenated into one
sequence ``[1, N]`` with per-token positions. Every projection, MLP and the LM head run once
over the packed tokens (that is where the FLOPs are); only attention is per session: each
segment's queries attend to that session's own KV buffer, which the segment's new keys and
values are first written into (``cloud_verifier.attention``: a fused kernel per session on a
CPU, which copies no cache; one kernel for the whole batch on CUDA). Logits come back as one
``[sum(num_logits), V]`` tensor on the model's device, for the batched decisions.

This drives the modules of a Hugging Face Llama-family model (Llama, Mistral, Qwen2, SmolLM:
``model.model.{embed_tokens, layers, norm, rotary_emb}`` with ``self_attn.{q,k,v,o}_proj``)
directly. Other causal LMs go through ``sequential_forward``: one ordinary transformers forward
per session over a cache built from its buffer. Correct for any model with a standard
per-layer KV cache, but it copies each session's cache every round.

How the projections and the LM head are multiplied (``_linear``) decides most of a forward's
time on a CPU, and the fastest kernel depends on the number of rows (new tokens) and on the
CPU, so the few-row cases are timed on the machine itself:

- Weights are packed once into oneDNN's own layout (``packed_weights``; a second copy of the
  projections and LM head, so it costs memory). Above ``TUNED_ROWS`` rows the packed kernel
  runs: MKL's ``x @ W^T`` (what ``nn.Linear`` runs) is far from the memory bandwidth with a
  handful of rows when the weights come from memory, as in a forward, while the packed kernel
  streams them near the bandwidth, so a few more rows cost little more than two.
- Up to ``TUNED_ROWS`` rows the fastest of three kernels is measured when the weights are
  packed (``tune_kernels``: every projection once per kernel and row count, a few seconds):
  the packed kernel; ``nn.Linear``'s ``x @ W^T``; and MKL's ``W @ x^T`` with one row computed
  as two (with one column MKL takes a matrix-vector path on one core). Which wins moved with
  the CPU: on the AMD EPYC (AVX2) where this code began, ``W @ x^T`` took 32 ms for a 1-token
  SmolLM2 forward against 42 packed; on an Intel Xeon with AVX-512 and AMX it takes 91 ms of
  projections against 40 for ``x @ W^T`` and 44 packed (docs/benchmarks.md, "Few-row kernels").
  Every kernel's output is made contiguous (a transposed q/k/v makes
  ``scaled_dot_product_attention`` leave its fused CPU kernel for the slower math fallback).

On CUDA none of this applies: weights are never packed (``packed_weights`` is empty off the
CPU or below fp32) and every projection is ``F.linear`` (cuBLAS).
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from cloud_verifier.attention import AttentionPlan, default_attention
from cloud_verifier.device_copy import to_device
from cloud_verifier.kv_store import SessionKV

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Segment:
    kv: SessionKV  # the session's buffer; positions [0, kv.length) are its cached tokens
    tokens: list[int]  # new tokens, written at positions kv.length ..
    num_logits: int  # logits wanted for the last num_logits new tokens


def supports_packing(model: torch.nn.Module) -> bool:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return (inner is not None and layers is not None and hasattr(inner, "rotary_emb")
            and hasattr(inner, "embed_tokens") and hasattr(model, "lm_head")
            and all(hasattr(layers[0].self_attn, n) for n in ("q_proj", "k_proj", "v_proj",
                                                              "o_proj"))
            and all(hasattr(layers[0].mlp, n) for n in ("gate_proj", "up_proj", "down_proj",
                                                        "act_fn")))


@dataclass
class CpuKernels:
    """How ``_linear`` multiplies on this CPU: the oneDNN-packed weights, and for each row
    count up to ``TUNED_ROWS`` the kernel measured fastest (one of ``KERNELS``)."""

    weights: dict[torch.nn.Linear, torch.Tensor] = field(default_factory=dict)
    by_rows: dict[int, str] = field(default_factory=dict)


KERNELS = ("packed", "x_wt", "w_xt")  # oneDNN packed; MKL x @ W^T; MKL W @ x^T
TUNED_ROWS = 4
_TUNE_REPEATS = 3
_PACKED: weakref.WeakKeyDictionary[torch.nn.Module, CpuKernels] = weakref.WeakKeyDictionary()


def packed_weights(model: torch.nn.Module) -> CpuKernels:
    """The model's projections and LM head as oneDNN-packed weights, with the few-row kernels
    timed on them, built on first use.

    Empty (``nn.Linear``'s path everywhere) unless the weights are fp32 on a CPU with oneDNN.
    The packed copies are taken once: a model whose weights change afterwards must not be
    served (the verifier never changes them).
    """
    kernels = _PACKED.get(model)
    if kernels is None:
        kernels = _PACKED[model] = _pack(model)
    return kernels


def _pack(model: torch.nn.Module) -> CpuKernels:
    weight = model.lm_head.weight
    if (weight.device.type != "cpu" or weight.dtype != torch.float32
            or not torch.backends.mkldnn.is_available()):
        return CpuKernels()
    layers = [getattr(layer.self_attn, n) for layer in model.model.layers
              for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
    layers += [getattr(layer.mlp, n) for layer in model.model.layers
               for n in ("gate_proj", "up_proj", "down_proj")]
    layers.append(model.lm_head)
    packed = {m: pack_weight(m.weight) for m in layers}
    mib = sum(m.weight.numel() * m.weight.element_size() for m in layers) / 2**20
    kernels = CpuKernels(packed, tune_kernels(layers, packed))
    log.info("packed %d projections for oneDNN (%.0f MiB beside the model's weights); "
             "kernel by rows: %s", len(packed), mib, kernels.by_rows)
    return kernels


@torch.inference_mode()
def tune_kernels(layers: list[torch.nn.Linear], packed: dict[torch.nn.Linear, torch.Tensor],
                 rows: int = TUNED_ROWS, repeats: int = _TUNE_REPEATS) -> dict[int, str]:
    """For 1..rows rows, the kernel with the least median time over every layer in turn (the
    weights come from memory, as in a forward)."""
    choice = {}
    for n in range(1, rows + 1):
        inputs = {m: torch.randn(n, m.in_features) for m in layers}
        times = {kernel: _time_pass(layers, inputs, packed, kernel, repeats)
                 for kernel in KERNELS}
        choice[n] = min(KERNELS, key=times.__getitem__)
    return choice


def _time_pass(layers: list[torch.nn.Linear], inputs: dict[torch.nn.Linear, torch.Tensor],
               packed: dict[torch.nn.Linear, torch.Tensor], kernel: str, repeats: int) -> float:
    """Median seconds of one pass over every layer by ``kernel``, after a warm-up pass (its
    first-call allocations)."""
    samples = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        for m in layers:
            _multiply(inputs[m], m, packed, kernel)
        if i:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


@torch.inference_mode()
def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """An ``nn.Linear`` weight ``[out, in]`` in oneDNN's own layout, for ``_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _multiply(rows: torch.Tensor, layer: torch.nn.Linear,
              packed: dict[torch.nn.Linear, torch.Tensor], kernel: str) -> torch.Tensor:
    """``rows [n, in] @ W^T`` (no bias) by ``kernel``, contiguous."""
    if kernel == "packed":
        return torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed[layer], None,
                                                  "none", [], "")
    if kernel == "x_wt":
        return F.linear(rows, layer.weight).contiguous()
    n = rows.shape[0]
    cols = rows.expand(2, -1).contiguous() if n == 1 else rows
    return (layer.weight @ cols.T)[:, :n].T.contiguous()


def _linear(x: torch.Tensor, layer: torch.nn.Linear, kernels: CpuKernels) -> torch.Tensor:
    """``layer(x)`` for x ``[..., in]`` through the kernel chosen for its row count (module
    docstring); ``nn.Linear``'s path without packed weights. Contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    if layer not in kernels.weights or x.device.type != "cpu":
        return F.linear(x, layer.weight, layer.bias)
    out = _multiply(rows, layer, kernels.weights,
                    kernels.by_rows.get(rows.shape[0], "packed"))
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _mlp(mlp: torch.nn.Module, x: torch.Tensor, packed: CpuKernels) -> torch.Tensor:
    """A Llama MLP, ``down(act(gate(x)) * up(x))``, through ``_linear``."""
    gate = mlp.act_fn(_linear(x, mlp.gate_proj, packed))
    return _linear(gate * _linear(x, mlp.up_proj, packed), mlp.down_proj, packed)


@torch.inference_mode()
def sequential_forward(model: torch.nn.Module, segments: list[Segment]) -> list[torch.Tensor]:
    """Same contract as ``packed_forward``, one transformers forward per segment."""
    from transformers import DynamicCache

    out = []
    for seg in segments:
        past, n = seg.kv.length, len(seg.tokens)
        cache = DynamicCache()
        for layer in range(seg.kv.buffer.shape[1]):
            cache.update(seg.kv.keys(layer)[None, :, :past], seg.kv.values(layer)[None, :, :past],
                         layer)
        ids = torch.tensor([seg.tokens], device=seg.kv.buffer.device)
        result = model(input_ids=ids, past_key_values=cache, use_cache=True,
                       logits_to_keep=seg.num_logits)
        for layer, cached in enumerate(cache.layers):
            seg.kv.keys(layer)[:, past:past + n] = cached.keys[0, :, past:past + n]
            seg.kv.values(layer)[:, past:past + n] = cached.values[0, :, past:past + n]
        out.append(result.logits[0, -seg.num_logits:].float())
    return out


def sequential_logits(model: torch.nn.Module, segments: list[Segment]) -> torch.Tensor:
    """``sequential_forward``'s logits as one ``[sum(num_logits), V]`` tensor."""
    return torch.cat(sequential_forward(model, segments))


def packed_forward(model: torch.nn.Module, segments: list[Segment],
                   attention: str | None = None) -> list[torch.Tensor]:
    """Runs all segments in one pass; returns per segment its ``[num_logits, V]`` logits
    (views of ``packed_logits``)."""
    logits = packed_logits(model, segments, attention)
    return list(torch.split(logits, [s.num_logits for s in segments]))


def packed_logits(model: torch.nn.Module, segments: list[Segment],
                  attention: str | None = None) -> torch.Tensor:
    """Runs all segments in one pass; returns float32 logits ``[sum(num_logits), V]``, segment
    after segment, each segment's last ``num_logits`` tokens (``packed_rows``' first half)."""
    return packed_rows(model, segments, attention)[0]


@torch.inference_mode()
def packed_rows(model: torch.nn.Module, segments: list[Segment],
                attention: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs all segments in one pass; returns (float32 logits ``[sum(num_logits), V]``,
    segment after segment, each segment's last ``num_logits`` tokens; and the final-norm
    hidden states ``[sum(num_logits), d]`` those logits were read from, in the model's dtype:
    the target features, cloud_verifier.features). Keeping the hidden rows costs nothing: the
    LM head reads them anyway.

    Writes each segment's new keys/values at positions ``kv.length ..`` of its buffer (the
    caller must have ensured capacity) but does not change ``kv.length``: committing is the
    caller's decision. ``attention`` picks how attention runs (``cloud_verifier.attention``;
    None: the default for the model's device).
    """
    inner = model.model
    packed = packed_weights(model)
    device = inner.embed_tokens.weight.device
    plan = AttentionPlan.build([(s.kv, len(s.tokens)) for s in segments], device,
                               attention or default_attention(device,
                                                              inner.embed_tokens.weight.dtype))
    ids = to_device([t for s in segments for t in s.tokens], device)
    positions = to_device([p for s in segments
                           for p in range(s.kv.length, s.kv.length + len(s.tokens))], device)
    start, wanted = 0, []  # the rows whose logits are returned
    for s in segments:
        start += len(s.tokens)
        wanted.extend(range(start - s.num_logits, start))
    wanted = to_device(wanted, device)
    hidden = inner.embed_tokens(ids)[None]  # [1, N, d]
    cos, sin = inner.rotary_emb(hidden, positions[None])
    n = ids.shape[0]
    for layer_idx, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        # [1, H, N, hd]; k and v with the KV heads
        q = _linear(x, attn.q_proj, packed).view(1, n, -1, attn.head_dim).transpose(1, 2)
        k = _linear(x, attn.k_proj, packed).view(1, n, -1, attn.head_dim).transpose(1, 2)
        v = _linear(x, attn.v_proj, packed).view(1, n, -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = plan.attend(layer_idx, q[0], k[0], v[0], attn.scaling)  # [H, N, hd]
        hidden = hidden + _linear(out.transpose(0, 1).reshape(1, n, -1), attn.o_proj, packed)
        hidden = hidden + _mlp(layer.mlp, layer.post_attention_layernorm(hidden), packed)
    rows = inner.norm(hidden)[0][wanted]
    return _linear(rows, model.lm_head, packed).float(), rows
