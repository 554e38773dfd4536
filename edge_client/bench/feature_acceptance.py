"""The feature head beside the independent draft on the realistic evaluation, teacher-forced
along the target's greedy path, by category (issue 17, item 3).

    python -m edge_client.bench.feature_acceptance --head DIR --per-category 12 \
        --max-new-tokens 32 --draft-len 4 --json PATH

For each prompt the target decodes its greedy path once, keeping at every token the final
hidden state that decided it (``acceptance.target_greedy_path``). Both drafts then replay
greedy Verify rounds along that path, as the verifier would run them:

- the independent draft (``--draft-dir``, default the shipped one) drafts K tokens from the
  first round on (its proposals are read from its own logits along the path);
- the feature head has no feature before the target's first forward, so its first round
  sends no drafts (one forward, one token); every later round starts from the feature that
  decided the last committed token, through the wire codec (``shared.feature_codec``), with
  that token as the chain's tail, exactly what ``FeatureHead.propose`` gets on the device.

alpha = accepted / judged (a round judges its drafts up to and including the first
rejection); tokens per round and target forwards per token count every round, the head's
first one included. ``accept_t0.7`` is the expected acceptance of the first draft of a round
at temperature 0.7 (1 - TV between the target's and the draft's distributions), at every
position of the path, teacher-forced. Step times are medians on this machine: the draft's
ONNX step, the head's ONNX step, the target's one-token HF step (not the verifier's packed
forward, which is faster).

The realistic set's prompts that ``--per-category`` evenly picks are the ones
``edgespec-bench acceptance --prompts N`` reports; the head's training monitor uses other
prompts of the set (docs/feature-draft.md), never these.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from edge_client.bench.acceptance import draft_trace, target_greedy_path
from edge_client.bench.acceptance_sets import encode_eval, load_realistic

log = logging.getLogger("edgespec.bench.feature_acceptance")

TEMPERATURE = 0.7

# (committed path tokens t, n) -> n greedy drafts after prompt + path[:t]
DraftsAfter = Callable[[int, int], list[int]]


@dataclass
class Counts:
    accepted: int = 0
    judged: int = 0
    rounds: int = 0
    tokens: int = 0
    accept_sampled: list[float] = field(default_factory=list)

    def __iadd__(self, other: Counts) -> Counts:
        self.accepted += other.accepted
        self.judged += other.judged
        self.rounds += other.rounds
        self.tokens += other.tokens
        self.accept_sampled += other.accept_sampled
        return self

    def summary(self) -> dict:
        return {
            "greedy_alpha": _ratio(self.accepted, self.judged),
            "tokens_per_round": _ratio(self.tokens, self.rounds),
            "forwards_per_token": _ratio(self.rounds, self.tokens),
            f"accept_t{TEMPERATURE:g}": (round(statistics.fmean(self.accept_sampled), 4)
                                        if self.accept_sampled else None),
            "rounds": self.rounds, "tokens": self.tokens,
        }


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def _median_ms(seconds: list[float]) -> float | None:
    return round(1e3 * statistics.median(seconds), 3) if seconds else None


def replay(drafts_after: DraftsAfter, path: list[int], k: int, start: int = 0) -> Counts:
    """Greedy rounds along ``path`` once ``start`` of its tokens are committed (the rounds
    that committed them are the caller's to count): ``head_eval.replay_rounds``."""
    from edge_client.tools.distill.head_eval import replay_rounds

    counts = replay_rounds(lambda a, n: drafts_after(a + 1, n), np.asarray(path), k,
                           committed=start)
    return Counts(**counts)


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(logits, np.float64) / temperature
    z = np.exp(z - z[np.isfinite(z)].max())
    return z / z.sum()


def accept_at(target_logits: np.ndarray, draft_logits: np.ndarray, temperature: float) -> float:
    """1 - TV(p_T, q_T) of one position's full-vocabulary logits: the chance that a draft
    sampled from q is accepted against p."""
    return float(np.minimum(_softmax(target_logits, temperature),
                            _softmax(draft_logits, temperature)).sum())


def accept_sparse(target_logits: np.ndarray, q: tuple[np.ndarray, np.ndarray],
                  temperature: float) -> float:
    """The same with q given as (ids, probs), zero elsewhere."""
    ids, probs = q
    p = _softmax(target_logits, temperature)
    return float(np.minimum(p[np.asarray(ids)], np.asarray(probs, np.float64)).sum())


class HeadRunner:
    """The exported head, fed as on the device; records its step times."""

    def __init__(self, head_dir: Path, threads: int | None) -> None:
        from edge_client.feature_draft import FeatureHead, read_spec

        self.head = FeatureHead(head_dir, read_spec(head_dir), intra_op_threads=threads)
        self.step_s: list[float] = []

    def drafts(self, feature: np.ndarray, tail: list[int], n: int) -> list[int]:
        from edge_client.drafter import DraftSampling

        encoded = self.head.codec.encode(feature)
        before, t0 = self.head.steps_run, time.perf_counter()
        p = self.head.propose(encoded, tail, n, DraftSampling(), np.random.default_rng(0))
        if self.head.steps_run > before:
            self.step_s.append((time.perf_counter() - t0) / (self.head.steps_run - before))
        return p.tokens

    def first_q(self, feature: np.ndarray, token: int) -> tuple[np.ndarray, np.ndarray]:
        """The head's distribution at TEMPERATURE for the token after ``token``: (ids,
        probs), its whole support (zero outside its sub-vocabulary)."""
        from edge_client.drafter import DraftSampling

        p = self.head.propose(self.head.codec.encode(feature), [int(token)], 1,
                              DraftSampling(TEMPERATURE, 0, 1.0, 0), np.random.default_rng(0))
        return p.q[0]


def measure(target, draft, head: HeadRunner, ids: list[int], n_new: int, k: int,
            stop_ids: frozenset[int], ctx: ContextRunner | None = None
            ) -> tuple[Counts, Counts, list[float], list[float], Counts | None]:
    """(independent draft counts, head counts, draft step seconds, target step seconds,
    context head counts or None)."""
    feats: list[np.ndarray] = []
    path, target_logits, target_steps = target_greedy_path(target, ids, n_new, stop_ids, feats)
    draft_logits, draft_steps = draft_trace(draft, ids, path)
    argmax = draft_logits.argmax(-1)

    def model_drafts(t: int, n: int) -> list[int]:
        out = []
        while len(out) < n:  # teacher-forced: exact while the drafts match the path
            out.append(int(argmax[t + len(out)]))
            if out[-1] != path[t + len(out) - 1]:
                break
        return out

    ind = replay(model_drafts, path, k)
    tl = target_logits.numpy()
    ind.accept_sampled = [accept_at(tl[t], draft_logits[t], TEMPERATURE)
                          for t in range(len(path))]
    # The head: a first round without drafts commits path[0]; then each round after path[t-1]
    # reads the feature that decided it.
    feat = replay(lambda t, n: head.drafts(feats[t - 1], [path[t - 1]], n), path, k, start=1)
    feat.rounds += 1
    feat.tokens += 1
    feat.accept_sampled = [accept_sparse(tl[t], head.first_q(feats[t - 1], path[t - 1]),
                                         TEMPERATURE) for t in range(1, len(path))]
    extra = ctx.measure(target, ids, path, tl, k) if ctx is not None else None
    return ind, feat, draft_steps, target_steps, extra


class ContextRunner:
    """A context head (``train-head --context``) in torch: it has no edge runtime yet, and
    its graph is the chain head's, so its step time is the exported chain head's with a KV
    cache of the context (``--head``'s, measured by ``step_ms_with_past``)."""

    def __init__(self, run: Path) -> None:
        from edge_client.tools.distill.head_model import load_head_run

        self.head, vmap, saved, _ = load_head_run(run)
        if not saved.get("context"):
            raise SystemExit(f"{run} is not a train-head --context run")
        self.full_to_sub = vmap.full_to_sub()
        self.out_full = vmap.sub_to_full[vmap.sub_to_full >= 0]

    def measure(self, target, ids: list[int], path: list[int], tl: np.ndarray,
                k: int) -> Counts:
        """Like the chain head: a first round without drafts (the target has sent no feature
        yet), then every round reads the features of every committed position."""
        from edge_client.tools.distill.head_context import ContextSequence, context_drafts

        tokens = np.asarray(list(ids) + list(path), np.int64)
        layers = self.head.feature_layers
        with torch.inference_mode():  # the features of every position but the last
            out = target.model.model(
                input_ids=torch.from_numpy(tokens[None, :-1]).to(target.device),
                output_hidden_states=bool(layers))
        states = out.last_hidden_state[0].float().cpu().numpy()
        fused = (np.stack([out.hidden_states[i + 1][0].float().cpu().numpy() for i in layers],
                          1).astype(np.float16).astype(np.float32) if layers else None)
        seq = ContextSequence(tokens, states.astype(np.float16).astype(np.float32), len(ids),
                              False, fused)
        first: list[np.ndarray] = []
        pred = context_drafts(self.head, self.full_to_sub, self.out_full, seq, k, first)
        counts = replay(lambda t, n: [int(x) for x in pred[t - 1, :n] if x >= 0], path, k,
                        start=1)
        counts.rounds += 1
        counts.tokens += 1
        counts.accept_sampled = [
            accept_sparse(tl[t], (self.out_full, _softmax(first[t - 1], TEMPERATURE)),
                          TEMPERATURE) for t in range(1, len(path))]
        return counts


def step_ms_with_past(head_dir: Path, past: int, threads: int, repeats: int = 200) -> float:
    """Median ms of one step of an exported head's graph with ``past`` cached positions."""
    import onnxruntime as ort

    meta = json.loads((head_dir / "feature_head.json").read_text())
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(head_dir / "model.onnx"), sess_options=options,
                                   providers=["CPUExecutionProvider"])
    kv = np.zeros((1, int(meta["kv_heads"]), past, int(meta["head_dim"])), np.float32)
    feed = {"input_ids": np.zeros((1, 1), np.int64),
            "features": np.zeros((1, 1, int(meta["hidden_size"])), np.float32),
            "past_key": kv, "past_value": kv}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - t0)
    return _median_ms(times[repeats // 10:])


def main(argv: list[str] | None = None) -> int:
    from cloud_verifier.target_model import load_target
    from edge_client.draft_model import OnnxDraftModel
    from edge_client.tokenizer import EdgeTokenizer
    from shared.paths import default_draft_dir

    p = argparse.ArgumentParser(prog="feature_acceptance", description=__doc__.splitlines()[0])
    p.add_argument("--head", type=Path, required=True, help="an exported feature head dir")
    p.add_argument("--context-run", type=Path, default=None,
                   help="also a context head: a train-head --context run dir (torch)")
    p.add_argument("--context-past", type=int, default=128,
                   help="cached positions for the context head's step time")
    p.add_argument("--draft-dir", type=Path, default=None,
                   help="the independent ONNX draft (default: the shipped one)")
    p.add_argument("--target", default=None, help="target checkpoint (default: prepared)")
    p.add_argument("--per-category", type=int, default=12)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch and onnxruntime threads")
    p.add_argument("--json", type=Path, required=True, metavar="PATH")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.per_category < 1 or args.max_new_tokens < 2 or args.draft_len < 1:
        raise SystemExit("need --per-category >= 1, --max-new-tokens >= 2, --draft-len >= 1")
    torch.set_num_threads(args.threads)
    draft_dir = args.draft_dir or default_draft_dir()
    target = load_target(args.target)
    draft = OnnxDraftModel(draft_dir, intra_op_threads=args.threads)
    head = HeadRunner(args.head, args.threads)
    ctx = ContextRunner(args.context_run) if args.context_run else None
    evals, _ = load_realistic(args.per_category)
    prompts = encode_eval(EdgeTokenizer(draft_dir), evals,
                          target.max_context - args.max_new_tokens - 1)
    stop_ids = frozenset(target.eos_token_ids)
    by_cat: dict[str, tuple[Counts, Counts]] = {}
    by_cat_ctx: dict[str, Counts] = {}
    draft_steps: list[float] = []
    target_steps: list[float] = []
    t0 = time.perf_counter()
    for i, bp in enumerate(prompts):
        log.info("prompt %d/%d (%s)", i + 1, len(prompts), bp.category)
        ind, feat, ds, ts, extra = measure(target, draft, head, bp.ids, args.max_new_tokens,
                                           args.draft_len, stop_ids, ctx)
        if extra is not None:
            c = by_cat_ctx.setdefault(bp.category, Counts())
            c += extra
        a, b = by_cat.setdefault(bp.category, (Counts(), Counts()))
        a += ind
        b += feat
        draft_steps += ds
        target_steps += ts
    total_ind, total_feat = Counts(), Counts()
    for a, b in by_cat.values():
        total_ind += a
        total_feat += b
    head_files = sorted(args.head.glob("*.onnx"))
    total_ctx = Counts()
    for c in by_cat_ctx.values():
        total_ctx += c
    report = {
        "config": {"per_category": args.per_category, "prompts": len(prompts),
                   "max_new_tokens": args.max_new_tokens, "draft_len": args.draft_len,
                   "threads": args.threads, "draft_dir": str(draft_dir),
                   "head": str(args.head), "target": target.name},
        "by_category": {c: {"independent": a.summary(), "feature_head": b.summary()}
                        for c, (a, b) in by_cat.items()},
        "overall": {"independent": total_ind.summary(), "feature_head": total_feat.summary()},
        "step_ms": {"independent": _median_ms(draft_steps),
                    "feature_head": _median_ms(head.step_s),
                    "target_hf_one_token": _median_ms(target_steps)},
        "bytes_on_disk": {"independent": (Path(draft_dir) / "model.onnx").stat().st_size,
                          "feature_head": sum(f.stat().st_size for f in head_files)},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    if ctx is not None:
        for c, counts in by_cat_ctx.items():
            report["by_category"][c]["context_head"] = counts.summary()
        report["overall"]["context_head"] = total_ctx.summary()
        report["config"]["context_run"] = str(args.context_run)
        report["step_ms"]["context_head"] = step_ms_with_past(args.head, args.context_past,
                                                              args.threads)
        report["step_ms"]["feature_head_past0"] = step_ms_with_past(args.head, 0, args.threads)
        report["bytes_on_disk"]["context_head"] = report["bytes_on_disk"]["feature_head"]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    o = report["overall"]
    for name in [n for n in ("independent", "feature_head", "context_head") if n in o]:
        s = o[name]
        print(f"{name:14s} greedy alpha {s['greedy_alpha']}  tokens/round {s['tokens_per_round']}"
              f"  forwards/token {s['forwards_per_token']}  accept_t{TEMPERATURE:g} "
              f"{s[f'accept_t{TEMPERATURE:g}']}  step {report['step_ms'][name]} ms  "
              f"{report['bytes_on_disk'][name] / 1e6:.2f} MB")
    print(f"target one-token HF step {report['step_ms']['target_hf_one_token']} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
