"""Why the verifier packs sessions without padding: a side-by-side timing.

    python -m cloud_verifier.bench.layout [--model PATH] [--batches 1 4 8 16] [--k 4]

For B sessions with different context lengths (64..320 tokens) and K drafts each, times one
verification step three ways on the same model, median of ``--repeats``:

- ``sequential``: one forward per session with its own transformers DynamicCache (what the
  foundation verifier did);
- ``padded``: one forward over a left-padded batch built by concatenating the sessions'
  caches (the usual way to batch Hugging Face models with different lengths);
- ``packed``: ``cloud_verifier.packed_forward`` (no padding, no cache copies).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache

from cloud_verifier.bench.verify_cost import context_lengths, prefilled_kvs
from cloud_verifier.packed_forward import Segment, packed_forward
from cloud_verifier.target_model import load_target


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _time_batch(target, b: int, k: int, repeats: int, gen: torch.Generator):
    model = target.model
    lengths = context_lengths(target, b, k + 1)
    contexts = [torch.randint(0, target.vocab_size, (n,), generator=gen).tolist()
                for n in lengths]
    new = [torch.randint(0, target.vocab_size, (k + 1,), generator=gen).tolist()
           for _ in range(b)]
    with torch.inference_mode():
        caches = []
        for ctx in contexts:
            cache = DynamicCache()
            model(input_ids=torch.tensor([ctx]), past_key_values=cache, use_cache=True)
            caches.append(cache)
    kvs = prefilled_kvs(target, contexts, k + 1)

    def sequential():
        with torch.inference_mode():
            for cache, c, x in zip(caches, contexts, new, strict=True):
                model(input_ids=torch.tensor([x]), past_key_values=cache, use_cache=True,
                      logits_to_keep=k + 1)
                cache.crop(len(c))

    def padded():
        longest = max(lengths)
        layers = []
        for layer in range(len(caches[0].layers)):
            ks, vs = [], []
            for cache, n in zip(caches, lengths, strict=True):
                pad = (0, 0, longest - n, 0)
                ks.append(torch.nn.functional.pad(cache.layers[layer].keys, pad))
                vs.append(torch.nn.functional.pad(cache.layers[layer].values, pad))
            layers.append((torch.cat(ks), torch.cat(vs)))
        batch_cache = DynamicCache.from_legacy_cache(tuple(layers))
        mask = torch.zeros(b, longest + k + 1, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, longest - n:] = 1
        positions = torch.tensor([[n + j for j in range(k + 1)] for n in lengths])
        with torch.inference_mode():
            model(input_ids=torch.tensor(new), attention_mask=mask, position_ids=positions,
                  past_key_values=batch_cache, use_cache=True, logits_to_keep=k + 1)

    def packed():
        packed_forward(model, [Segment(kv, x, k + 1) for kv, x in zip(kvs, new,
                                                                    strict=True)])

    return tuple(_median_ms(f, repeats) for f in (sequential, padded, packed))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    target = load_target(args.model)
    k = args.k
    gen = torch.Generator().manual_seed(0)
    print(f"target {target.name}, K={k}, threads {torch.get_num_threads()}")
    print("| sessions | sequential ms | padded ms | packed ms | packed vs sequential "
          "| packed vs padded |")
    print("|---|---|---|---|---|---|")
    for b in args.batches:
        seq, pad, pk = _time_batch(target, b, k, args.repeats, gen)
        print(f"| {b} | {seq:.0f} | {pad:.0f} | {pk:.0f} | {seq / pk:.2f}x | {pad / pk:.2f}x |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
