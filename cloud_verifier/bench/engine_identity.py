"""Greedy output of the built-in engine against vLLM's, on the realistic set, with the
near-ties where they differ. Runs in the vLLM environment (.venv-vllm).

    python -m cloud_verifier.bench.engine_identity [--prompts 48] [--tokens 64] [--json PATH]

Both engines compute the target's logits in float32 from the same checkpoint, in different
kernels (torch eager against vLLM's), so they can only disagree where two tokens' logits are
within rounding of each other. For every answer that differs, the first differing position is
scored by both engines on the common prefix: the built-in engine's margin of its token over
vLLM's, and vLLM's margin of its token over the built-in one's (both >= 0 when each engine
chose its own argmax). A near-tie is a difference where both margins are under
``--tie-nats``; anything else would be a bug.

The built-in side is the target's own greedy decoding, one prompt at a time with its KV cache
(what the built-in engine's rounds reproduce token for token, tests/test_batching.py); the vLLM
side is ``vllm.LLM.generate`` at temperature 0 with every prompt in one batch (what the vLLM
engine's rounds reproduce, tests/test_vllm_engine.py). Prompts: every category of the
realistic set in turn, IME prefixes as raw text, as the vLLM engine's test takes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from cloud_verifier.bench.engines import _reference
from cloud_verifier.bench.vllm_dtype import first_difference


def realistic_prompts(tokenizer, n: int) -> list[list[int]]:
    from edge_client.bench.eval_set import load_eval

    chosen = sorted(load_eval(), key=lambda p: (int(p.id.rsplit("-", 1)[1]), p.category))[:n]
    return [list(tokenizer.apply_chat_template(p.chat_messages(), add_generation_prompt=True,
                                               tokenize=True, return_dict=False))
            if p.chat else tokenizer.encode(p.raw, add_special_tokens=False) for p in chosen]


def builtin_greedy(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The argmax at every step, end-of-turn tokens included and not stopped at (as vLLM's
    ``ignore_eos``; ``generate``'s ``min_new_tokens`` would mask them instead)."""
    from transformers import DynamicCache

    out = []
    with torch.inference_mode():
        for p in prompts:
            cache, ids, new = DynamicCache(), torch.tensor([p]), []
            for _ in range(tokens):
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
                new.append(int(logits[0, -1].argmax()))
                ids = torch.tensor([[new[-1]]])
            out.append(new)
    return out


def builtin_logp(model, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, -1).numpy()


def vllm_logp(llm, ids: list[int], vocab: int) -> np.ndarray:
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    lp = llm.generate([TokensPrompt(prompt_token_ids=ids)],
                      VllmParams(max_tokens=1, temperature=0.0, logprobs=-1, detokenize=False,
                                 flat_logprobs=True), use_tqdm=False)[0].outputs[0].logprobs
    row = np.full(vocab, -np.inf)
    a, b = lp.start_indices[0], lp.end_indices[0]
    row[lp.token_ids[a:b]] = lp.logprobs[a:b]
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cloud_verifier.bench.engine_identity")
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--tie-nats", type=float, default=0.01)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    args = p.parse_args(argv)

    from cloud_verifier.target_model import load_target
    from cloud_verifier.vllm_engine import VllmSettings, load_vllm_engine

    torch.set_num_threads(1)  # as the verifier runs the built-in engine (torch_thread)
    target = load_target(args.model, device="cpu", dtype="float32")
    prompts = realistic_prompts(target.tokenizer, args.prompts)
    t0 = time.perf_counter()
    builtin = builtin_greedy(target.model, prompts, args.tokens)
    builtin_s = time.perf_counter() - t0
    meta, engine = load_vllm_engine(args.model, 2048, VllmSettings(threads=1))
    vllm = _reference(engine.llm, prompts, args.tokens)  # temperature 0, ignore_eos

    diffs = []
    for i, (a, b) in enumerate(zip(builtin, vllm, strict=True)):
        j = first_difference(a, b)
        if j is None:
            continue
        prefix = prompts[i] + a[:j]
        lb, lv = builtin_logp(target.model, prefix), vllm_logp(engine.llm, prefix,
                                                               meta.vocab_size)
        diffs.append({"prompt": i, "position": j, "builtin_token": a[j], "vllm_token": b[j],
                      "builtin_margin": float(lb[a[j]] - lb[b[j]]),
                      "vllm_margin": float(lv[b[j]] - lv[a[j]]),
                      "builtin_text": meta.tokenizer.decode([a[j]]),
                      "vllm_text": meta.tokenizer.decode([b[j]])})
    ties = [d for d in diffs if max(d["builtin_margin"], d["vllm_margin"]) < args.tie_nats]
    result = {"prompts": len(prompts), "tokens": args.tokens,
              "identical": len(prompts) - len(diffs), "differing": len(diffs),
              "near_ties": len(ties), "tie_nats": args.tie_nats,
              "first_difference_median": (statistics.median(d["position"] for d in diffs)
                                          if diffs else None),
              "builtin_greedy_s": round(builtin_s, 1), "differences": diffs}
    print(f"built-in against vLLM greedy, {len(prompts)} realistic prompts x {args.tokens} "
          f"tokens (float32): {result['identical']} identical, {len(diffs)} differ, "
          f"{len(ties)} of them at a near-tie (both margins < {args.tie_nats} nats)")
    for d in diffs:
        print(f"  prompt {d['prompt']} token {d['position']}: built-in {d['builtin_text']!r} "
              f"by {d['builtin_margin']:.5f} nats, vLLM {d['vllm_text']!r} by "
              f"{d['vllm_margin']:.5f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
