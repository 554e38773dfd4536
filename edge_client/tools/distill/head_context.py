"""Context heads: the feature head attending over the target's features of the whole text
(EAGLE's form, arXiv 2401.15077), trained by ``train-head --context``.

The chain head (``head_train``) sees one target feature per round and attends only over its
own chain. A context head keeps a KV cache over *every* committed position it has the target's
feature for, so what it knows about the text is not squeezed into one vector. Same weights and
graph as the chain head (``head_model``); only the cache's lifetime and the training differ.

Notation (``head_model``): f_j is the target's final-norm state at position j (it decided
t_{j+1}). Pair j is (f_j, t_{j+1}); the head maps it to f^_{j+1} and the logits of t_{j+2}.
A sequence of T tokens (prompt + continuation) has real pairs j = 0 .. T-3 whose target
f_{j+1} is known.

On the device, a round after committed t_0 .. t_c has real pairs 0 .. c-1 in the cache; the
last one's output gives d_1; draft step s (s >= 2) appends (f^, d_{s-1}) at position c-2+s
and attends over the real pairs and the chain's earlier steps. Training reproduces exactly
that with ``passes`` unrolled passes over whole sequences (training-time test, as EAGLE-3
does): pass 1 reads the real features; pass s at position j reads pass s-1's prediction made
at j-1 and attends over real pairs <= j-s+1 and, for r = 2..s, pass r's entry at j-(s-r),
which is the cache the device holds at draft step s (``unrolled_passes``; tested against
step-by-step cached decoding). Tokens are the target's own (teacher forcing), which gives
greedy rounds' counts exactly: a round stops at its first mismatch.

Loss per pass, over the positions that pass exists at: KL(p || q) + tv_weight * TV(p, q) with
p the target's distribution restricted to the head's output ids (softmax of its LM head, which
the head shares frozen, on the true f_{j+1}) + feature_weight * smooth-L1(f^, f_{j+1}).

Data: ``gen-data --features`` shards with ``Sample.prompt_features`` (gen-data writes them;
``edgespec-distill prompt-features`` backfills older shards with one teacher-forced forward
over the prompts).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from edge_client.tools.distill.head_eval import score_predictions
from edge_client.tools.distill.shards import Sample, list_shards, read_shard, write_shard

log = logging.getLogger("edgespec.distill")

# Prompt feature rows must match the features gen-data recorded at the prompt's last token
# to within fp16 rounding of values up to ~20 (measured: at most 0.016 on SmolLM2).
ALIGNMENT_TOLERANCE = 0.06


@dataclass(frozen=True)
class ContextSequence:
    tokens: np.ndarray  # [T] full ids: prompt then continuation
    features: np.ndarray  # [T-1, H] f_0 .. f_{T-2}
    prompt_len: int
    sampled: bool
    # [T-1, L, H]: the target's layers' states at the same positions, for a head that fuses
    # them (``head_layers``); None for one that reads f_j alone.
    layer_features: np.ndarray | None = None


def sequence_features(s: Sample) -> np.ndarray:
    """[T-1, H] f_0 .. f_{T-2} of a sample: its prompt rows but the last (which is
    ``features[0]``), then the continuation's."""
    return np.concatenate([s.prompt_features[:-1], s.features])


def context_sequences(samples: Sequence[Sample],
                      layer_features: Sequence[np.ndarray] | None = None
                      ) -> list[ContextSequence]:
    """The samples as whole sequences (with ``head_layers.load_layer_features``' rows, one
    array per sample, when given); ValueError when a shard lacks prompt features."""
    out = []
    if layer_features is not None and len(layer_features) != len(samples):
        raise ValueError(f"{len(layer_features)} layer-feature rows for {len(samples)} samples")
    for n, s in enumerate(samples):
        if s.features is None or s.prompt_features is None:
            raise ValueError("context training needs gen-data --features shards with prompt "
                             "features; backfill older ones with edgespec-distill "
                             "prompt-features --data DIR")
        tokens = np.concatenate([s.prompt_ids, s.gen_ids]).astype(np.int64)
        feats = sequence_features(s)
        layers = None if layer_features is None else layer_features[n]
        if layers is not None and len(layers) != len(feats):
            raise ValueError(f"sample {n}: {len(layers)} layer-feature rows for {len(feats)} "
                             "positions (layer features of other data?)")
        if len(tokens) >= 3:
            out.append(ContextSequence(tokens, feats, len(s.prompt_ids), s.sampled, layers))
    return out


