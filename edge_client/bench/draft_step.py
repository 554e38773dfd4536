"""What a draft step costs the device: ``ModelDrafter.propose`` per drafted token (the ONNX
forward plus choosing the token and its confidence or q), against the bare ONNX forward.

    python -m edge_client.bench.draft_step [--draft-dir DIR] [--context 128] [--rounds 60]

Each round proposes K tokens after the committed text, then commits the first draft and one
other token (one accepted, one correction), so every round also resyncs the cache (a crop and
a two-token feed), as in a generation with about one accepted draft a round. Greedy and
sampled (T = 0.7, top-p 0.95, q capped at 64), each with stop_confidence 0 so that every
round drafts K. Prints medians over rounds; ``--json PATH`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from edge_client.draft_model import OnnxDraftModel
from edge_client.drafter import DraftSampling, ModelDrafter
from shared.paths import default_draft_dir

SAMPLINGS = {"greedy": DraftSampling(),
             "t0.7": DraftSampling(temperature=0.7, top_p=0.95, max_support=64)}


def drafter_ms(model: OnnxDraftModel, sampling: DraftSampling, context: list[int], k: int,
               rounds: int, seed: int) -> float:
    """Median milliseconds per drafted token of ``rounds`` proposals."""
    rng = np.random.default_rng(seed)
    drafter = ModelDrafter(model, sampling, rng)
    committed = list(context)
    drafter.propose(committed, k)  # the prefill, not timed
    per_token = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        proposal = drafter.propose(committed, k)
        per_token.append((time.perf_counter() - t0) / max(1, len(proposal.tokens)))
        committed += [proposal.tokens[0], _token(rng, model)]
    return 1e3 * statistics.median(per_token)


def _token(rng: np.random.Generator, model: OnnxDraftModel) -> int:
    """An ordinary token id (past the specials)."""
    return int(rng.integers(3, min(model.vocab_size, 5000)))


def forward_ms(model: OnnxDraftModel, context: list[int], rounds: int) -> float:
    """Median milliseconds of one bare one-token ONNX run after ``context`` (no logits work)."""
    cache = model.new_cache()
    model.forward_compact(cache, context)
    rng = np.random.default_rng(1)
    times = []
    for _ in range(rounds):
        token = _token(rng, model)
        t0 = time.perf_counter()
        model.forward_compact(cache, [token])
        times.append(time.perf_counter() - t0)
        cache.crop(len(context))
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="draft_step", description=__doc__.splitlines()[0])
    p.add_argument("--draft-dir", type=Path, default=None)
    p.add_argument("--context", type=int, default=128, help="committed tokens before drafting")
    p.add_argument("--draft-len", type=int, default=4)
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)
    model = OnnxDraftModel(args.draft_dir or default_draft_dir(), intra_op_threads=args.threads)
    rng = np.random.default_rng(args.seed)
    context = [_token(rng, model) for _ in range(args.context)]
    report = {"draft_dir": str(model.model_dir), "context": args.context,
              "draft_len": args.draft_len, "rounds": args.rounds,
              "forward_ms": forward_ms(model, context, args.rounds)}
    for name, sampling in SAMPLINGS.items():
        report[f"propose_ms_per_token_{name}"] = drafter_ms(model, sampling, context,
                                                            args.draft_len, args.rounds, args.seed)
    for key, value in report.items():
        print(f"{key:32s} {value:.3f}" if isinstance(value, float) else f"{key:32s} {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
