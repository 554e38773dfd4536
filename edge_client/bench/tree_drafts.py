"""Do token-tree drafts pay against chains here? (issue 17, item 4). An offline measurement.

    python -m edge_client.bench.tree_drafts --per-category 6 --max-new-tokens 48 \\
        --budgets 4 6 8 16 32 --repeats 15 --check-prompts 2 --sampled --json PATH

(the run in docs/benchmarks.md; the decision it supports is in docs/tree-drafts.md).

Two halves, both at equal verified rows (n draft nodes + the root = n + 1 rows, tree or chain):

- Tokens per round, greedy, on the realistic eval set rendered as ``edgespec-bench acceptance``
  renders it: the target's greedy path of each prompt and one trace of the shipped ONNX draft
  along it, then an exact replay of the rounds of every shape (``tree_shapes``: a tree round
  accepts the longest root path equal to the target's path). Shapes per budget: the chain,
  per-depth trees (top-2 first tokens each with its chain, ...), chains with second-best
  siblings as leaves, and the best tree for the draft's measured rank distribution. On the
  first ``--check-prompts`` prompts every tree is also drafted for real, the ONNX draft run on
  each branch, and its rounds must equal the replay's; chains must equal
  ``acceptance.replay_greedy_rounds``.
- Verify cost: one target forward of R rows on a ``--context``-token KV cache, median of
  ``--repeats``, interleaved so load drifts hit all kinds alike: a causal chain and a tree (a
  4-D additive mask of the tree's ancestry, positions by depth) through transformers, and the
  chain through the verifier's own ``packed_forward``, which is what serves today. A tree
  forward's logits must equal, node by node, a causal forward over the node's root path.

Tokens per second of verify time = tokens per round / ms per forward. ``--sampled`` adds the
T = 0.7 / top-p 0.95 estimate for per-depth shapes with SpecInfer's multi-draft verification
(children drawn i.i.d. from q, checked one by one against the residual max(p - q, 0)): per
path position the chance one of b drafts is accepted, averaged, compounded per depth under
independence, like E(K) for chains.

An offline tool: it imports torch. One torch thread and one onnxruntime thread by default.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from edge_client.bench import tree_shapes as ts
from edge_client.bench.acceptance import (
    MAX_SUPPORT,
    SAMPLED_TEMPERATURE,
    SAMPLED_TOP_P,
    PathDrafter,
    ReplayCount,
    draft_trace,
    replay_greedy_rounds,
    target_greedy_path,
)

log = logging.getLogger(__name__)

MAX_RANK = 8  # ranks at or past this are one bucket: no shape here branches that wide
MAX_BRANCH = 4  # the widest per-node draw the sampled estimate computes
MAX_CHAIN = 8  # chains of 1..8 drafts are all compared, besides one chain per budget
MAX_CHECKED_NODES = 16  # larger trees are not re-drafted for the check (slow, same code)


def shapes_for(budget: int, rank_probs: list[float]) -> list[ts.Shape]:
    """The shapes compared at ``budget`` draft nodes (all of exactly that many nodes)."""
    out = [ts.chain(budget)]
    for branches in ([2] + [1] * (budget // 2 - 1), [2, 2], [3] + [1] * (budget // 3 - 1),
                     [4] + [1] * (budget // 4 - 1), [2, 3]):
        shape = ts.per_depth(branches)
        if len(shape) == budget:
            out.append(shape)
    for s in (1, 2):
        if budget - s >= s:
            out.append(ts.chain_with_siblings(budget - s, s))
    out.append(ts.best_tree(budget, rank_probs))
    return list(dict.fromkeys(out))  # the best tree may be one of the others


# --------------------------------------------------------------------------------------------
# Rounds
# --------------------------------------------------------------------------------------------


def replay_tree_rounds(ranks: np.ndarray, shape: ts.Shape, max_new_tokens: int
                       ) -> tuple[ReplayCount, int]:
    """The greedy rounds of one path (its draft ranks ``ranks``, one per path token) with
    ``shape`` each round, and the draft forwards they take; the caps are
    ``replay_greedy_rounds``' (a round near the token limit drafts shallower)."""
    depth = max(len(n) for n in shape)
    t, count, forwards, n_path = 0, ReplayCount(), 0, len(ranks)
    while t < n_path:
        kk = max(0, min(depth, max_new_tokens - t - 1))
        tree = ts.truncate(shape, kk)
        n = ts.accepted_by_rank(tree, ranks[t:t + kk]) if tree else 0
        emitted = min(n + 1, n_path - t)
        full = n_path - t >= depth + 1
        t += emitted
        count.rounds += 1
        count.full_rounds += full
        count.full_tokens += emitted if full else 0
        forwards += ts.draft_forwards(tree) if tree else 0
    return count, forwards


