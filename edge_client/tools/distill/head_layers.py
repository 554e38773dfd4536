"""The target's intermediate-layer states for context heads that fuse several layers (EAGLE-3,
arXiv 2503.01840), kept beside ``gen-data`` shards.

The final-norm state f_j is shaped for one job, deciding t_{j+1}; what a draft needs for the
tokens after it is partly gone by then. EAGLE-3 feeds the draft a low, a middle and a high
layer's output instead. Here a context head with ``HeadArch.feature_layers`` fuses f_j with
the outputs of those decoder layers (``head_model``: ``real_features``).

``layers-NNNNN.npz`` beside ``shard-NNNNN.npz`` (the shard's name pattern does not match it, so
the shard readers never see it): ``layers`` [L] decoder-layer indices (0-based; the output of
layer i is Hugging Face's ``hidden_states[i + 1]``), ``states`` [N, L, H] float16, one row per
position that has a feature in ``head_context.ContextSequence`` (T - 1 per sample, prompt then
continuation, shard order), ``offsets`` [S + 1]. ``edgespec-distill layer-features`` writes
them with one teacher-forced forward per batch, checking the same forward's final-norm rows
against the features the shard recorded; a shard whose file exists with the same layers is
skipped, so an interrupted run resumes.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edge_client.tools.distill.head_context import sequence_features
from edge_client.tools.distill.shards import list_shards, read_shard

log = logging.getLogger("edgespec.distill")


def layers_path(shard: Path) -> Path:
    return Path(shard).with_name(Path(shard).name.replace("shard-", "layers-", 1))


def parse_layers(text: str, num_layers: int | None = None) -> tuple[int, ...]:
    """"2,15,27" -> (2, 15, 27); ValueError on duplicates, negatives or (with
    ``num_layers``) an index past the last decoder layer."""
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"feature layers must be comma-separated integers, not {text!r}") \
            from None
    if not layers or len(set(layers)) != len(layers) or min(layers) < 0:
        raise ValueError(f"feature layers {text!r}: give distinct indices >= 0")
    if num_layers is not None and max(layers) >= num_layers:
        raise ValueError(f"feature layers {text!r}: the target has decoder layers 0.."
                         f"{num_layers - 1}")
    return layers


def backfill_layer_features(data_dir: Path, target_dir: Path, layers: Sequence[int],
                            batch_size: int = 8, threads: int = 0,
                            tolerance: float = 0.06) -> dict:
    """Writes ``layers-NNNNN.npz`` for every shard of ``data_dir`` that lacks one for
    ``layers`` (module docstring). Returns counts, wall time and the largest difference
    between this forward's final-norm rows and the shard's features."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    layers = tuple(int(x) for x in layers)
    todo = [p for p in list_shards(data_dir) if not _has_layers(p, layers)]
    t0, tokens, worst = time.perf_counter(), 0, 0.0
    if not todo:
        return {"shards": 0, "tokens": 0, "wall_s": 0.0, "max_alignment_error": 0.0}
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    if max(layers) >= model.config.num_hidden_layers:
        raise ValueError(f"layers {layers}: the target has {model.config.num_hidden_layers}")
    for path in tqdm(todo, desc=f"layer features {Path(data_dir).name}", unit="shard"):
        samples = read_shard(path)
        if any(s.features is None or s.prompt_features is None for s in samples):
            raise ValueError(f"{path}: needs features and prompt features (gen-data "
                             "--features; prompt-features backfills older shards)")
        rows: list[np.ndarray | None] = [None] * len(samples)
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].prompt_ids)
                       + len(samples[i].gen_ids))
        for b in range(0, len(order), batch_size):
            idx = order[b:b + batch_size]
            seqs = [np.concatenate([samples[i].prompt_ids, samples[i].gen_ids])[:-1]
                    for i in idx]
            width = max(len(s) for s in seqs)
            ids = torch.zeros((len(idx), width), dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, s in enumerate(seqs):  # right padded: causal rows ignore what follows
                ids[r, :len(s)], mask[r, :len(s)] = torch.from_numpy(s.astype(np.int64)), 1
            with torch.inference_mode():
                hs = model.model(input_ids=ids, attention_mask=mask,
                                 output_hidden_states=True).hidden_states
            picked = torch.stack([hs[i + 1] for i in layers], 2)  # [B, W, L, H]
            for r, (i, s) in enumerate(zip(idx, seqs, strict=True)):
                n = len(s)
                recorded = sequence_features(samples[i]).astype(np.float32)
                err = float(np.abs(hs[-1][r, :n].numpy() - recorded).max())
                worst = max(worst, err)
                if err > tolerance:
                    raise ValueError(f"{path}: sample {i}'s features differ from this forward's "
                                     f"by {err:.3f}: another target?")
                rows[i] = picked[r, :n].to(torch.float16).numpy()
                tokens += n
        _write(layers_path(path), layers, rows)
    wall = time.perf_counter() - t0
    log.info("layer features %s: %d shards, %d positions, %.1f s (%.0f/s), alignment error "
             "at most %.4f", layers, len(todo), tokens, wall, tokens / max(wall, 1e-9), worst)
    return {"shards": len(todo), "tokens": tokens, "wall_s": round(wall, 1),
            "max_alignment_error": round(worst, 4)}


def _write(path: Path, layers: tuple[int, ...], rows: Sequence[np.ndarray]) -> None:
    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
    np.savez(tmp, layers=np.asarray(layers, np.int32), offsets=offsets,
             states=np.concatenate(rows).astype(np.float16))
    os.replace(tmp, path)


def _has_layers(shard: Path, layers: tuple[int, ...]) -> bool:
    side = layers_path(shard)
    if not side.exists():
        return False
    with np.load(side) as z:
        return tuple(int(x) for x in z["layers"]) == layers


def load_layer_features(shards: Sequence[Path], layers: Sequence[int]) -> list[np.ndarray]:
    """Per sample, in ``shards.load_samples`` order: [T-1, L, H] float16. ValueError naming
    the command to run when a shard has no file for ``layers``."""
    layers = tuple(int(x) for x in layers)
    out: list[np.ndarray] = []
    for shard in shards:
        if not _has_layers(Path(shard), layers):
            raise ValueError(f"{shard}: no features of layers {','.join(map(str, layers))}; run "
                             f"edgespec-distill layer-features --layers "
                             f"{','.join(map(str, layers))} --data {Path(shard).parent}")
        with np.load(layers_path(Path(shard))) as z:
            states, off = z["states"], z["offsets"]
            out += [states[off[i]:off[i + 1]] for i in range(len(off) - 1)]
    return out
