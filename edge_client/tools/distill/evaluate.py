"""``eval``: held-out acceptance of a draft (a training run or an ONNX directory) against the
target's recorded distributions."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from edge_client.tools.distill.model import load_run
from edge_client.tools.distill.shards import Sample, heldout_samples
from edge_client.tools.distill.vocab import VocabMap

EVAL_TEMPERATURE = 0.7


LogitsFn = Callable[[np.ndarray], np.ndarray]  # full ids [T] -> full-vocab logits [T, V]


def torch_logits_fn(model, vmap: VocabMap) -> LogitsFn:
    import torch

    full_to_sub = vmap.full_to_sub()
    real = vmap.sub_to_full >= 0

    def fn(ids: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            sub = model(torch.from_numpy(full_to_sub[ids])[None]).logits[0].float().numpy()
        out = np.full((len(ids), vmap.full_vocab_size), -np.inf, dtype=np.float32)
        out[:, vmap.sub_to_full[real]] = sub[:, real]
        return out

    return fn


def onnx_logits_fn(model_dir: Path, threads: int = 1) -> LogitsFn:
    from edge_client.draft_model import OnnxDraftModel

    model = OnnxDraftModel(model_dir, intra_op_threads=threads)
    return lambda ids: model.forward(model.new_cache(), ids.tolist())


def evaluate(logits_fn: LogitsFn, samples: Sequence[Sample], draft_len: int = 4,
             temperature: float = EVAL_TEMPERATURE) -> dict:
    """Per-token acceptance of the draft given the target's prefix, on recorded samples.

    greedy_alpha: argmax q == the target's greedy token (lowest id on ties, both sides).
    tokens_per_round: greedy speculative decoding with K = ``draft_len`` replayed along the
      target's greedy path (exact for greedy samples: the output is that path).
    accept_t1 / accept_t: expected acceptance 1 - TV(p, q) at temperature 1 and ``temperature``,
      with p its recorded top-k renormalised (the mass beyond top-k is negligible).
    """
    matches, a1, at, rounds, emitted = [], [], [], 0, 0
    for s in samples:
        ids = np.concatenate([s.prompt_ids, s.gen_ids]).astype(np.int64)
        logits = logits_fn(ids[:-1])[len(s.prompt_ids) - 1 :]  # [G, V]: predicts gen token j
        top1 = s.topk_ids[:, 0]
        m = np.argmax(logits, axis=-1) == top1
        matches.append(m)
        a1.append(_expected_accept(logits, s.topk_ids, s.topk_logp, 1.0))
        at.append(_expected_accept(logits, s.topk_ids, s.topk_logp, temperature))
        if not s.sampled:
            r, e = _replay_greedy(m, draft_len)
            rounds += r
            emitted += e
    m = np.concatenate(matches) if matches else np.zeros(0)
    return {
        "samples": len(samples),
        "tokens": int(m.size),
        "greedy_alpha": round(float(m.mean()), 4) if m.size else None,
        "tokens_per_round": round(emitted / rounds, 3) if rounds else None,
        "accept_t1": round(float(np.concatenate(a1).mean()), 4) if a1 else None,
        f"accept_t{temperature:g}": round(float(np.concatenate(at).mean()), 4) if at else None,
    }


def _expected_accept(logits: np.ndarray, topk_ids: np.ndarray, topk_logp: np.ndarray,
                     temperature: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    z -= z.max(-1, keepdims=True)
    q = np.exp(z)
    q /= q.sum(-1, keepdims=True)  # [G, V]
    lp = topk_logp.astype(np.float64) / temperature
    p = np.exp(lp - lp.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # [G, k]
    q_k = np.take_along_axis(q, topk_ids, axis=1)
    overlap = np.minimum(p, q_k).sum(-1)  # 1 - TV when p is zero outside its top-k
    return overlap


def _replay_greedy(match: np.ndarray, k: int) -> tuple[int, int]:
    """Rounds and tokens of greedy speculation: accept the matching prefix, plus one token."""
    pos, rounds, n = 0, 0, len(match)
    while pos < n:
        a = 0
        while a < k and pos + a < n and match[pos + a]:
            a += 1
        pos += a + 1
        rounds += 1
    return rounds, n


def format_result(res: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in res.items())


def eval_command(what: Path, heldout: Path, target: Path | None, limit: int,
                 threads: int) -> dict:
    samples = heldout_samples(heldout, limit)
    if (Path(what) / "model.onnx").exists():
        return evaluate(onnx_logits_fn(Path(what), threads or 1), samples)
    import torch

    if threads:
        torch.set_num_threads(threads)
    model, vmap = load_run(Path(what), target)
    return evaluate(torch_logits_fn(model, vmap), samples)


def realistic_categories(data: Path | None, rows: int) -> list[str]:
    """The category of each of the first ``rows`` rows of a directory that
    ``python -m edge_client.bench.realistic_data`` wrote; empty for any other directory (or
    when it holds a different number of rows)."""
    path = Path(data) / "categories.json" if data is not None else None
    if path is None or not path.exists():
        return []
    categories = json.loads(path.read_text())["categories"][:rows]
    return categories if len(categories) == rows else []


def by_category(samples: list[Sample], categories: list[str], score, overall=None) -> dict:
    """``score(samples)`` over each category's rows and over all of them (``overall`` when
    the caller has it already: the evaluation is the costly part)."""
    out = {c: score([s for s, k in zip(samples, categories, strict=True) if k == c])
           for c in dict.fromkeys(categories)}
    out["all"] = score(samples) if overall is None else overall
    return out