def draft_token_tree(model, cache, root_logits: np.ndarray, shape: ts.Shape) -> list[int]:
    """The shape's tokens drafted by the ONNX draft, each node the given rank of the draft's
    distribution after its root path. ``cache`` holds the context, whose last logits are
    ``root_logits``; each expanded node's path is re-fed after it (correct, not fast), and the
    cache holds the context again on return."""
    base, tokens = cache.length, {}
    logits = {(): root_logits}
    expanded = {n[:-1] for n in shape}
    for node in shape:
        tokens[node] = int(ts.top_ranked(logits[node[:-1]], node[-1] + 1)[node[-1]])
        if node in expanded:
            cache.crop(base)
            logits[node] = _feed(model, cache, [tokens[node[:i]]
                                                for i in range(1, len(node) + 1)])
    cache.crop(base)
    return [tokens[n] for n in shape]


def _feed(model, cache, tokens: list[int]) -> np.ndarray:
    """The draft's logits after ``tokens``, fed one per forward as ``draft_trace`` feeds the
    path: the shipped draft quantizes its activations per forward (dynamic int8), so a
    forward of several rows gives slightly different logits, enough to swap near-tied ranks
    and make the check below differ from the trace for no fault of either."""
    for token in tokens:
        row = model.forward(cache, [token])[-1]
    return row


def replay_drafted_tree(model, prompt: list[int], path: list[int], shape: ts.Shape,
                        max_new_tokens: int) -> int:
    """Rounds of the same generation with every tree drafted for real and judged by
    ``accept_greedy``: the check of ``replay_tree_rounds``. The prompt is prefilled in one
    forward and the path fed a token at a time, as ``draft_trace`` does."""
    depth = max(len(n) for n in shape)
    cache = model.new_cache()
    root = model.forward(cache, prompt)[-1]
    t, rounds = 0, 0
    while t < len(path):
        tree = ts.truncate(shape, max(0, min(depth, max_new_tokens - t - 1)))
        tokens = draft_token_tree(model, cache, root, tree) if tree else []
        accepted = ts.accept_greedy(tokens, ts.parents(tree), path[t:]) if tree else []
        emitted = min(len(accepted) + 1, len(path) - t)
        if t + emitted < len(path):
            root = _feed(model, cache, path[t:t + emitted])
        t += emitted
        rounds += 1
    return rounds


def multi_draft_acceptance(p: torch.Tensor, q: torch.Tensor, k: int) -> list[float]:
    """[j-1]: the chance that one of j drafts drawn i.i.d. from q is accepted by SpecInfer's
    recursive rejection (draft x accepted with min(1, r(x) / q(x)) against the residual r,
    which starts as p and becomes norm(max(r - q, 0)) after each rejection)."""
    r, miss, out = p.double(), 1.0, []
    q = q.double()
    for _ in range(k):
        miss *= 1.0 - float(torch.minimum(r, q).sum())
        out.append(1.0 - miss)
        rest = (r - q).clamp_min(0)
        total = float(rest.sum())
        if total <= 0:  # p == q: the first draft is always accepted
            out += [1.0] * (k - len(out))
            break
        r = rest / total
    return out


def sampled_alphas(target_logits: torch.Tensor, draft_logits: np.ndarray) -> np.ndarray:
    """[n, MAX_BRANCH] per path position, ``multi_draft_acceptance`` under the sampled mode's
    shaping (q truncated exactly as the edge samples it)."""
    from cloud_verifier.sampling import SamplingParams, target_probs
    from edge_client.sampling import truncated_distribution

    p = target_probs(target_logits, SamplingParams(SAMPLED_TEMPERATURE, 0, SAMPLED_TOP_P))
    out = []
    for t in range(draft_logits.shape[0]):
        ids, probs = truncated_distribution(draft_logits[t], SAMPLED_TEMPERATURE, 0,
                                            SAMPLED_TOP_P, MAX_SUPPORT)
        q = torch.zeros(p.shape[1], dtype=torch.float64)
        q[torch.from_numpy(ids)] = torch.from_numpy(probs).double()
        out.append(multi_draft_acceptance(p[t], q, MAX_BRANCH))
    return np.array(out)


def expected_tokens_per_depth(alpha_by_branch: list[float], branches: list[int]) -> float:
    """1 + sum_d prod_{j <= d} alpha(b_j): a per-depth tree's expected tokens per round when
    each depth's acceptance is independent (a chain: (1 - a^(K+1)) / (1 - a))."""
    total, reach = 1.0, 1.0
    for b in branches:
        reach *= alpha_by_branch[b - 1]
        total += reach
    return total