def backfill_prompt_features(data_dir: Path, target_dir: Path, batch_size: int = 8,
                             threads: int = 0) -> dict:
    """Adds ``prompt_features`` to every shard of ``data_dir`` that lacks them: one
    teacher-forced target forward over its prompts (right padded), each shard rewritten
    atomically, so an interrupted run resumes where it stopped. Checks that the last prompt
    row equals the feature gen-data recorded there. Returns counts and wall time."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    shards = [p for p in list_shards(data_dir) if _needs_backfill(p)]
    t0, tokens, worst = time.perf_counter(), 0, 0.0
    if not shards:
        return {"shards": 0, "tokens": 0, "wall_s": 0.0, "max_alignment_error": 0.0}
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    for path in tqdm(shards, desc=f"prompt features {data_dir.name}", unit="shard"):
        samples = read_shard(path)
        if any(s.features is None for s in samples):
            raise ValueError(f"{path}: no features (not gen-data --features data)")
        rows: list[np.ndarray | None] = [None] * len(samples)
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids))
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            width = max(len(samples[i].prompt_ids) for i in idx)
            ids = torch.zeros((len(idx), width), dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                p = torch.from_numpy(samples[i].prompt_ids.astype(np.int64))
                ids[r, :len(p)], mask[r, :len(p)] = p, 1
            with torch.inference_mode():
                states = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            for r, i in enumerate(idx):
                n = len(samples[i].prompt_ids)
                rows[i] = states[r, :n].to(torch.float16).numpy()
                err = float(np.abs(rows[i][-1].astype(np.float32)
                                   - samples[i].features[0].astype(np.float32)).max())
                worst = max(worst, err)
                if err > ALIGNMENT_TOLERANCE:
                    raise ValueError(f"{path}: prompt {i}'s last feature differs from the "
                                     f"recorded one by {err:.3f}: another target?")
                tokens += n
        with np.load(path) as z:
            index = z["prompt_index"]
        write_shard(path, [replace(s, prompt_features=f) for s, f in zip(samples, rows,
                                                                          strict=True)], index)
    wall = time.perf_counter() - t0
    log.info("prompt features: %d shards, %d tokens, %.1f s (%.0f tokens/s), alignment "
             "error at most %.4f", len(shards), tokens, wall, tokens / max(wall, 1e-9), worst)
    return {"shards": len(shards), "tokens": tokens, "wall_s": round(wall, 1),
            "max_alignment_error": round(worst, 4)}


def _needs_backfill(path: Path) -> bool:
    with np.load(path) as z:
        return "prompt_features" not in z.files


@dataclass
class ContextBatch:
    ids: object  # [B, L] draft ids of t_{j+1}
    features: object  # [B, L, H] f_j
    targets: object  # [B, L, H] f_{j+1}
    valid: object  # [B, L] bool
    layers: object = None  # [B, L, nL, H] the fused layers' states at j, or None


def make_context_batch(seqs: Sequence[ContextSequence], full_to_sub: np.ndarray,
                       max_len: int) -> ContextBatch:
    """Pairs j = 0 .. min(T-3, max_len-1) of each sequence, right padded."""
    import torch

    lengths = [min(len(s.tokens) - 2, max_len) for s in seqs]
    b, width, hidden = len(seqs), max(lengths), seqs[0].features.shape[1]
    ids = np.zeros((b, width), np.int64)
    f = np.zeros((b, width, hidden), np.float32)
    tgt = np.zeros((b, width, hidden), np.float32)
    valid = np.zeros((b, width), bool)
    fused = seqs[0].layer_features is not None
    layers = (np.zeros((b, width) + seqs[0].layer_features.shape[1:], np.float32) if fused
              else None)
    for r, (s, n) in enumerate(zip(seqs, lengths, strict=True)):
        ids[r, :n] = full_to_sub[s.tokens[1:n + 1]]
        f[r, :n] = s.features[:n]
        tgt[r, :n] = s.features[1:n + 1]
        valid[r, :n] = True
        if fused:
            layers[r, :n] = s.layer_features[:n]
    return ContextBatch(*(torch.from_numpy(x) for x in (ids, f, tgt, valid)),
                        torch.from_numpy(layers) if fused else None)


def unrolled_passes(head, ids, features, passes: int,
                    layers=None) -> list[tuple[object, object]]:
    """[(logits [B, L, M], predicted features [B, L, H])] for passes 1..``passes`` (module
    docstring): pass s at position j is draft step s of the round whose last real pair is
    j-s+1. ``layers``: the fused layers' states of a head with ``feature_layers``."""
    import torch

    b, n = ids.shape
    positions = torch.arange(n)
    group = head.heads // head.kv_heads
    scale = 1.0 / math.sqrt(head.head_dim)
    keys, values, outs = [], [], []
    g = head.real_features(features, layers)
    rows = torch.arange(n)[:, None]
    for s in range(1, passes + 1):
        x = head.fc(torch.cat([head.norm_token(head.embed(ids)), head.norm_feature(g)], -1))
        a = head.attn_norm(x)
        q = head.q_proj(a).view(b, n, head.heads, head.head_dim).transpose(1, 2)
        k = head.k_proj(a).view(b, n, head.kv_heads, head.head_dim).transpose(1, 2)
        v = head.v_proj(a).view(b, n, head.kv_heads, head.head_dim).transpose(1, 2)
        q, k = head._rope(q, positions), head._rope(k, positions)
        keys.append(k.repeat_interleave(group, 1))
        values.append(v.repeat_interleave(group, 1))
        real = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, n, n]
        real = real.masked_fill(torch.arange(n)[None, :] > rows - (s - 1),
                                torch.finfo(real.dtype).min)
        chain_k = [_shifted(keys[r], s - 1 - r) for r in range(1, s)]
        chain_v = [_shifted(values[r], s - 1 - r) for r in range(1, s)]
        scores = torch.cat([real] + [(q * kr).sum(-1, keepdim=True) * scale for kr in chain_k],
                           -1)
        w = torch.softmax(scores, -1)
        attn = w[..., :n] @ values[0]
        for i, vr in enumerate(chain_v):
            attn = attn + w[..., n + i:n + i + 1] * vr
        x = x + head.o_proj(attn.transpose(1, 2).reshape(b, n, -1))
        m = head.mlp_norm(x)
        x = x + head.down_proj(torch.nn.functional.silu(head.gate_proj(m)) * head.up_proj(m))
        pred = head.out_norm(x)
        outs.append((head.lm_head(pred), pred))
        g = torch.cat([torch.zeros_like(pred[:, :1]), pred[:, :-1]], 1)  # read at j: made at j-1
    return outs


