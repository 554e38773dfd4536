"""The feature head: a one-layer draft conditioned on the target's final hidden state
(EAGLE-style, arXiv 2401.15077), in torch, for training and export.

Notation: f_i is the target's hidden state after its final norm at position i (what its LM
head reads; f_i decided token x_{i+1}). A verify result carries one of them, f_{m-1}, int8
encoded (``shared.feature_codec``). The head then runs a chain, one step per position:

    step j (chain position j = 0, 1, ...):  input (g_j, x_{m+j}) -> predicted f^_{m+j}
    g_0 = f_{m-1} (true, the wire's round trip), g_j = f^_{m+j-1} (its own prediction)

and the logits of step j are f^_{m+j} @ E_out^T, the target's own LM head restricted to the
sub-vocabulary: the next token's distribution. Known tokens after x_m (a feature a round late,
in lookahead drafting) are teacher-forced steps whose logits go unused; the last known token's
step gives d_1, and each draft d_i is fed back as the next step's token.

One step: fc(concat(norm(emb(x)), norm(g))) -> one Llama decoder layer (the target's hidden
size, heads and GQA, RoPE) -> an output RMSNorm started from the target's final norm, so the
prediction lives where the target's features do. Attention covers the current chain only (RoPE
positions from 0 at every chain start), through an explicit KV cache of that chain, so the
same ``forward`` trains unrolled chains and runs one step at a time on the edge. The input
embedding and the output head are the target's rows, frozen; the input's <unk> slot (tokens
outside the sub-vocabulary) is the mean embedding, and the output covers only real sub-vocab
ids (``VocabMap``: output index i is full id ``sub_to_full[sub_to_full >= 0][i]``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edge_client.tools.distill.vocab import VOCAB_MAP_FILE, VocabMap

FEATURE_LAYER = "final_norm"


@dataclass(frozen=True)
class HeadArch:
    sub_vocab: int = 8192  # draft ids incl. the <unk> input slot; the main size/speed lever
    intermediate: int = 1536  # the decoder layer's MLP width
    max_chain: int = 32  # the most chain positions the runtime accepts (RoPE is trained below)
    # Context heads only (``head_layers``): decoder layers whose outputs are fused with f_j at
    # the real positions, EAGLE-3's low/middle/high features. (): f_j alone.
    feature_layers: tuple[int, ...] = ()


def head_arch_from_json(obj: dict) -> HeadArch:
    obj = dict(obj)
    obj["feature_layers"] = tuple(obj.get("feature_layers") or ())
    return HeadArch(**obj)


@dataclass(frozen=True)
class TargetShape:
    """What the head takes from the target's config."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    num_layers: int
    vocab: int
    rope_theta: float
    eps: float

    @classmethod
    def from_dir(cls, target_dir: Path) -> TargetShape:
        c = json.loads((Path(target_dir) / "config.json").read_text())
        heads = int(c["num_attention_heads"])
        return cls(int(c["hidden_size"]), heads, int(c.get("num_key_value_heads") or heads),
                   int(c.get("head_dim") or c["hidden_size"] // heads),
                   int(c["num_hidden_layers"]), int(c["vocab_size"]),
                   float(c.get("rope_theta", 10000.0)), float(c.get("rms_norm_eps", 1e-5)))


def target_tensors(target_dir: Path, names=None) -> dict[str, np.ndarray]:
    """float32 numpy tensors of the target's safetensors checkpoint (single file or sharded)."""
    from safetensors import safe_open

    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.is_file() else ["model.safetensors"])
    out: dict[str, np.ndarray] = {}
    for name in files:
        with safe_open(str(target_dir / name), framework="pt") as f:
            for key in f.keys():
                if names is None or key in names:
                    out[key] = f.get_tensor(key).float().numpy()
    return out


def target_fingerprint(target_dir: Path) -> str:
    from shared.fingerprint import fingerprint_tensor_names, weights_fingerprint

    layers = TargetShape.from_dir(target_dir).num_layers
    names = set(fingerprint_tensor_names(layers))
    return weights_fingerprint(target_tensors(target_dir, names), layers)


