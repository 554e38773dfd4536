"""How much each feature wire form (``shared.feature_codec``) changes the target's own argmax.

    python -m edge_client.tools.distill.codec_eval --prompts 30 --new-tokens 24

The target (default: the prepared SmolLM2) answers the first ``--prompts`` prompts of the
evaluation set greedily, then reads its own text teacher-forced; at every position that
decided a generated token, its final-norm hidden state f (what the verifier sends) goes
through each codec's round trip, and we count the positions where the LM head's argmax on the
decoded f differs from the one on f. A flip there is a feature that points the draft head at
another token than the one the target chose.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from shared.feature_codec import codec_named

CODECS = ("int8-g{hidden}", "int8-g64", "int8-g32", "int8-g16", "fp16")


def target_features(target_dir: Path, prompts: int, new_tokens: int):
    """(final-norm states [N, H] at the positions that decided generated tokens, LM head
    [V, H]) of the target over the first ``prompts`` evaluation prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from edge_client.bench.eval_set import load_eval

    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    seen: dict = {}
    model.model.norm.register_forward_hook(lambda m, args, out: seen.__setitem__("h", out))
    rows = []
    for p in load_eval()[:prompts]:
        ids = tok.apply_chat_template([{"role": r, "content": c} for r, c in p.messages],
                                      add_generation_prompt=True, return_tensors="pt")
        ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=new_tokens, do_sample=False)
            model(out)  # teacher-forced over its own text
        rows.append(seen["h"][0, ids.shape[1] - 1: out.shape[1] - 1].numpy())
    return np.concatenate(rows).astype(np.float32), model.lm_head.weight.detach().numpy()


def flip_rates(features: np.ndarray, lm_head: np.ndarray) -> dict:
    reference = (features @ lm_head.T).argmax(1)
    hidden = features.shape[1]
    out = {}
    for pattern in CODECS:
        codec = codec_named(pattern.format(hidden=hidden))
        back = codec.round_trip(features)
        flips = int(((back @ lm_head.T).argmax(1) != reference).sum())
        out[codec.name] = {"bytes": codec.nbytes(hidden), "flips": flips,
                           "positions": len(reference),
                           "flip_rate": round(flips / len(reference), 4),
                           "max_abs_error": round(float(np.abs(back - features).max()), 4)}
    return out


def main(argv=None) -> int:
    from shared.paths import default_target_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, default=None)
    p.add_argument("--prompts", type=int, default=30)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    features, lm_head = target_features(args.target or default_target_dir(), args.prompts,
                                        args.new_tokens)
    median = float(np.median(np.abs(features)))
    report = {"positions": len(features), "median_abs": round(median, 3),
              "mean_max_abs": round(float(np.abs(features).max(1).mean()), 2),
              "codecs": flip_rates(features, lm_head),
              "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