# --------------------------------------------------------------------------------------------
# Verify cost
# --------------------------------------------------------------------------------------------


def tree_rows(shape: ts.Shape) -> tuple[list[int], list[int]]:
    """(parent, depth) of the verified rows: row 0 the root, row i + 1 the shape's node i."""
    parent = [-1] + [p + 1 for p in ts.parents(shape)]
    return parent, [0] + [len(n) for n in shape]


def tree_mask(parent: list[int], past: int, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, R, past + R] additive mask: every row sees the cache, itself and its ancestors."""
    r = len(parent)
    mask = torch.full((1, 1, r, past + r), torch.finfo(dtype).min, dtype=dtype)
    mask[..., :past] = 0
    mask[0, 0, :, past:][torch.from_numpy(ts.ancestry(parent))] = 0
    return mask


@torch.inference_mode()
def tree_forward(model, cache, tokens: list[int], parent: list[int], depth: list[int]
                 ) -> torch.Tensor:
    """Float32 logits [R, V] of one forward over a token tree on ``cache`` (a transformers
    cache holding the context), which is cropped back to the context afterwards."""
    past = cache.get_seq_length()
    dtype = model.get_input_embeddings().weight.dtype
    out = model(input_ids=torch.tensor([tokens]),
                attention_mask=tree_mask(parent, past, dtype),
                position_ids=torch.tensor([[past + d for d in depth]]),
                past_key_values=cache, use_cache=True)
    cache.crop(past)
    return out.logits[0].float()


@torch.inference_mode()
def chain_forward(model, cache, tokens: list[int]) -> torch.Tensor:
    """The causal forward (transformers' own mask), cache cropped back likewise."""
    past = cache.get_seq_length()
    out = model(input_ids=torch.tensor([tokens]), past_key_values=cache, use_cache=True)
    cache.crop(past)
    return out.logits[0].float()


@torch.inference_mode()
def prefilled_cache(model, context: list[int]):
    from transformers import DynamicCache

    cache = DynamicCache()
    model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True)
    return cache


def tree_vs_paths_error(model, cache, tokens: list[int], shape: ts.Shape) -> float:
    """Max |logit difference| between each tree row and the last row of a causal forward over
    the root and that node's root path: the tree mask is right iff this is round-off."""
    parent, depth = tree_rows(shape)
    logits = tree_forward(model, cache, tokens, parent, depth)
    worst = 0.0
    for row in range(len(tokens)):
        path, node = [], row
        while node >= 0:
            path.append(tokens[node])
            node = parent[node]
        alone = chain_forward(model, cache, path[::-1])[-1]
        worst = max(worst, float((logits[row] - alone).abs().max()))
    return worst


