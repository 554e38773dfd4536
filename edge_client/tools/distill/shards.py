"""What ``gen-data`` writes and ``train``, ``eval`` and ``export`` read: one
``shard-NNNNN.npz`` per group of prompts, with the target's top-k at every generated token
(or, in a corpus archive's shard, the tokens alone: ``read_shard`` labels them one-hot)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Sample:
    """One prompt and the target's continuation, with p's top-k at every generated token."""

    prompt_ids: np.ndarray  # [P] int
    gen_ids: np.ndarray  # [G] int, the generated tokens (EOS included when reached)
    topk_ids: np.ndarray  # [G, k] int: row j is p's top-k for gen token j
    topk_logp: np.ndarray  # [G, k] float16 log p, descending
    sampled: bool
    # [G, H] float16, or None: the target's last hidden state (after its final norm, what its
    # LM head reads) at the position that decided gen token j. Row 0 is at the prompt's last
    # token. What a hidden-state-conditioned draft is trained on (``gen-data --features``).
    features: np.ndarray | None = None
    # [P, H] float16, or None: the same hidden state at every prompt position (row i read
    # prompt_ids[:i + 1]; the last row equals features[0]). What a head that attends over the
    # whole context's features trains on (``head_context``; ``prompt-features`` backfills it).
    prompt_features: np.ndarray | None = None


def write_shard(path: Path, samples: Sequence[Sample], prompt_index: Sequence[int]) -> None:
    def flat(arrs):
        offsets = np.cumsum([0] + [len(a) for a in arrs]).astype(np.int64)
        return np.concatenate(arrs) if arrs else np.zeros(0), offsets

    prompt_flat, prompt_off = flat([s.prompt_ids.astype(np.int32) for s in samples])
    gen_flat, gen_off = flat([s.gen_ids.astype(np.int32) for s in samples])
    biggest = max(int(s.topk_ids.max(initial=0)) for s in samples)
    id_dtype = np.uint16 if biggest < 65536 else np.int32
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
    with_features = [s.features is not None for s in samples]
    if any(with_features) and not all(with_features):
        raise ValueError("a shard's samples must all have features or none")
    extra = ({"features": np.concatenate([s.features for s in samples]).astype(np.float16)}
             if samples and all(with_features) else {})
    with_prompt = [s.prompt_features is not None for s in samples]
    if any(with_prompt) and not all(with_prompt):
        raise ValueError("a shard's samples must all have prompt features or none")
    if samples and all(with_prompt):
        for s in samples:
            if len(s.prompt_features) != len(s.prompt_ids):
                raise ValueError("prompt_features needs one row per prompt token")
        extra["prompt_features"] = np.concatenate(
            [s.prompt_features for s in samples]).astype(np.float16)
    np.savez(
        tmp,
        **extra,
        prompt_ids=prompt_flat.astype(np.int32),
        prompt_offsets=prompt_off,
        gen_ids=gen_flat.astype(np.int32),
        gen_offsets=gen_off,
        topk_ids=np.concatenate([s.topk_ids for s in samples]).astype(id_dtype),
        topk_logp=np.concatenate([s.topk_logp for s in samples]).astype(np.float16),
        sampled=np.array([s.sampled for s in samples], dtype=bool),
        prompt_index=np.asarray(prompt_index, dtype=np.int32),
    )
    os.replace(tmp, path)


def read_shard(path: Path) -> list[Sample]:
    # Each array is read once (``z[name]`` decompresses the whole array on every access) and
    # each sample gets copies, not views: a view would keep its shard's whole array alive, one
    # copy per sample (13.6 GB of RSS for 847k tokens before this).
    with np.load(path) as z:
        a = {k: z[k] for k in z.files}
    if "topk_ids" not in a:
        # A corpus archive's shard (corpus_archive): ids only. Each token is its own label,
        # one-hot: the target's top-1 on a greedy row, its draw at the corpus's temperature on
        # a sampled one. So `train --data corpus_ids/chunk-NNNN` needs no labelling pass.
        for k in ("prompt_ids", "gen_ids"):
            a[k] = a[k].astype(np.int32)
        a["topk_ids"] = a["gen_ids"][:, None]
        a["topk_logp"] = np.zeros((len(a["gen_ids"]), 1), np.float16)
    po, go = a["prompt_offsets"], a["gen_offsets"]
    features, prompt_features = a.get("features"), a.get("prompt_features")
    out = []
    for i in range(len(po) - 1):
        g, p = slice(go[i], go[i + 1]), slice(po[i], po[i + 1])
        out.append(
            Sample(
                a["prompt_ids"][p].copy(),
                a["gen_ids"][g].copy(),
                a["topk_ids"][g].astype(np.int64),
                a["topk_logp"][g].copy(),
                bool(a["sampled"][i]),
                None if features is None else features[g].copy(),
                None if prompt_features is None else prompt_features[p].copy(),
            )
        )
    return out


def list_shards(data_dir: Path) -> list[Path]:
    return sorted(Path(data_dir).glob("shard-*.npz"))


def load_samples(shards: Sequence[Path]) -> list[Sample]:
    return [s for p in shards for s in read_shard(p)]


def heldout_samples(path: Path | None, limit: int) -> list[Sample]:
    if path is None or not list_shards(path):
        return []
    samples = load_samples(list_shards(path))
    return samples[:limit] if limit else samples
