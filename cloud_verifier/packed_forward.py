"""One target forward over the new tokens of many sessions, packed without padding.

Sessions differ in context length and in K, so their new tokens are concatenated into one
sequence ``[1, N]`` with per-token positions. Every projection, MLP and the LM head run once
over the packed tokens (that is where the FLOPs are); only attention is per session: each
segment's queries attend to that session's own KV buffer, which the segment's new keys and
values are first written into. No session's cache is copied or padded to build the batch.

This drives the modules of a Hugging Face Llama-family model (Llama, Mistral, Qwen2, SmolLM:
``model.model.{embed_tokens, layers, norm, rotary_emb}`` with ``self_attn.{q,k,v,o}_proj``)
directly. Other causal LMs go through ``sequential_forward``: one ordinary transformers forward
per session over a cache built from its buffer. Correct for any model with a standard
per-layer KV cache, but it copies each session's cache every round.

With at most ``FEW_ROWS`` new tokens the projections are computed as ``W @ x^T``
(``_linear``) rather than ``nn.Linear``'s ``x @ W^T``: the same product, but for a few rows
this orientation takes a much faster MKL path on the project's 2-core CPU (LM head alone: 2
rows 15 vs 39 ms, 5 rows 24 vs 46 ms; whole packed forward, two A/B runs: one session with
2-5 new tokens 110-140 vs 151-209 ms, two sessions x 1 token 117-125 vs 169-180 ms). With
more rows ``W @ x^T`` does not win (whole forward, A/B in one process, 10..160 rows: 0.87-1.03x
of ``nn.Linear``'s time, 2026-11-30), so ``nn.Linear``'s path is kept there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from cloud_verifier.kv_store import SessionKV


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


FEW_ROWS = 8


def _linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """``layer(x)`` for x ``[..., in]``; as ``W @ x^T`` for a few rows (module docstring)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > FEW_ROWS:
        return F.linear(x, layer.weight, layer.bias)
    out = (layer.weight @ rows.T).T
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A Llama MLP, ``down(act(gate(x)) * up(x))``, through ``_linear``."""
    return _linear(mlp.act_fn(_linear(x, mlp.gate_proj)) * _linear(x, mlp.up_proj),
                   mlp.down_proj)


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


@torch.inference_mode()
def packed_forward(model: torch.nn.Module, segments: list[Segment]) -> list[torch.Tensor]:
    """Runs all segments in one pass; returns per segment its ``[num_logits, V]`` logits.

    Writes each segment's new keys/values at positions ``kv.length ..`` of its buffer (the
    caller must have ensured capacity) but does not change ``kv.length``: committing is the
    caller's decision.
    """
    inner = model.model
    device = inner.embed_tokens.weight.device
    ids = torch.tensor([t for s in segments for t in s.tokens], device=device)
    positions = torch.cat([torch.arange(s.kv.length, s.kv.length + len(s.tokens))
                           for s in segments]).to(device)
    bounds, start = [], 0
    for s in segments:
        bounds.append((start, start + len(s.tokens)))
        start += len(s.tokens)
    masks = [_causal_mask(s.kv.length, len(s.tokens), device) for s in segments]

    hidden = inner.embed_tokens(ids)[None]  # [1, N, d]
    cos, sin = inner.rotary_emb(hidden, positions[None])
    n = ids.shape[0]
    for layer_idx, layer in enumerate(inner.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = _linear(x, attn.q_proj).view(1, n, -1, attn.head_dim).transpose(1, 2)  # [1,H,N,hd]
        k = _linear(x, attn.k_proj).view(1, n, -1, attn.head_dim).transpose(1, 2)  # Hkv heads
        v = _linear(x, attn.v_proj).view(1, n, -1, attn.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = torch.empty_like(q)
        for seg, (lo, hi), mask in zip(segments, bounds, masks, strict=True):
            end = seg.kv.length + (hi - lo)
            keys, values = seg.kv.keys(layer_idx), seg.kv.values(layer_idx)
            keys[:, seg.kv.length:end] = k[0, :, lo:hi]
            values[:, seg.kv.length:end] = v[0, :, lo:hi]
            out[:, :, lo:hi] = F.scaled_dot_product_attention(
                q[:, :, lo:hi], keys[None, :, :end], values[None, :, :end], attn_mask=mask,
                scale=attn.scaling, enable_gqa=True)
        hidden = hidden + _linear(out.transpose(1, 2).reshape(1, n, -1), attn.o_proj)
        hidden = hidden + _mlp(layer.mlp, layer.post_attention_layernorm(hidden))
    hidden = inner.norm(hidden)[0]
    wanted = torch.cat([torch.arange(hi - s.num_logits, hi) for s, (_, hi)
                        in zip(segments, bounds, strict=True)]).to(device)
    logits = _linear(hidden[wanted], model.lm_head).float()
    return list(torch.split(logits, [s.num_logits for s in segments]))


def _causal_mask(past: int, new: int, device: torch.device) -> torch.Tensor | None:
    """New token i (at position past + i) sees positions 0 .. past + i."""
    if new == 1:
        return None
    return torch.ones(new, past + new, dtype=torch.bool, device=device).tril(past)
