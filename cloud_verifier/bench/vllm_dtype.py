"""vLLM in bfloat16 against float32 on the realistic set: is bfloat16's greedy output to be
trusted on this CPU? Runs in the vLLM environment (.venv-vllm).

    python -m cloud_verifier.bench.vllm_dtype [--prompts 48] [--tokens 64] [--threads 1]
        [--json PATH]

Each dtype runs in its own process (one ``vllm.LLM`` per process, started as the verifier
starts it: cloud_verifier.vllm_engine.start_llm) and generates greedily for the chat prompts of
the acceptance bench's realistic set, all in one batch. Then, bfloat16 against float32: how
many answers are token-identical, where the first differing token falls, and how many answers
are degenerate, i.e. loop: among their last 32 tokens, fewer than half of the 4-grams are
distinct (a fluent answer repeats few; "1.1.1.1..." repeats one). An earlier run on an AMD
host saw bfloat16 degenerate; an Intel run did not (docs/vllm-engine.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cloud_verifier.bench.engines import _prompts

TAIL, GRAM = 32, 4


def degenerate(tokens: list[int]) -> bool:
    tail = tokens[-TAIL:]
    grams = [tuple(tail[i:i + GRAM]) for i in range(len(tail) - GRAM + 1)]
    return bool(grams) and len(set(grams)) < 0.5 * len(grams)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _worker(args: argparse.Namespace) -> int:
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    from cloud_verifier.vllm_engine import VllmSettings, load_vllm_engine

    meta, engine = load_vllm_engine(args.model, 2048, VllmSettings(dtype=args.dtype,
                                                                   threads=args.threads))
    prompts = _prompts(meta.tokenizer, args.prompts)
    t0 = time.perf_counter()
    out = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                              VllmParams(max_tokens=args.tokens, temperature=0.0,
                                         detokenize=False), use_tqdm=False)
    seconds = time.perf_counter() - t0
    answers = [list(o.outputs[0].token_ids) for o in out]
    Path(args.out).write_text(json.dumps({
        "dtype": args.dtype, "seconds": seconds, "answers": answers,
        "texts": [meta.tokenizer.decode(a) for a in answers]}))
    return 0


def compare(f32: dict, bf16: dict) -> dict:
    pairs = list(zip(f32["answers"], bf16["answers"], strict=True))
    firsts = [first_difference(a, b) for a, b in pairs]
    differing = [f for f in firsts if f is not None]
    return {
        "prompts": len(pairs),
        "identical": sum(f is None for f in firsts),
        "first_difference_median": statistics.median(differing) if differing else None,
        "degenerate": {d["dtype"]: sum(map(degenerate, d["answers"])) for d in (f32, bf16)},
        "tokens_per_s": {d["dtype"]: round(sum(map(len, d["answers"])) / d["seconds"], 1)
                         for d in (f32, bf16)},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cloud_verifier.bench.vllm_dtype")
    p.add_argument("--model", default=None)
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, default=None, metavar="PATH")
    p.add_argument("--dtype", default=None, help=argparse.SUPPRESS)  # the worker's
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.dtype:
        return _worker(args)
    runs = {}
    with tempfile.TemporaryDirectory(prefix="edgespec-dtype-") as tmp:
        for dtype in ("float32", "bfloat16"):
            out = Path(tmp) / f"{dtype}.json"
            cmd = [sys.executable, "-m", "cloud_verifier.bench.vllm_dtype", "--dtype", dtype,
                   "--out", str(out), "--prompts", str(args.prompts), "--tokens",
                   str(args.tokens), "--threads", str(args.threads)]
            subprocess.run(cmd + (["--model", args.model] if args.model else []), check=True)
            runs[dtype] = json.loads(out.read_text())
    result = compare(runs["float32"], runs["bfloat16"])
    print(f"bfloat16 against float32, {result['prompts']} realistic prompts x {args.tokens} "
          f"greedy tokens: {result['identical']} identical, first difference at token "
          f"{result['first_difference_median']} (median of the others); degenerate answers "
          f"float32 {result['degenerate']['float32']}, bfloat16 "
          f"{result['degenerate']['bfloat16']}; tokens/s float32 "
          f"{result['tokens_per_s']['float32']}, bfloat16 {result['tokens_per_s']['bfloat16']}")
    for dtype in ("float32", "bfloat16"):
        print(f"  {dtype} answer 0: {runs[dtype]['texts'][0][:160]!r}")
    if args.json:
        args.json.write_text(json.dumps({"summary": result, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
