"""What the LM head and its log-softmax cost over a round's rows: the K + 1 rows a round needs
against the up to K + 1 + one 32-token block that vLLM prefills (and, asked for prompt
logprobs, scores) per round. The weight has the prepared target's shape; its values do not
change the time.

    python -m cloud_verifier.bench.lm_head_cost [--rows 5 37] [--repeats 50] [--threads 1]

Prints the median milliseconds per row count (docs/vllm-engine.md, candidate (c)).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

VOCAB, HIDDEN = 49152, 576  # SmolLM2-135M's head
WARMUP = 5


def head_ms(rows: int, repeats: int, weight: torch.Tensor) -> float:
    x = torch.randn(rows, weight.shape[1])
    times = []
    for _ in range(WARMUP + repeats):
        t0 = time.perf_counter()
        torch.log_softmax(x @ weight.T, dim=-1)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[WARMUP:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cloud_verifier.bench.lm_head_cost")
    p.add_argument("--rows", type=int, nargs="+", default=[5, 37])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    if min(args.rows) < 1 or args.repeats < 1 or args.threads < 1:
        raise SystemExit("lm_head_cost: --rows, --repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    weight = torch.randn(VOCAB, HIDDEN)
    for rows in args.rows:
        print(f"rows {rows}: {head_ms(rows, args.repeats, weight):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
