"""``gen-data --engine vllm``: the target continues a shard's prompts on vLLM, which batches
them continuously (a finished row's slot goes to the next prompt at once, where the built-in
path decodes left-padded batches until their longest row ends).

Each row records what the built-in path records: the generated tokens (EOS included when
reached) and, at every generated token, the top-k ids and log-probabilities of the target's
distribution at temperature 1. vLLM's ``raw_logprobs`` mode gives exactly that (the
log-softmax of the raw logits, before temperature), and ``flat_logprobs`` keeps them in flat
lists rather than one Python dict per position, which measured 1.5x the rows' throughput at
k = 64 on the 2-core VM. Sampled rows get a per-prompt vLLM seed, so a shard written again
with the same settings is the same shard where vLLM's sampling is deterministic (one engine
process, the same batch; vLLM does not promise it across batch compositions).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_client.tools.distill.shards import Sample

log = logging.getLogger("edgespec.distill")


@dataclass(frozen=True)
class VllmRow:
    """One prompt of a shard: its index in the prompt list, token ids, and greedy or sampled."""

    index: int
    ids: list[int]
    sampled: bool


def request_seed(seed: int, index: int) -> int:
    """The vLLM seed of a sampled prompt: a function of (run seed, prompt index) only."""
    return int(np.random.default_rng([seed, index, 7]).integers(2**31 - 1))


class VllmWriter:
    """vLLM started once on the target; ``generate`` writes one shard's rows. ``gen-prompts
    --engine vllm`` (module ``magpie_vllm``) samples its turns on the same object."""

    def __init__(self, llm: Any, max_context: int, eos: set[int]) -> None:
        self.llm = llm
        self.max_context = max_context
        self.eos = sorted(eos)

    @classmethod
    def start(cls, target: Path | None, dtype: str, threads: int) -> VllmWriter:
        from cloud_verifier.target_model import load_target_metadata, target_checkpoint
        from cloud_verifier.vllm_engine import VllmSettings, start_llm

        meta = load_target_metadata(target)
        # Sampled rows carry seeds: no chunked prefill (VllmSettings.chunked_prefill says why)
        llm = start_llm(target_checkpoint(target)[0], meta.max_context,
                        VllmSettings(dtype=dtype, threads=threads or None,
                                     chunked_prefill=False))
        return cls(llm, meta.max_context, set(meta.eos_token_ids))

    def generate(self, rows: list[VllmRow], max_new_tokens: int, top_k: int,
                 temperature: float, seed: int) -> list[Sample]:
        from vllm.inputs import TokensPrompt

        params = [self.params(r.ids, max_new_tokens, temperature if r.sampled else 0.0,
                              request_seed(seed, r.index), self.eos, name=f"prompt {r.index}",
                              logprobs=top_k, flat_logprobs=True) for r in rows]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=r.ids) for r in rows],
                                    params, use_tqdm=False)
        return [_sample(r, out.outputs[0], top_k) for r, out in zip(rows, outputs, strict=True)]

    def label(self, samples: list[Sample], top_k: int) -> list[Sample]:
        """The rows again with p's top-k at every generated token, teacher-forced: one
        prefill of prompt + continuation each, read from vLLM's prompt logprobs (entry j is
        the distribution that decided token j, so the continuation's entries are p's at the
        generated tokens). What a corpus restore labels with (``corpus_archive``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seqs = [np.concatenate([s.prompt_ids, s.gen_ids]).astype(np.int64).tolist()
                for s in samples]
        for s, seq in zip(samples, seqs, strict=True):
            if len(seq) >= self.max_context or not len(s.prompt_ids):
                raise ValueError(f"a row of {len(seq)} tokens ({len(s.prompt_ids)} of prompt) "
                                 f"cannot be labelled under the context of {self.max_context}")
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k,
                                flat_logprobs=True, detokenize=False)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=x) for x in seqs], params,
                                    use_tqdm=False)
        out = []
        for s, o in zip(samples, outputs, strict=True):
            p, g = len(s.prompt_ids), len(s.gen_ids)
            ids, logp = top_k_rows(o.prompt_logprobs[p:p + g], g, top_k)
            out.append(Sample(s.prompt_ids, s.gen_ids, ids, logp, s.sampled))
        return out

    def params(self, ids: list[int], max_new_tokens: int, temperature: float, seed: int,
               stop: list[int], name: str = "a prompt", **extra: Any) -> Any:
        """vLLM's sampling parameters for one token-id prompt: up to ``max_new_tokens`` (less
        where the context ends), ``seed`` only when sampled (greedy needs none), stopped by
        the ``stop`` ids, which come back in the token ids; token ids only, no text."""
        from vllm import SamplingParams

        room = self.max_context - len(ids)
        if room < 1:
            raise ValueError(f"{name} has {len(ids)} tokens, no room under the context of "
                             f"{self.max_context}")
        return SamplingParams(
            max_tokens=min(max_new_tokens, room), temperature=temperature,
            seed=seed if temperature > 0 else None, stop_token_ids=list(stop),
            ignore_eos=False, detokenize=False, skip_special_tokens=False, **extra)


def _sample(row: VllmRow, completion: Any, top_k: int) -> Sample:
    gen = np.asarray(completion.token_ids, dtype=np.int64)
    ids, logp = top_k_rows(completion.logprobs, len(gen), top_k)
    return Sample(np.asarray(row.ids), gen, ids, logp, row.sampled)


def top_k_rows(flat: Any, positions: int, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """[positions, k] ids and float16 log p, descending, from vLLM's flat logprobs. A position
    holds the chosen token's entry first (vLLM always returns it), then the top k by rank, so
    the chosen token comes twice when it is among the top k and once more, below rank k,
    when it is not: both are dropped here."""
    if len(flat.start_indices) != positions:
        raise RuntimeError(f"vLLM returned logprobs for {len(flat.start_indices)} of "
                           f"{positions} positions")
    ids = np.empty((positions, top_k), dtype=np.int64)
    logp = np.empty((positions, top_k), dtype=np.float32)
    token_ids, values, ranks = flat.token_ids, flat.logprobs, flat.ranks
    for j, (a, b) in enumerate(zip(flat.start_indices, flat.end_indices, strict=True)):
        entries = {token_ids[i]: (ranks[i], values[i]) for i in range(a, b)}
        ranked = sorted((rank, -value, tid) for tid, (rank, value) in entries.items()
                        if rank is not None and rank <= top_k)
        if len(ranked) < top_k:  # ties may share a rank, so more than k can come
            raise RuntimeError(f"vLLM returned {len(ranked)} of the top {top_k} at "
                               f"position {j}")
        ranked = ranked[:top_k]
        ids[j] = [t for _, _, t in ranked]
        logp[j] = [-v for _, v, _ in ranked]
    return ids, logp.astype(np.float16)
