"""Attention of a packed forward: the new tokens of B sessions against their own KV buffers.

The packed forward (``cloud_verifier.packed_forward``) runs the new tokens of all sessions as
one sequence of N rows; each session's rows may only see that session's cache and, causally,
its own new tokens. Three implementations, equal up to float round-off (tested on the CPU),
built from a plan computed once per forward (index tensors, masks, lengths) so that each layer
costs the same few ops whatever B is (except ``loop``):

- ``loop``: one fused ``scaled_dot_product_attention`` per session, on views of its buffer.
  Copies nothing. On a CPU it is the fastest (measured in docs/gpu.md: attention is a small
  part of a CPU forward, and a Python call per session costs microseconds), so it is the CPU
  default.
- ``padded``: one ``scaled_dot_product_attention`` over the batch padded to
  ``[B, heads, Tmax, Emax]`` with a block mask (bottom-right causal within each session, no
  keys past its length). Each layer gathers every session's cache into the padded tensor: one
  ``cat`` and one ``index_select``, a copy of the batch's KV per layer. Runs anywhere.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (Flash Attention over cumulative
  sequence lengths, bottom-right causal), on CUDA in bf16/fp16: no padding, no mask, one
  ``cat`` of the caches per layer. The CUDA default where torch has it.

New keys and values are written into every session's buffer first, with one
``torch._foreach_copy_`` per layer (a fused multi-tensor copy on CUDA). A paged KV pool would
let ``varlen_attn`` read the caches in place (its ``block_table``) and remove the ``cat``;
that changes ``cloud_verifier.kv_store`` and is left for later (docs/gpu.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cloud_verifier.device_copy import to_device
from cloud_verifier.kv_store import SessionKV

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
except ImportError:  # torch < 2.9
    _varlen_attn = None

ATTENTION = ("loop", "padded", "varlen")
# The varlen API changed across torch releases: the causal flag became a window.
_VARLEN_ARGS = set(inspect.signature(_varlen_attn).parameters) if _varlen_attn else set()


def default_attention(device: torch.device, dtype: torch.dtype | None = None) -> str:
    if device.type == "cuda":
        half = dtype in (None, torch.bfloat16, torch.float16)
        return "varlen" if _varlen_attn is not None and half else "padded"
    return "loop"


def check_attention(name: str, device: torch.device) -> None:
    if name not in ATTENTION:
        raise ValueError(f"unknown attention {name!r}; use one of {', '.join(ATTENTION)}")
    if name == "varlen" and (device.type != "cuda" or _varlen_attn is None):
        raise ValueError("varlen attention needs CUDA and torch >= 2.9 "
                         "(torch.nn.attention.varlen)")


@dataclass
class AttentionPlan:
    kind: str
    kvs: list[SessionKV]
    new: list[int]  # new tokens per session
    bounds: list[tuple[int, int]]  # each session's rows in the packed sequence
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    masks: list[torch.Tensor | None] = field(default_factory=list)
    max_q: int = 0
    max_k: int = 0

    @staticmethod
    def build(segments: list[tuple[SessionKV, int]], device: torch.device,
              kind: str) -> AttentionPlan:
        check_attention(kind, device)
        kvs = [kv for kv, _ in segments]
        new = [n for _, n in segments]
        bounds, start = [], 0
        for n in new:
            bounds.append((start, start + n))
            start += n
        plan = AttentionPlan(kind, kvs, new, bounds)
        past = [kv.length for kv in kvs]
        ends = [p + n for p, n in zip(past, new, strict=True)]
        if kind == "loop":
            plan.masks = [_causal_mask(p, n, device) for p, n in zip(past, new, strict=True)]
        elif kind == "padded":
            b, t_max, e_max = len(new), max(new), max(ends)
            query = [lo + min(t, n - 1) for (lo, _), n in zip(bounds, new, strict=True)
                     for t in range(t_max)]
            ctx_start = [sum(ends[:i]) for i in range(b)]
            key = [c + min(j, e - 1) for c, e in zip(ctx_start, ends, strict=True)
                   for j in range(e_max)]
            unpad = [i * t_max + t for i, n in enumerate(new) for t in range(n)]
            # Row t of session i is its token at position past + t: it sees keys 0 .. past + t
            # (bottom-right causal); padded keys (j >= end) are never seen. Padded rows see
            # their session's keys too, so no row is empty (an empty row would give NaN).
            j = torch.arange(e_max)
            rows = torch.tensor(past)[:, None] + torch.arange(t_max)[None, :]  # [B, Tmax]
            mask = (j[None, None, :] <= rows[:, :, None]) \
                & (j[None, None, :] < torch.tensor(ends)[:, None, None])  # [B, Tmax, Emax]
            plan.tensors = {"query": torch.tensor(query), "key": torch.tensor(key),
                            "unpad": torch.tensor(unpad), "mask": mask[:, None]}
            plan.max_q, plan.max_k = t_max, e_max
        else:
            cu_q = [0]
            cu_k = [0]
            for n, e in zip(new, ends, strict=True):
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + e)
            plan.tensors = {"cu_q": torch.tensor(cu_q, dtype=torch.int32),
                            "cu_k": torch.tensor(cu_k, dtype=torch.int32)}
            plan.max_q, plan.max_k = max(new), max(ends)
        plan.tensors = {k: to_device(t, device) for k, t in plan.tensors.items()}
        return plan

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q ``[H, N, hd]``, new k and v ``[Hkv, N, hd]`` of the packed rows -> ``[H, N, hd]``;
        writes k and v into the sessions' buffers at positions ``kv.length ..``."""
        keys = [kv.keys(layer) for kv in self.kvs]  # [Hkv, capacity, hd] each
        values = [kv.values(layer) for kv in self.kvs]
        spans = [(kv.length, kv.length + n) for kv, n in zip(self.kvs, self.new, strict=True)]
        if self.kind == "loop":
            return self._loop(q, k, v, keys, values, spans, scale)
        torch._foreach_copy_(
            [buf[:, a:b] for buf, (a, b) in zip(keys + values, spans + spans, strict=True)],
            [x[:, lo:hi] for x in (k, v) for lo, hi in self.bounds])
        if self.kind == "padded":
            return self._padded(q, keys, values, spans, scale)
        return self._varlen(q, keys, values, spans, scale)

    def _loop(self, q, k, v, keys, values, spans, scale):
        out = torch.empty_like(q)
        for key, value, (a, b), (lo, hi), mask in zip(keys, values, spans, self.bounds,
                                                      self.masks, strict=True):
            key[:, a:b] = k[:, lo:hi]
            value[:, a:b] = v[:, lo:hi]
            out[:, lo:hi] = F.scaled_dot_product_attention(
                q[None, :, lo:hi], key[None, :, :b], value[None, :, :b], attn_mask=mask,
                scale=scale, enable_gqa=True)[0]
        return out

    def _padded(self, q, keys, values, spans, scale):
        t = self.tensors
        b, heads, hd = len(self.kvs), q.shape[0], q.shape[2]

        def gather(bufs: list[torch.Tensor]) -> torch.Tensor:  # [B, Hkv, Emax, hd]
            ctx = torch.cat([buf[:, :end] for buf, (_, end) in zip(bufs, spans, strict=True)],
                            dim=1)
            return ctx.index_select(1, t["key"]).view(ctx.shape[0], b, self.max_k,
                                                      hd).transpose(0, 1)

        queries = q.index_select(1, t["query"]).view(heads, b, self.max_q, hd).transpose(0, 1)
        out = F.scaled_dot_product_attention(queries, gather(keys), gather(values),
                                             attn_mask=t["mask"], scale=scale, enable_gqa=True)
        return out.transpose(0, 1).reshape(heads, b * self.max_q, hd).index_select(1, t["unpad"])

    def _varlen(self, q, keys, values, spans, scale):
        t = self.tensors

        def packed(bufs: list[torch.Tensor]) -> torch.Tensor:  # [sum(ends), Hkv, hd]
            return torch.cat([buf[:, :end].transpose(0, 1)
                              for buf, (_, end) in zip(bufs, spans, strict=True)])

        kk, vv = packed(keys), packed(values)
        kwargs = {"scale": scale}
        if "enable_gqa" in _VARLEN_ARGS:
            kwargs["enable_gqa"] = True
        elif kk.shape[1] != q.shape[0]:
            group = q.shape[0] // kk.shape[1]
            kk, vv = kk.repeat_interleave(group, 1), vv.repeat_interleave(group, 1)
        if "window_size" in _VARLEN_ARGS:
            kwargs["window_size"] = (-1, 0)  # causal, aligned to the last key
        else:
            kwargs["is_causal"] = True
        out = _varlen_attn(q.transpose(0, 1).contiguous(), kk, vv, t["cu_q"], t["cu_k"],
                           self.max_q, self.max_k, **kwargs)  # [N, H, hd]
        return out.transpose(0, 1)


def _causal_mask(past: int, new: int, device: torch.device) -> torch.Tensor | None:
    """New token i (at position past + i) sees positions 0 .. past + i."""
    if new == 1:
        return None
    return torch.ones(new, past + new, dtype=torch.bool, device=device).tril(past)
