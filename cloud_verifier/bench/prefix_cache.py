"""What prefix caching saves a follow-up request: time to first token, cache on and off.

    python -m cloud_verifier.bench.prefix_cache [--model PATH] [--contexts 64 256 1024]
        [--repeats 5]

A multi-turn chat, or an IME client whose text field holds a long document, sends a prompt
that extends its previous request's prompt and answer. For each context length C, two
verifiers on loopback (``--prefix-cache-mb`` 0 and the default) each serve, per repeat, a
``Generate`` of 8 tokens over C random tokens, then the follow-up: those C tokens, the 8
answered ones and 12 new ones. The follow-up's time to first token is printed per verifier,
median of ``--repeats`` (the two verifiers alternate within each repeat), with the follow-up's
outputs compared (the cache must not change them).
"""

from __future__ import annotations

import argparse
import statistics
import time

import grpc
import torch

from cloud_verifier.config import VerifierConfig
from cloud_verifier.server import EmbeddedVerifier
from cloud_verifier.target_model import load_target
from shared.pb import verifier_pb2 as pb
from shared.pb import verifier_pb2_grpc as pb_grpc

ANSWER_TOKENS = 8
TURN_TOKENS = 12


def generate(stub, prompt: list[int]) -> tuple[float, list[int]]:
    """(ms to the first streamed token, all tokens) of one Generate."""
    t0 = time.perf_counter()
    first, tokens = None, []
    for reply in stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt,
                                                  max_new_tokens=ANSWER_TOKENS,
                                                  ignore_eos=True)):
        if first is None:
            first = (time.perf_counter() - t0) * 1000
        tokens += reply.step.token_ids
    return first, tokens


def follow_up_ttft(address: str, history: list[int], turn: list[int]) -> tuple[float, list[int]]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierServiceStub(channel)
        _, answer = generate(stub, history)
        return generate(stub, history + answer + turn)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    target = load_target(args.model)
    longest = target.max_context - ANSWER_TOKENS - TURN_TOKENS - 1
    if any(not 1 <= c <= longest for c in args.contexts) or args.repeats < 1:
        raise SystemExit(f"--contexts must be in [1, {longest}] and --repeats >= 1")
    gen = torch.Generator().manual_seed(0)
    low, high = min(100, target.vocab_size - 1), target.vocab_size
    on = VerifierConfig(port=0)
    verifiers = {"off": EmbeddedVerifier(target, VerifierConfig(port=0, prefix_cache_bytes=0)),
                 "on": EmbeddedVerifier(target, on)}
    print(f"target {target.name}, threads {torch.get_num_threads()}, follow-up = context + "
          f"{ANSWER_TOKENS} answered + {TURN_TOKENS} new tokens, median of {args.repeats}; "
          f"cache on = {on.prefix_cache_bytes / 2**20:g} MB")
    print("| context tokens | TTFT cache off ms | TTFT cache on ms | off / on | same output |")
    print("|---|---|---|---|---|")
    for v in verifiers.values():
        v.__enter__()
    try:
        for context in args.contexts:
            ttft: dict[str, list[float]] = {name: [] for name in verifiers}
            same = True
            for _ in range(args.repeats):
                history = torch.randint(low, high, (context,), generator=gen).tolist()
                turn = torch.randint(low, high, (TURN_TOKENS,), generator=gen).tolist()
                outputs = []
                for name, v in verifiers.items():
                    ms, tokens = follow_up_ttft(v.address, history, turn)
                    ttft[name].append(ms)
                    outputs.append(tokens)
                same &= outputs[0] == outputs[1]
            off, on_ms = statistics.median(ttft["off"]), statistics.median(ttft["on"])
            print(f"| {context} | {off:.0f} | {on_ms:.0f} | {off / on_ms:.1f}x | "
                  f"{'yes' if same else 'NO'} |", flush=True)
    finally:
        for v in verifiers.values():
            v.__exit__(None, None, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