def time_forwards(target, context: list[int], trees: dict[int, ts.Shape], repeats: int,
                  gen: torch.Generator) -> dict[str, dict[int, float]]:
    """Median ms per forward: ``chain`` (transformers, causal), ``tree`` (transformers, tree
    mask of ``trees[R]``) and ``packed_chain`` (the verifier's packed forward), at each R; and
    the least, under the same names with ``_min``."""
    from cloud_verifier.bench.verify_cost import prefilled_kvs
    from cloud_verifier.packed_forward import Segment, packed_forward

    model, rows = target.model, sorted(trees)
    cache = prefilled_cache(model, context)
    kv = prefilled_kvs(target, [context], max(rows))[0]
    tokens = {r: torch.randint(0, target.vocab_size, (r,), generator=gen).tolist() for r in rows}
    calls = {}
    for r in rows:
        parent, depth = tree_rows(trees[r])
        calls["chain", r] = lambda r=r: chain_forward(model, cache, tokens[r])
        calls["tree", r] = lambda r=r, p=parent, d=depth: tree_forward(model, cache, tokens[r],
                                                                        p, d)
        calls["packed_chain", r] = lambda r=r: packed_forward(model, [Segment(kv, tokens[r], r)])
    times: dict[tuple[str, int], list[float]] = {key: [] for key in calls}
    for rep in range(repeats + 1):  # the first pass warms up
        for key, call in calls.items():
            t0 = time.perf_counter()
            call()
            if rep:
                times[key].append(1e3 * (time.perf_counter() - t0))
    out: dict[str, dict[int, float]] = {}
    for (kind, r), values in times.items():
        out.setdefault(kind, {})[r] = statistics.median(values)
        # The fastest repeat too: on a shared machine it is the least disturbed one.
        out.setdefault(kind + "_min", {})[r] = min(values)
    return out


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    import onnxruntime

    from cloud_verifier.target_model import load_target
    from edge_client.bench.acceptance_sets import encode_eval, load_realistic
    from edge_client.draft_model import OnnxDraftModel
    from edge_client.tokenizer import EdgeTokenizer
    from shared.paths import default_draft_dir

    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    draft_dir = args.draft_dir or default_draft_dir()
    target = load_target(args.target, device="cpu", dtype="float32")
    model = OnnxDraftModel(draft_dir, intra_op_threads=args.threads)
    stop_ids = frozenset(target.eos_token_ids)
    n_new = args.max_new_tokens
    evals, _ = load_realistic(args.per_category)
    prompts = encode_eval(EdgeTokenizer(draft_dir), evals,
                          target.max_context - n_new - max(args.budgets) - 1)

    traces = []  # (category, prompt ids, path, ranks, sampled alphas or None)
    for i, prompt in enumerate(prompts):
        log.info("prompt %d/%d (%s, %d tokens)", i + 1, len(prompts), prompt.category,
                 len(prompt.ids))
        path, target_logits, _ = target_greedy_path(target, prompt.ids, n_new, stop_ids)
        draft_logits, _ = draft_trace(model, prompt.ids, path)
        sampled = sampled_alphas(target_logits, draft_logits) if args.sampled else None
        traces.append((prompt.category, prompt.ids, path,
                       ts.ranks_along(draft_logits, path, MAX_RANK), sampled))

    hist = Counter(int(r) for *_, ranks, _ in traces for r in ranks)
    positions = sum(hist.values())
    rank_probs = [hist[r] / positions for r in range(MAX_RANK)]  # rank MAX_RANK: beyond
    shapes = {b: shapes_for(b, rank_probs) for b in args.budgets}
    chains = list(dict.fromkeys([ts.chain(k) for k in range(1, min(max(args.budgets),
                                                                   MAX_CHAIN) + 1)]
                                + [ts.chain(b) for b in args.budgets]))
    every = list(dict.fromkeys(chains + [s for b in args.budgets for s in shapes[b]]))

    # Tallies per (category, shape): [rounds, path tokens, full rounds, full tokens, forwards]
    tally: dict[tuple[str, ts.Shape], list[int]] = {}
    checked = 0
    for index, (category, ids, path, ranks, _) in enumerate(traces):
        for shape in every:
            count, forwards = replay_tree_rounds(ranks, shape, n_new)
            if shape in chains:  # the acceptance benchmark's own replay must agree
                drafter = PathDrafter(len(ids), path, np.where(ranks == 0, path, -1))
                same = replay_greedy_rounds(drafter, ids, path, len(shape), n_new)
                assert same.rounds == count.rounds, (index, ts.name(shape))
            elif index < args.check_prompts and len(shape) <= MAX_CHECKED_NODES:
                real = replay_drafted_tree(model, ids, path, shape, n_new)
                assert real == count.rounds, (index, ts.name(shape), real, count.rounds)
                checked += 1
            for key in (category, "overall"):
                row = tally.setdefault((key, shape), [0, 0, 0, 0, 0])
                for j, v in enumerate((count.rounds, len(path), count.full_rounds,
                                       count.full_tokens, forwards)):
                    row[j] += v

    def tokens_per_round(key: str, shape: ts.Shape) -> float:
        rounds, tokens, *_ = tally[key, shape]
        return tokens / rounds

    # Verify cost at each R measured: the chain of R - 1, and the best tree of R - 1 nodes for
    # the mask (a mask's cost does not depend on which tree it encodes; its rows do).
    gen = torch.Generator().manual_seed(0)
    context = (traces[0][1] + traces[0][2]) * (1 + args.context // 8)
    context = context[:args.context]
    trees = {len(s) + 1: ts.best_tree(len(s), rank_probs) for s in [()] + every}
    timing = time_forwards(target, context, trees, args.repeats, gen)
    check_shape = shapes[max(args.budgets)][-1]
    check_tokens = torch.randint(0, target.vocab_size, (len(check_shape) + 1,),
                                 generator=gen).tolist()
    mask_error = tree_vs_paths_error(target.model, prefilled_cache(target.model, context),
                                     check_tokens, check_shape)

    categories = list(dict.fromkeys(c for c, *_ in traces))
    alphas = np.concatenate([s for *_, s in traces]).mean(0).tolist() if args.sampled else None
    results = []
    for shape in every:
        r = len(shape) + 1
        rounds, tokens, full_rounds, full_tokens, forwards = tally["overall", shape]
        tpr = tokens / rounds
        kind = "chain" if shape in chains else "tree"
        entry = {
            "shape": ts.name(shape), "kind": kind, "rows": r, "draft_nodes": len(shape),
            "nodes": [list(n) for n in shape],
            "budget": len(shape) if len(shape) in args.budgets else None,
            "tokens_per_round": tpr,
            "tokens_per_full_round": full_tokens / full_rounds if full_rounds else None,
            "draft_forwards_per_round": forwards / rounds,
            "by_category": {c: tokens_per_round(c, shape) for c in categories},
            "verify_ms": timing[kind][r],
            "tokens_per_verify_s": 1e3 * tpr / timing[kind][r],
            "tokens_per_packed_s": 1e3 * tpr / timing["packed_chain"][r],
        }
        branches = ts.branches_of(shape)
        if alphas is not None and branches is not None and max(branches) <= MAX_BRANCH:
            entry["sampled_expected_tokens_per_round"] = expected_tokens_per_depth(alphas,
                                                                                  branches)
        results.append(entry)
    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch_threads": torch.get_num_threads(), "onnxruntime_threads": args.threads,
                    "torch": torch.__version__, "onnxruntime": onnxruntime.__version__,
                    "load_average": list(_loadavg())},
        "config": {"per_category": args.per_category, "prompts": len(prompts),
                   "max_new_tokens": n_new, "budgets": args.budgets, "repeats": args.repeats,
                   "context": len(context), "draft_dir": str(draft_dir), "target": target.name,
                   "check_prompts": args.check_prompts, "drafted_tree_checks": checked},
        "path_tokens": positions,
        "rank_probs": rank_probs + [1 - sum(rank_probs)],
        "tree_mask_max_logit_error": mask_error,
        "verify_ms": {kind: {str(r): ms for r, ms in by_r.items()}
                      for kind, by_r in timing.items()},
        "shapes": results,
        # What a later replay of other shapes needs, without the target or the draft.
        "paths": [{"category": c, "ranks": ranks.tolist()} for c, _, _, ranks, _ in traces],
    }
    if alphas is not None:
        report["sampled_multi_draft_alpha"] = alphas
    report["decision"] = _decide(results)
    report["wall_s"] = time.perf_counter() - t_start
    return report


