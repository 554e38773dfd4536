"""What verifying K drafts costs against decoding one token, per batch size, on this machine.

    python -m cloud_verifier.bench.verify_cost [--model PATH] [--batches 1 2 4 8 16]
        [--max-k 4] [--alphas 0.5 0.65 0.8] [--attention loop|padded|varlen]

For B sessions (context lengths 64..320, within the model's context) it times one packed
verify forward (``cloud_verifier.packed_forward``, K + 1 new tokens per session) for
K = 0..max-k, median of ``--repeats``; K = 0 is the cloud-only baseline's decode step. From
these it prints:

- cost(B, K) / cost(B, 0): what a speculative round costs in baseline steps;
- the break-even acceptance per (B, K): the alpha at which a round's expected tokens
  E(K) = (1 - alpha^(K+1)) / (1 - alpha) equal that cost ratio, i.e. below which speculation
  commits fewer tokens per second of forward time than plain decoding;
- a least-squares fit ms = a + s' * sessions + t' * tokens over the forwards of 2 or more
  tokens, printed as the verifier's ``--verify-session-cost s'/a --verify-token-cost t'/a``
  (``cloud_verifier.draft_policy``; a lone 1-token forward takes a faster matrix-vector path
  and is left out);
- for each ``--alphas`` value, the best K and the server-throughput ratio it allows,
  max_K E(K) * cost(B, 0) / cost(B, K): an upper bound on spec / baseline tokens/s at that load
  (clients with no network delay and no draft time), so the most speculation can raise capacity
  on this hardware;
- for each B whose 2B was measured, the least time per token an ideal speculative server
  has at 2B sessions, min_K cost(2B, K) / E(K), against the baseline's at B, cost(B, 0): above
  1, even clients with no delay at all make 2B sessions slower per token than the baseline's
  B, so speculation doubles the capacity at a latency target only if the baseline at B sits at
  least that factor under the target.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from cloud_verifier.attention import ATTENTION
from cloud_verifier.draft_policy import expected_tokens, fit_verify_cost
from cloud_verifier.engine import VerifierEngine
from cloud_verifier.packed_forward import Segment, packed_forward
from cloud_verifier.target_model import load_target


def context_lengths(target, b: int, reserve: int) -> list[int]:
    """B context lengths spread over 64..320 tokens, leaving ``reserve`` within the context."""
    longest = min(320, target.max_context - reserve)
    return [min(64, longest) + (max(0, longest - 64) * i) // max(1, b - 1) for i in range(b)]


def prefilled_kvs(target, contexts: list[list[int]], reserve: int) -> list:
    """One packed KV cache per context, prefilled with it, room for ``reserve`` more tokens
    (each prefilled alone: the cache is the same as the verifier's after that prompt)."""
    engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
    kvs = []
    for context in contexts:
        kv = engine.kv.ensure(None, len(context) + reserve)
        packed_forward(target.model, [Segment(kv, context, 1)])
        kv.length = len(context)
        kvs.append(kv)
    return kvs


def verify_costs_ms(target, b: int, max_k: int, repeats: int,
                    gen: torch.Generator, attention: str | None = None) -> list[float]:
    """Median ms of one packed forward over B sessions with K + 1 new tokens each, K = 0.."""
    model = target.model
    lengths = context_lengths(target, b, max_k + 1)
    kvs = prefilled_kvs(target, [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist()
                                 for n in lengths], max_k + 1)
    out = []
    for k in range(max_k + 1):
        new = [torch.randint(0, target.vocab_size, (k + 1,), generator=gen).tolist()
               for _ in range(b)]
        segments = [Segment(kv, x, k + 1) for kv, x in zip(kvs, new, strict=True)]
        packed_forward(model, segments, attention)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            packed_forward(model, segments, attention)
            times.append((time.perf_counter() - t0) * 1e3)
        out.append(statistics.median(times))
    return out


def break_even_alpha(cost_ratio: float, k: int) -> float | None:
    """The alpha where E(K) equals ``cost_ratio`` (bisection; E grows with alpha), or None
    when even alpha = 1 (E = K + 1) does not pay for the round."""
    if cost_ratio > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < cost_ratio else (lo, mid)
    return hi


def best_gain(costs: list[float], alpha: float) -> tuple[int, float]:
    """(K, spec / baseline forward throughput) maximising E(K) * cost(0) / cost(K)."""
    gains = [expected_tokens(alpha, k) * costs[0] / c for k, c in enumerate(costs)]
    k = max(range(len(gains)), key=gains.__getitem__)
    return k, gains[k]


def doubling_bound(costs: dict[int, list[float]], alpha: float) -> dict[int, tuple[int, float]]:
    """B -> (K, ratio) for every B whose 2B was measured: ratio = min_K cost(2B, K) / E(K)
    over cost(B, 0), the ideal speculative time per token at 2B sessions against the
    baseline's at B."""
    out = {}
    for b, base in costs.items():
        if 2 * b in costs:
            per_token = [c / expected_tokens(alpha, k) for k, c in enumerate(costs[2 * b])]
            k = min(range(len(per_token)), key=per_token.__getitem__)
            out[b] = (k, per_token[k] / base[0])
    return out


def fit_costs(costs: dict[int, list[float]]) -> tuple[float, float, float]:
    """(a, s', t') of ms = a + s' * sessions + t' * tokens, least squares over the forwards of
    two or more tokens; ``costs[B][K]`` is the ms of B sessions x (K + 1) tokens."""
    seen = [(b, b * (k + 1), c) for b, by_k in costs.items() for k, c in enumerate(by_k)
            if b * (k + 1) >= 2]
    if len(seen) < 3:
        raise ValueError("the fit needs at least three forwards of two or more tokens")
    return fit_verify_cost(*zip(*seen, strict=True))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--max-k", type=int, default=4)
    p.add_argument("--alphas", type=float, nargs="+", default=[0.5, 0.65, 0.8])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--attention", choices=ATTENTION, default=None,
                   help="attention implementation (default: the device's)")
    args = p.parse_args(argv)
    if args.max_k < 1 or any(not 0 <= a < 1 for a in args.alphas):
        raise SystemExit("--max-k must be >= 1 and every --alphas value in [0, 1)")
    target = load_target(args.model)
    gen = torch.Generator().manual_seed(0)
    ks = range(args.max_k + 1)
    print(f"target {target.name}, threads {torch.get_num_threads()}, packed verify forward, "
          f"attention {args.attention or 'default'}, median of {args.repeats}")
    print("| sessions | " + " | ".join(f"K={k} ms" for k in ks) + " | "
          + " | ".join(f"K={k} cost / K=0 (break-even α)" for k in ks[1:]) + " | "
          + " | ".join(f"α={a}: best K, max spec/baseline" for a in args.alphas) + " |")
    print("|---" * (1 + len(ks) + args.max_k + len(args.alphas)) + "|")
    measured = {}
    for b in args.batches:
        costs = verify_costs_ms(target, b, args.max_k, args.repeats, gen, args.attention)
        measured[b] = costs
        cells = [f"{c:.0f}" for c in costs]
        for k in ks[1:]:
            ratio = costs[k] / costs[0]
            alpha = break_even_alpha(ratio, k)
            cells.append(f"{ratio:.2f} ({'never' if alpha is None else f'{alpha:.2f}'})")
        for a in args.alphas:
            k, gain = best_gain(costs, a)
            cells.append(f"K={k}, {gain:.2f}x")
        print(f"| {b} | " + " | ".join(cells) + " |", flush=True)
    bounds = {a: doubling_bound(measured, a) for a in args.alphas}
    if any(bounds.values()):
        print("\nIdeal spec time per token at 2B sessions / baseline's at B (above 1: 2x "
              "capacity needs the baseline at B that far under the latency target):")
        print("| B -> 2B | " + " | ".join(f"α={a}: best K, ratio" for a in args.alphas) + " |")
        print("|---" * (1 + len(args.alphas)) + "|")
        for b in sorted(bounds[args.alphas[0]]):
            cells = [f"K={bounds[a][b][0]}, {bounds[a][b][1]:.2f}" for a in args.alphas]
            print(f"| {b} -> {2 * b} | " + " | ".join(cells) + " |")
    try:
        a, s, t = fit_costs(measured)
    except ValueError as exc:
        print(f"no fit: {exc}")
    else:
        print(f"fit over forwards of >= 2 tokens: ms = {a:.1f} + {s:.2f} * sessions + {t:.2f} * "
              f"tokens -> edgespec-verifier --verify-session-cost {s / a:.3f} "
              f"--verify-token-cost {t / a:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
