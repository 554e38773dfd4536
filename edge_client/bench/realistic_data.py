"""``python -m edge_client.bench.realistic_data --out DIR``: the realistic evaluation
set as a ``gen-data`` directory, so that ``train --heldout DIR`` measures a draft during
training on what users type (the learning curve: greedy alpha against tokens seen), not only
on the templated held-out split.

The prompts and their encoding are the acceptance bench's (``load_realistic`` and
``encode_eval``: the same ``--prompts`` per category, chat turns through the template, IME
text raw), the continuation is the target's greedy path (``target_greedy_path``), and each row
records p's top-k, so ``evaluate`` reports what ``edgespec-bench acceptance`` calls the model's
greedy alpha, teacher-forced, in PyTorch rather than through the int8 ONNX file.
``categories.json`` maps each shard row to its category, for ``train``'s per-category figures
(``evaluate.realistic_categories``).

Nothing here is ever trained on: the directory is only read as ``--heldout``."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from edge_client.tools.distill.common import write_json
from edge_client.tools.distill.shards import Sample, write_shard

log = logging.getLogger("edgespec.distill")


def build(out: Path, per_category: int, max_new_tokens: int, top_k: int,
          target: Path | None = None) -> dict:
    import torch

    from cloud_verifier.target_model import load_target
    from edge_client.bench.acceptance import target_greedy_path
    from edge_client.bench.acceptance_sets import encode_eval, load_realistic
    from edge_client.tokenizer import EdgeTokenizer
    from edge_client.tools.distill.common import default_target

    model = load_target(target, device="cpu")
    tokenizer = EdgeTokenizer(Path(target) if target is not None else default_target())
    evals, source = load_realistic(per_category)
    prompts = encode_eval(tokenizer, evals, model.max_context - max_new_tokens - 1)
    stop = frozenset(model.eos_token_ids)
    samples = []
    for i, p in enumerate(prompts):
        path, logits, _ = target_greedy_path(model, p.ids, max_new_tokens, stop)
        logp, ids = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
        samples.append(Sample(np.asarray(p.ids), np.asarray(path), ids.numpy(),
                              logp.numpy().astype(np.float16), sampled=False))
        log.info("realistic %d/%d (%s): %d tokens", i + 1, len(prompts), p.category, len(path))
    out.mkdir(parents=True, exist_ok=True)
    write_shard(out / "shard-00000.npz", samples, list(range(len(samples))))
    info = {"source": source, "per_category": per_category, "max_new_tokens": max_new_tokens,
            "top_k": top_k, "prompts": len(samples),
            "tokens": int(sum(len(s.gen_ids) for s in samples)),
            "categories": [p.category for p in prompts]}
    write_json(out / "categories.json", info)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=12, help="per category (the bench's)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--target", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    info = build(args.out, args.prompts, args.max_new_tokens, args.top_k, args.target)
    print(json.dumps({k: v for k, v in info.items() if k != "categories"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