def _decide(results: list[dict]) -> dict:
    """The best chain and the best tree by tokens per second of verify time (transformers'
    forwards for both, and with the packed chain forward's time at the same rows)."""
    out = {}
    for metric in ("tokens_per_verify_s", "tokens_per_packed_s"):
        best = {kind: max((e for e in results if e["kind"] == kind), key=lambda e: e[metric])
                for kind in ("chain", "tree")}
        out[metric] = {kind: {"shape": e["shape"], "value": e[metric]}
                       for kind, e in best.items()}
        out[metric]["tree_over_chain"] = best["tree"][metric] / best["chain"][metric]
    return out


def _loadavg() -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return ()


def format_report(report: dict) -> str:
    lines = ["| shape | rows | tokens/round | draft forwards/round | verify ms | tokens/s "
             "verify | tokens/s packed-chain ms |", "|---|---|---|---|---|---|---|"]
    for e in sorted(report["shapes"], key=lambda e: (e["rows"], e["kind"], e["shape"])):
        lines.append(f"| {e['shape']} | {e['rows']} | {e['tokens_per_round']:.3f} | "
                     f"{e['draft_forwards_per_round']:.2f} | {e['verify_ms']:.1f} | "
                     f"{e['tokens_per_verify_s']:.1f} | {e['tokens_per_packed_s']:.1f} |")
    d = report["decision"]
    for metric, v in d.items():
        lines.append(f"{metric}: best chain {v['chain']['shape']} {v['chain']['value']:.1f}, "
                     f"best tree {v['tree']['shape']} {v['tree']['value']:.1f}, "
                     f"tree/chain {v['tree_over_chain']:.3f}")
    lines.append(f"tree mask max logit error {report['tree_mask_max_logit_error']:.2e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tree_drafts", description=__doc__.splitlines()[0])
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 6, 8])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--context", type=int, default=100,
                   help="cached tokens under the timed forwards")
    p.add_argument("--check-prompts", type=int, default=2,
                   help="prompts on which every tree is also drafted for real and compared")
    p.add_argument("--sampled", action="store_true", help="add the T=0.7 multi-draft estimate")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--target", default=None)
    p.add_argument("--draft-dir", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    if min(args.budgets) < 1 or args.per_category < 1 or args.max_new_tokens < 2:
        raise SystemExit("--budgets and --per-category must be >= 1, --max-new-tokens >= 2")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    report = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    print(format_report(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