def _shifted(t, d: int):
    """t[:, :, j - d] at row j (zeros for j < d): pass r's entry at j - d."""
    import torch

    return t if d == 0 else torch.cat([torch.zeros_like(t[:, :, :d]), t[:, :, :-d]], 2)


def context_loss(head, batch: ContextBatch, passes: int, tv_weight: float,
                 feature_weight: float):
    """-> (loss, {"kl", "tv", "feature"} means over passes), each pass averaged over its
    valid positions (pass s exists from position s-1 on)."""
    import torch

    valid = batch.valid
    with torch.no_grad():
        p = torch.softmax(head.lm_head(batch.targets[valid]).float(), -1)
        logp = torch.log(p.clamp_min(1e-12))
    loss, parts = 0.0, {"kl": 0.0, "tv": 0.0, "feature": 0.0}
    for s, (logits, pred) in enumerate(unrolled_passes(head, batch.ids, batch.features,
                                                       passes, batch.layers), 1):
        exists = valid.clone()
        exists[:, :s - 1] = False
        keep = exists[valid]
        if not bool(keep.any()):
            continue
        lq = torch.log_softmax(logits[valid].float(), -1)[keep]
        kl = (p[keep] * (logp[keep] - lq)).sum(-1).mean()
        tv = 0.5 * (p[keep] - lq.exp()).abs().sum(-1).mean()
        feature = torch.nn.functional.smooth_l1_loss(pred[valid][keep],
                                                     batch.targets[valid][keep])
        loss = loss + kl + tv_weight * tv + feature_weight * feature
        for key, val in (("kl", kl), ("tv", tv), ("feature", feature)):
            parts[key] += float(val.detach()) / passes
    return loss, parts


def evaluate_context(head, vmap, seqs: Sequence[ContextSequence], k: int = 4) -> dict:
    """Teacher-forced greedy alpha on greedy sequences (``head_eval``'s definitions): the
    round after continuation token a has real pairs up to the one that reads it."""

    full_to_sub = vmap.full_to_sub()
    out_full = vmap.sub_to_full[vmap.sub_to_full >= 0]
    rows = [s for s in seqs if not s.sampled and len(s.tokens) - s.prompt_len > 1]
    return score_predictions(((context_drafts(head, full_to_sub, out_full, s, k),
                               s.tokens[s.prompt_len:]) for s in rows), k, len(rows))


def context_drafts(head, full_to_sub: np.ndarray, out_full: np.ndarray, s: ContextSequence,
                   k: int, first_logits: list | None = None) -> np.ndarray:
    """[G-1, k] full ids: after continuation token a (committed t_0 .. t_c, c = P + a, real
    pairs 0 .. c-1), the head's greedy drafts 1..k, teacher-forced; -1 past the end. With
    ``first_logits`` (a list), appends draft 1's logits over the output ids per start."""
    import torch

    with torch.inference_mode():
        batch = make_context_batch([s], full_to_sub, len(s.tokens))
        outs = unrolled_passes(head, batch.ids, batch.features, k, batch.layers)
    argmax = [out_full[lg[0].argmax(-1).numpy()] for lg, _ in outs]
    gen_len = len(s.tokens) - s.prompt_len
    pred = np.full((gen_len - 1, k), -1, np.int64)
    for a in range(gen_len - 1):
        for step in range(k):
            j = s.prompt_len + a - 1 + step
            if a + 1 + step <= gen_len - 1 and j < len(argmax[step]):
                pred[a, step] = argmax[step][j]
        if first_logits is not None:
            first_logits.append(outs[0][0][0, s.prompt_len + a - 1].numpy())
    return pred
