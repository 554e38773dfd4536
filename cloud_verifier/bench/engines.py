"""The built-in engine against vLLM, side by side in one process, through the one interface
the verifier uses (``TargetEngine.run_batch``). Runs in the vLLM environment (.venv-vllm).

    python -m cloud_verifier.bench.engines [--batches 1 4 16] [--k 4] [--rounds 12]
        [--threads 1] [--offline-prompts 64] [--json PATH]

For each engine and batch size B it opens B greedy sessions on realistic prompts (the
acceptance bench's set), prefills them with a first round, then times ``--rounds`` rounds of
K = 0 (a decode step: the cloud-only baseline) and of K drafts (the target's own next tokens,
so every round commits K + 1 and the contexts grow as in a real generation); it prints the
median milliseconds per batched round and verify(K+1)/decode. ``--offline-prompts`` also
times batched offline generation (vLLM's ``LLM.generate``, 128 new tokens each), the way
distillation data would be made.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from cloud_verifier import torch_thread
from cloud_verifier.sampling import SamplingParams
from cloud_verifier.sessions import SessionStore
from cloud_verifier.target_engine import DraftRound


def _prompts(tokenizer, n: int) -> list[list[int]]:
    from edge_client.bench.eval_set import load_eval

    chats = [p for p in load_eval() if p.chat][:n]
    return [list(tokenizer.apply_chat_template(p.chat_messages(), add_generation_prompt=True,
                                               tokenize=True, return_dict=False))
            for p in chats]


def _reference(llm, prompts: list[list[int]], new: int) -> list[list[int]]:
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                       VllmParams(max_tokens=new, temperature=0.0, ignore_eos=True,
                                  detokenize=False), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in out]


def time_rounds(engine, prompts, references, k: int, rounds: int) -> float:
    """Median ms of one batched round of K drafts over B sessions (after their prefill)."""
    store = SessionStore(max_sessions=len(prompts), ttl_s=600)
    sessions = [store.create("bench", SamplingParams(), list(p), 0, frozenset())
                for p in prompts]

    def step(kk: int) -> float:
        batch = []
        for s, ref in zip(sessions, references, strict=True):
            n = len(s.committed) - s.prompt_len
            batch.append((s, DraftRound(ref[n:n + kk], None)))
        t0 = time.perf_counter()
        for outcome in torch_thread.run(engine.run_batch, batch):
            if isinstance(outcome, Exception):
                raise outcome
        return (time.perf_counter() - t0) * 1e3

    step(0)  # the prefill round
    times = [step(k) for _ in range(rounds)]
    for s in sessions:
        engine.release(s)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cloud_verifier.bench.engines")
    p.add_argument("--model", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--offline-prompts", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import torch

    from cloud_verifier.config import VerifierConfig
    from cloud_verifier.server import builtin_engine, load_served_target
    from cloud_verifier.vllm_engine import VllmSettings, load_vllm_engine

    meta, vllm = load_vllm_engine(args.model, 2048, VllmSettings(threads=args.threads))
    torch_thread.run(torch.set_num_threads, args.threads)
    target = load_served_target(args.model, device="cpu", dtype="float32")
    builtin = builtin_engine(target, VerifierConfig(serve_features=False), 2048)
    new = (args.k + 1) * (args.rounds + 1) + 1
    prompts = _prompts(meta.tokenizer, max(args.batches))
    references = _reference(vllm.llm, prompts, new)
    rows = []
    for b in args.batches:
        for name, engine in (("builtin", builtin), ("vllm", vllm)):
            decode = time_rounds(engine, prompts[:b], references[:b], 0, args.rounds)
            verify = time_rounds(engine, prompts[:b], references[:b], args.k, args.rounds)
            vllm.llm.reset_prefix_cache()  # each measurement starts cold, as the first did
            rows.append(dict(engine=name, batch=b, decode_ms=round(decode, 1),
                             verify_ms=round(verify, 1), ratio=round(verify / decode, 3)))
            print(f"{name:8s} B={b:3d}  decode {decode:7.1f} ms  verify(K+1={args.k + 1}) "
                  f"{verify:7.1f} ms  ratio {verify / decode:.3f}", flush=True)
    result = dict(threads=args.threads, k=args.k, rounds=args.rounds, rows=rows)
    if args.offline_prompts:
        from vllm import SamplingParams as VllmParams
        from vllm.inputs import TokensPrompt

        offline = _prompts(meta.tokenizer, args.offline_prompts)
        t0 = time.perf_counter()
        out = vllm.llm.generate([TokensPrompt(prompt_token_ids=q) for q in offline],
                                VllmParams(max_tokens=128, temperature=0.7, seed=0,
                                           detokenize=False), use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in out)
        result["offline"] = dict(prompts=len(offline), tokens=tokens,
                                 tokens_per_s=round(tokens / seconds, 1))
        print(f"vllm offline: {len(offline)} prompts, {tokens} tokens in {seconds:.1f} s = "
              f"{tokens / seconds:.1f} tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