def wire_round_trip(f, codec: str):
    """The wire's round trip of features ``f`` [..., H] (a torch tensor of data, no gradient
    through it) by ``shared.feature_codec``'s own numpy code, so that the head trains on
    exactly what the verifier will send it."""
    import torch

    from shared.feature_codec import codec_named

    back = codec_named(codec).round_trip(f.detach().float().cpu().numpy())
    return torch.from_numpy(back).to(f.device)


def legacy_codec(hidden: int) -> str:
    """The codec of runs made before it was recorded: one absmax scale per vector."""
    return f"int8-g{hidden}"


def _modules():
    """The torch classes, defined on first use (this package imports no torch at top level)."""
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            x32 = x.float()
            return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    class FeatureHead(nn.Module):
        def __init__(self, shape: TargetShape, arch: HeadArch, n_in: int, n_out: int) -> None:
            super().__init__()
            h, hd = shape.hidden, shape.head_dim
            self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, hd
            self.feature_layers = tuple(arch.feature_layers)
            self.embed = nn.Embedding(n_in, h)  # frozen target rows (+ <unk>)
            self.lm_head = nn.Linear(h, n_out, bias=False)  # frozen target rows
            self.embed.weight.requires_grad_(False)
            self.lm_head.weight.requires_grad_(False)
            self.norm_token = RMSNorm(h, shape.eps)
            self.norm_feature = RMSNorm(h, shape.eps)
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.attn_norm = RMSNorm(h, shape.eps)
            self.q_proj = nn.Linear(h, shape.heads * hd, bias=False)
            self.k_proj = nn.Linear(h, shape.kv_heads * hd, bias=False)
            self.v_proj = nn.Linear(h, shape.kv_heads * hd, bias=False)
            self.o_proj = nn.Linear(shape.heads * hd, h, bias=False)
            self.mlp_norm = RMSNorm(h, shape.eps)
            self.gate_proj = nn.Linear(h, arch.intermediate, bias=False)
            self.up_proj = nn.Linear(h, arch.intermediate, bias=False)
            self.down_proj = nn.Linear(arch.intermediate, h, bias=False)
            self.out_norm = RMSNorm(h, shape.eps)
            if arch.feature_layers:  # f_j and each layer's state, each normed, mapped to H
                n = len(arch.feature_layers)
                self.layer_norms = nn.ModuleList(RMSNorm(h, shape.eps) for _ in range(n))
                self.fuse = nn.Linear((n + 1) * h, h, bias=False)
            inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
            self.register_buffer("inv_freq", inv_freq, persistent=False)

        def _rope(self, x, positions):
            """x [B, heads, n, hd], positions [n] -> x rotated (Llama's rotate-half form)."""
            freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [n, hd/2]
            emb = torch.cat([freqs, freqs], dim=-1)
            cos, sin = emb.cos(), emb.sin()
            half = x.shape[-1] // 2
            rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
            return x * cos + rotated * sin

        def real_features(self, features, layer_states=None):
            """The step input g at a real position: f_j itself, or with ``feature_layers``
            the fusion of f_j [.., H] and ``layer_states`` [.., L, H]."""
            if not hasattr(self, "fuse"):
                return features
            if layer_states is None:
                raise ValueError("this head fuses target layers "
                                 f"{self.feature_layers}: give their states")
            parts = [features] + [norm(layer_states[..., i, :])
                                  for i, norm in enumerate(self.layer_norms)]
            return self.fuse(torch.cat(parts, -1))

        def forward(self, input_ids, features, past_key, past_value):
            """input_ids [B, n] draft ids; features [B, n, H] the step inputs g; past_key,
            past_value [B, kv_heads, P, hd] this chain's cache (P = 0 at a chain start) ->
            logits [B, n, M], next_features [B, n, H] (f^), present_key/value [B, kv, P+n, hd].
            """
            b, n = input_ids.shape
            past = past_key.shape[2]
            x = self.fc(torch.cat([self.norm_token(self.embed(input_ids)),
                                   self.norm_feature(features)], dim=-1))  # [B, n, H]
            positions = torch.arange(n, device=x.device) + past  # [n]
            a = self.attn_norm(x)
            q = self.q_proj(a).view(b, n, self.heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(a).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(a).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._rope(q, positions), self._rope(k, positions)
            present_key = torch.cat([past_key, k], dim=2)  # [B, kv, P+n, hd]
            present_value = torch.cat([past_value, v], dim=2)
            group = self.heads // self.kv_heads
            keys = present_key.repeat_interleave(group, dim=1)  # [B, heads, P+n, hd]
            values = present_value.repeat_interleave(group, dim=1)
            scores = q @ keys.transpose(-1, -2) / math.sqrt(self.head_dim)  # [B, h, n, P+n]
            allowed = torch.arange(past + n, device=x.device)[None, :] <= positions[:, None]
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            attn = torch.softmax(scores, dim=-1) @ values  # [B, heads, n, hd]
            x = x + self.o_proj(attn.transpose(1, 2).reshape(b, n, -1))
            m = self.mlp_norm(x)
            x = x + self.down_proj(torch.nn.functional.silu(self.gate_proj(m)) * self.up_proj(m))
            next_features = self.out_norm(x)
            return self.lm_head(next_features), next_features, present_key, present_value

        def empty_cache(self, batch: int):
            shape = (batch, self.kv_heads, 0, self.head_dim)
            return torch.zeros(shape), torch.zeros(shape)

    return FeatureHead


def build_head(arch: HeadArch, target_dir: Path, vmap: VocabMap, seed: int):
    """A fresh head over ``vmap``: frozen target embedding/LM-head rows, output norm from the
    target's final norm, everything else a small random init."""
    import torch

    shape = TargetShape.from_dir(target_dir)
    real = vmap.sub_to_full >= 0
    torch.manual_seed(seed)
    head = _modules()(shape, arch, vmap.size, int(real.sum()))
    for p in head.parameters():
        if p.ndim == 2 and p.requires_grad:
            torch.nn.init.normal_(p, std=0.02)
    names = {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"}
    w = target_tensors(target_dir, names)
    emb = w["model.embed_tokens.weight"]  # [V, H]
    out = w.get("lm_head.weight", emb)  # tied embeddings (SmolLM2) have no lm_head tensor
    rows = np.zeros((vmap.size, shape.hidden), dtype=np.float32)
    rows[real] = emb[vmap.sub_to_full[real]]
    rows[~real] = emb.mean(0)
    with torch.no_grad():
        head.embed.weight.copy_(torch.from_numpy(rows))
        head.lm_head.weight.copy_(torch.from_numpy(out[vmap.sub_to_full[real]]))
        head.out_norm.weight.copy_(torch.from_numpy(w["model.norm.weight"]))
        if arch.feature_layers:  # starts as f_j alone; the layers' blocks learn from zero
            head.fuse.weight.zero_()
            head.fuse.weight[:, :shape.hidden].copy_(torch.eye(shape.hidden))
    return head


def head_to_full(vmap: VocabMap) -> np.ndarray:
    """[M] the full id of each head output index."""
    return vmap.sub_to_full[vmap.sub_to_full >= 0]


def save_run_meta(run: Path, arch: HeadArch, target_dir: Path, seed: int, extra: dict) -> None:
    from edge_client.tools.distill.common import write_json

    write_json(run / "run.json", {"kind": "feature-head", "arch": asdict(arch),
                                  "target": str(target_dir), "seed": seed, **extra})


def load_head_run(run: Path, target: Path | None = None):
    """(head in eval mode, VocabMap, run.json, checkpoint) of a train-head run."""
    import torch

    saved = json.loads((run / "run.json").read_text())
    if saved.get("kind") != "feature-head":
        raise ValueError(f"{run} is not a train-head run (run.json kind {saved.get('kind')!r})")
    vmap = VocabMap.load(run / VOCAB_MAP_FILE)
    target_dir = Path(target) if target else Path(saved["target"])
    head = build_head(head_arch_from_json(saved["arch"]), target_dir, vmap, 0)
    ck = torch.load(run / "ckpt.pt", map_location="cpu", weights_only=False)
    head.load_state_dict(ck["model"])
    return head.eval(), vmap, saved, ck
