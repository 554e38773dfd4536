"""Held-out acceptance of a feature head: teacher-forced greedy alpha on greedy rows.

Replayed along the target's greedy path (``Sample.gen_ids`` of a greedy row), as a Verify
round would run: the round starts after committed token g_a with the feature that decided it
(``Sample.features[a]``, through the wire's round trip), the head drafts up to K tokens,
the target accepts the matching prefix and adds one token, and the next round starts after
that token with its own feature. alpha = accepted / judged, a round judging its drafts up to
and including the first rejection (``edge_client.bench.acceptance``'s definition);
tokens_per_round = committed tokens / rounds; step_accuracy[i] = how often chain step i+1
from every start matches the target (teacher-forced, not only where rounds start).

Because a greedy round stops at its first mismatch, drafting from teacher-forced tokens
(the target's, fed at every step) gives the same counts as feeding the head its own drafts,
so the torch path computes every start's chain in one batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edge_client.tools.distill.shards import Sample

EVAL_DRAFT_LEN = 4

# (start a, n) -> the head's n greedy drafts (full ids) after g_a, from features[a]
DraftsAt = Callable[[int, int], Sequence[int]]


def replay_rounds(drafts_at: DraftsAt, gen_ids: np.ndarray, k: int,
                  committed: int = 1) -> dict:
    """Counts of greedy Verify rounds along ``gen_ids`` once its first ``committed`` tokens
    are (by default after gen_ids[0]; 0: from the prompt, start a = -1). ``drafts_at`` may
    return fewer than n drafts (a proposal that stopped at its first mismatch)."""
    a, last = committed - 1, len(gen_ids) - 1
    accepted = judged = rounds = tokens = 0
    while a < last:
        n = min(k, last - a)
        drafts = list(drafts_at(a, n))[:n]
        good = 0
        while good < len(drafts) and drafts[good] == int(gen_ids[a + 1 + good]):
            good += 1
        accepted += good
        judged += good + 1 if good < n else n
        step = min(good + 1, last - a)
        tokens += step
        rounds += 1
        a += step
    return {"accepted": accepted, "judged": judged, "rounds": rounds, "tokens": tokens}


def summarize(counts: Sequence[dict], step_hits: np.ndarray, step_total: np.ndarray,
              samples: int) -> dict:
    tot = {key: sum(c[key] for c in counts) for key in ("accepted", "judged", "rounds", "tokens")}
    return {
        "samples": samples,
        "rounds": tot["rounds"],
        "greedy_alpha": round(tot["accepted"] / tot["judged"], 4) if tot["judged"] else None,
        "tokens_per_round": round(tot["tokens"] / tot["rounds"], 3) if tot["rounds"] else None,
        "step_accuracy": [round(float(h / t), 4) if t else None
                          for h, t in zip(step_hits, step_total, strict=True)],
    }


def greedy_rows(samples: Sequence[Sample]) -> list[Sample]:
    """The held-out rows the metric is defined on: greedy, with features, two tokens or more."""
    return [s for s in samples if not s.sampled and s.features is not None and len(s.gen_ids) > 1]


def evaluate_torch(head, vmap, samples: Sequence[Sample], codec: str,
                   k: int = EVAL_DRAFT_LEN) -> dict:
    """The metric for a torch head (training's held-out evaluation), fed features through
    the wire's round trip by ``codec``."""
    rows = greedy_rows(samples)
    full_to_sub = vmap.full_to_sub()
    out_full = vmap.sub_to_full[vmap.sub_to_full >= 0]
    return score_predictions(
        ((chain_argmax(head, s, full_to_sub, out_full, k, codec), s.gen_ids.astype(np.int64))
         for s in rows), k, len(rows))


def score_predictions(predictions, k: int, samples: int) -> dict:
    """``summarize`` over (pred [G-1, k] full ids: the teacher-forced drafts 1..k after each
    continuation token a, -1 past the end; gen [G]) pairs, one per greedy row."""
    counts, hits, total = [], np.zeros(k), np.zeros(k)
    for pred, gen in predictions:
        for i in range(k):
            starts = np.arange(max(0, len(gen) - 1 - i))
            hits[i] += int((pred[starts, i] == gen[starts + 1 + i]).sum())
            total[i] += starts.size
        counts.append(replay_rounds(lambda a, n, p=pred: p[a, :n], gen, k))
    return summarize(counts, hits, total, samples)


def chain_argmax(head, s: Sample, full_to_sub: np.ndarray, out_full: np.ndarray,
                 k: int, codec: str) -> np.ndarray:
    """[G-1, k]: from every start a (after g_a, with features[a]), the head's argmax at chain
    steps 1..k, teacher-forced with g_{a}, g_{a+1}, ...; steps past the end are -1."""
    import torch

    from edge_client.tools.distill.head_model import wire_round_trip

    gen = s.gen_ids.astype(np.int64)
    starts = np.arange(len(gen) - 1)
    cols = np.minimum(starts[:, None] + np.arange(k)[None, :], len(gen) - 1)  # [S, k]
    ids = torch.from_numpy(full_to_sub[gen[cols]])
    feat = wire_round_trip(torch.from_numpy(s.features[starts].astype(np.float32)), codec)
    past_k, past_v = head.empty_cache(len(starts))
    pred = np.full((len(starts), k), -1, dtype=np.int64)
    with torch.inference_mode():
        for i in range(k):
            logits, nxt, past_k, past_v = head(ids[:, i : i + 1], feat[:, None], past_k, past_v)
            pred[:, i] = out_full[logits[:, 0].argmax(-1).numpy()]
            feat = nxt[:, 0]
    pred[starts[:, None] + 1 + np.arange(k)[None, :] > len(gen) - 1] = -1
    return pred


def evaluate_runtime(model_dir, samples: Sequence[Sample], k: int = EVAL_DRAFT_LEN,
                     threads: int = 1) -> dict:
    """The metric for an exported head, through the edge runtime's own ``propose``."""
    from edge_client.drafter import DraftSampling
    from edge_client.feature_draft import FeatureHead, read_spec

    head = FeatureHead(model_dir, read_spec(model_dir), intra_op_threads=threads)
    greedy, rng = DraftSampling(temperature=0.0), np.random.default_rng(0)
    rows = greedy_rows(samples)
    counts, hits, total = [], np.zeros(k), np.zeros(k)
    for s in rows:
        gen = s.gen_ids.astype(np.int64)

        def drafts_at(a: int, n: int, s=s, gen=gen) -> list[int]:
            feature = head.codec.encode(s.features[a].astype(np.float32))
            tokens = head.propose(feature, [int(gen[a])], n, greedy, rng).tokens
            for i, t in enumerate(tokens):
                hits[i] += t == gen[a + 1 + i]
                total[i] += 1
            return tokens

        counts.append(replay_rounds(drafts_at, gen, k))
    # Here step i is counted at round starts only, and only as far as the round drafted.
    return summarize(counts, hits, total, len(rows))
