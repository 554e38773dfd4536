"""``edgespec-bench acceptance``: how much of each drafter's output the target accepts.

Everything runs in one process, without gRPC: the target in PyTorch behind the verifier's own
``VerifierEngine`` and ``SessionStore`` (the same math and cache rollback as the server), the
draft through onnxruntime inside the edge's own drafters (``make_drafter``: model, ngram,
combined). It runs two prompt sets (``acceptance_sets``), realistic first: ``realistic``, the
hand-written eval set that no training data is drawn from (``edge_client.bench.eval_set``), by
category and overall, and ``heldout``, the distillation's templated held-out split, kept for
continuity under the report's original top-level keys. On each set it reports, per drafter:

- alpha, the per-token acceptance: accepted / judged drafts, where a round judges its drafts up
  to and including the first rejection (drafts after it are never looked at), greedy and at
  temperature 0.7 / top-p 0.95 with the sparse truncated q the edge sends;
- acceptance by draft position i = 1..K: accepted / judged among the drafts at position i;
- mean tokens per round for K = 1..8, greedy, computed exactly by replay: with the target's
  greedy path known, a greedy round is a prefix comparison, so each K replays the drafter's
  proposals against that path without running the target again. The model draft's greedy
  proposals along the path are its argmaxes in one trace of the path (``PathDrafter``), so
  the replay runs no model either. The measured rounds at ``--draft-len`` check the replay.

The measured rounds of the six generations of a prompt (three drafters, greedy and sampled)
are verified together, one packed forward per step, as the server batches sessions.

and for the model draft: its per-token step latency next to the target's (medians, same
machine), and KL(p || q) and TV(p, q) between the target's and the draft's next-token
distributions along the target's greedy path (raw softmax; TV also under the sampling settings
above, where 1 - TV is the expected acceptance of one draft token).

For the realistic set, each category's and the overall headline (``acceptance_sets.headline``)
are greedy alpha, alpha at T = 0.7, greedy tokens per round at K = 4, and target forwards per
token at K = 4: each round costs the target one verification forward (the prompt's prefill
aside), so forwards per committed token = rounds / tokens committed = 1 / tokens per round
(1.0 without a draft). Overall figures pool the counts of all prompts (not category means).

An offline tool: it imports torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from edge_client.bench.acceptance_sets import (
    BenchPrompt,
    encode_eval,
    encode_prompts,
    format_report,
    load_heldout_prompts,
    load_realistic,
    ordered_sets,
    realistic_report,
)

log = logging.getLogger(__name__)

SAMPLED_TEMPERATURE = 0.7
SAMPLED_TOP_P = 0.95
MAX_SUPPORT = 64  # the client's default cap on q's support
REPLAY_KS = tuple(range(1, 9))
DRAFTERS = ("model", "ngram", "combined")
MODES = ("greedy", "sampled")


@dataclass
class Tally:
    """Acceptance counts of one drafter in one mode, over all prompts."""

    k: int
    rounds: int = 0
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    empty_rounds: int = 0  # rounds where the drafter was asked for drafts and proposed none
    propose_s: list[float] = field(default_factory=list)
    judged_at: list[int] = field(default_factory=list)  # [K]
    accepted_at: list[int] = field(default_factory=list)  # [K]

    def __post_init__(self) -> None:
        self.judged_at = [0] * self.k
        self.accepted_at = [0] * self.k

    def add(self, asked: int, drafted: int, accepted: int, emitted: int,
            propose_s: float) -> None:
        self.rounds += 1
        self.new_tokens += emitted
        self.drafted += drafted
        self.accepted += accepted
        self.empty_rounds += asked > 0 and drafted == 0
        self.propose_s.append(propose_s)
        for i in range(min(accepted + 1, drafted)):
            self.judged_at[i] += 1
            self.accepted_at[i] += i < accepted

    def __iadd__(self, other: Tally) -> Tally:
        self.rounds += other.rounds
        self.new_tokens += other.new_tokens
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.empty_rounds += other.empty_rounds
        self.propose_s += other.propose_s
        self.judged_at = [a + b for a, b in zip(self.judged_at, other.judged_at, strict=True)]
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at,
                                                  strict=True)]
        return self

    def summary(self) -> dict:
        judged = sum(self.judged_at)
        return {
            "alpha": _ratio(self.accepted, judged),
            "accepted": self.accepted,
            "judged": judged,
            "drafted": self.drafted,
            "acceptance_rate": _ratio(self.accepted, self.drafted),  # the client's statistic
            "rounds": self.rounds,
            "rounds_without_proposal": self.empty_rounds,
            "new_tokens": self.new_tokens,
            "tokens_per_round": _ratio(self.new_tokens, self.rounds),
            "propose_ms_median": (1e3 * statistics.median(self.propose_s)
                                  if self.propose_s else None),
            "by_position": [
                {"position": i + 1, "judged": j, "accepted": a, "alpha": _ratio(a, j)}
                for i, (j, a) in enumerate(zip(self.judged_at, self.accepted_at, strict=True))],
        }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def target_greedy_path(target, prompt: list[int], max_new_tokens: int,
                       stop_ids: frozenset[int], features: list | None = None,
                       ) -> tuple[list[int], torch.Tensor, list[float]]:
    """The target's greedy continuation, one cached step per token.

    Returns (path [n], logits [n, V] float32 where row t is the distribution of path[t],
    seconds of each 1-token step after the prefill). With ``features`` (a list), appends
    row t's final hidden state (after the final norm: what the LM head read to decide
    path[t]), float32 [H] numpy, for the feature head's evaluation.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    feed, path, rows, steps = list(prompt), [], [], []
    captured: list[torch.Tensor] = []
    hook = None
    if features is not None:
        hook = target.model.model.norm.register_forward_hook(
            lambda _m, _i, out: captured.append(out[0, -1].detach()))
    try:
        for step in range(max_new_tokens):
            ids = torch.tensor([feed], dtype=torch.long, device=target.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                out = target.model(input_ids=ids, past_key_values=cache, use_cache=True,
                                   logits_to_keep=1)
            row = out.logits[0, -1].float().cpu()  # [V]
            if step > 0:
                steps.append(time.perf_counter() - t0)
            token = int(row.argmax())
            path.append(token)
            rows.append(row)
            if token in stop_ids:
                break
            feed = [token]
    finally:
        if hook is not None:
            hook.remove()
    if features is not None:
        features.extend(f.float().cpu().numpy() for f in captured)
    return path, torch.stack(rows), steps


def draft_trace(model, prompt: list[int], path: list[int]) -> tuple[np.ndarray, list[float]]:
    """The ONNX draft's logits along ``path`` (row t predicts path[t]), and the seconds of each
    1-token step after the prefill: the forward the drafter runs (``forward_compact``, the
    draft's own columns), whose row is then widened to the full vocabulary (-inf elsewhere,
    as ``forward`` gives it) outside the timing."""
    cache = model.new_cache()
    rows = [model.forward(cache, prompt)[-1]]
    steps = []
    for token in path[:-1]:
        t0 = time.perf_counter()
        compact, vocab = model.forward_compact(cache, [token])
        steps.append(time.perf_counter() - t0)
        row = np.full(model.vocab_size, -np.inf, dtype=np.float32)
        row[vocab] = compact[-1]
        rows.append(row)
    return np.stack(rows), steps  # [n, V]


def distances(target_logits: torch.Tensor, draft_logits: np.ndarray) -> dict[str, list[float]]:
    """Per position: KL(p || q) and TV(p, q) of the raw softmaxes; TV under the sampled mode's
    shaping (q truncated exactly as the edge samples it); the acceptance a sampled draft would
    get verified as a point mass, sum_x q(x) p(x) (p(d) for d ~ q: what a verifier that
    ignores q, such as vLLM's rejection sampler without draft probabilities, accepts), against
    1 - TV exactly; whether the argmaxes agree."""
    from cloud_verifier.sampling import SamplingParams, target_probs
    from edge_client.sampling import truncated_distribution

    p_log = torch.log_softmax(target_logits.double(), dim=-1)  # [n, V]
    q_log = torch.log_softmax(torch.from_numpy(draft_logits).double(), dim=-1)  # [n, V]
    p, q = p_log.exp(), q_log.exp()
    kl = (p * (p_log - q_log)).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    p_s = target_probs(target_logits, SamplingParams(SAMPLED_TEMPERATURE, 0, SAMPLED_TOP_P))
    tv_s, point_mass = [], []
    for t in range(draft_logits.shape[0]):
        ids, probs = truncated_distribution(draft_logits[t], SAMPLED_TEMPERATURE, 0,
                                            SAMPLED_TOP_P, MAX_SUPPORT)
        q_s = torch.zeros_like(p_s[t], dtype=torch.float64)
        q_s[torch.from_numpy(ids)] = torch.from_numpy(probs).double()
        tv_s.append(0.5 * float((p_s[t].double() - q_s).abs().sum()))
        point_mass.append(float((p_s[t].double() * q_s).sum()))
    agree = (target_logits.argmax(-1) == torch.from_numpy(draft_logits).argmax(-1)).double()
    return {"kl": kl.tolist(), "tv": tv.tolist(), "tv_sampled": tv_s,
            "point_mass_sampled": point_mass, "agree": agree.tolist()}


def run_together(engine, store, prompt: list[int], runs: list[tuple[object, object]], k: int,
                 max_new_tokens: int, stop_ids: frozenset[int], tallies: list[Tally]
                 ) -> list[list[int]]:
    """Generations of one prompt, one per (drafter, SamplingParams), each as the client runs
    it, against the verifier's engine in-process. Their rounds are verified together, one
    packed forward per step: the engine's batched results equal sessions run alone."""
    from cloud_verifier.target_engine import DraftRound

    sessions = [store.create("bench", params, prompt, max_new_tokens, stop_ids)
                for _, params in runs]
    committed = [list(prompt) for _ in runs]
    live = list(range(len(runs)))
    try:
        while live:
            batch, asked = [], []
            for i in live:
                remaining = max_new_tokens - (len(committed[i]) - len(prompt))
                room = engine.max_context - len(committed[i]) - 1
                kk = max(0, min(k, remaining - 1, room))  # the client's cap (Generation._propose)
                t0 = time.perf_counter()
                proposal = runs[i][0].propose(committed[i], kk)
                propose_s = time.perf_counter() - t0
                q = None if proposal.q is None else [
                    (ids.tolist(), probs.tolist()) for ids, probs in proposal.q]
                batch.append((sessions[i], DraftRound(list(proposal.tokens), q)))
                asked.append((kk, len(proposal.tokens), propose_s))
            outcomes = engine.run_batch(batch)
            for i, outcome, (kk, drafted, propose_s) in zip(live, outcomes, asked, strict=True):
                if isinstance(outcome, Exception):
                    raise outcome
                committed[i].extend(outcome.committed)
                tallies[i].add(kk, drafted, outcome.num_accepted, len(outcome.committed),
                               propose_s)
            live = [i for i, o in zip(live, outcomes, strict=True) if not o.finished]
    finally:
        for session in sessions:
            store.close(session.id)
    return [c[len(prompt):] for c in committed]


class PathDrafter:
    """The model draft's greedy proposals along the target's greedy path, read from its
    logits along that path (``draft_trace``) instead of being recomputed.

    While a greedy draft agrees with the path, its next input is the path's next token, so
    its proposals there are exactly the trace's argmaxes; at the first disagreement the round
    is decided, and what the draft would propose after it is never judged (the proposal stops
    there). Used only to replay greedy rounds.
    """

    def __init__(self, prompt_len: int, path: list[int], draft_argmax: np.ndarray,
                 lookup=None) -> None:
        self.prompt_len = prompt_len
        self.path = path
        self.argmax = draft_argmax  # [n]: the draft's choice for path[t]
        self.lookup = lookup  # the combined drafter's per-position lookup, asked first

    def resync(self, committed: list[int]) -> int:
        return len(committed)

    def propose(self, committed: list[int], k: int):
        from edge_client.drafter import Proposal

        t = len(committed) - self.prompt_len
        tokens: list[int] = []
        while len(tokens) < k and t + len(tokens) < len(self.path):
            hit = None if self.lookup is None else self.lookup(committed + tokens)
            tokens.append(int(self.argmax[t + len(tokens)]) if hit is None else hit[0])
            if tokens[-1] != self.path[t + len(tokens) - 1]:
                break
        return Proposal(tokens, None)


@dataclass
class ReplayCount:
    """Greedy rounds of one drafter at one K. A *full* round is one with at least K + 1 tokens
    of the target's path left: the client asked for all K drafts and neither the token limit
    nor the end of the text could cut what it emits, so its tokens per round is the
    steady-state figure (1 - a^(K+1)) / (1 - a) predicts, which a short generation's last
    rounds pull down."""

    rounds: int = 0
    full_rounds: int = 0
    full_tokens: int = 0

    def __iadd__(self, other: ReplayCount) -> ReplayCount:
        self.rounds += other.rounds
        self.full_rounds += other.full_rounds
        self.full_tokens += other.full_tokens
        return self


def replay_greedy_rounds(drafter, prompt: list[int], path: list[int], k: int,
                         max_new_tokens: int) -> ReplayCount:
    """The rounds a greedy generation of ``path`` takes with drafts of length k.

    Greedy verification accepts the longest prefix of the drafts that equals the target's
    own continuation, then emits the target's next token, so no target forward is needed.
    """
    committed, t, count = list(prompt), 0, ReplayCount()
    while t < len(path):
        kk = max(0, min(k, max_new_tokens - t - 1))
        full = len(path) - t >= k + 1  # (len(path) <= max_new_tokens, so kk == k too)
        drafts = drafter.propose(committed, kk).tokens
        n = 0
        while n < len(drafts) and t + n < len(path) and drafts[n] == path[t + n]:
            n += 1
        emitted = min(n + 1, len(path) - t)
        committed.extend(path[t:t + emitted])
        t += emitted
        count.rounds += 1
        count.full_rounds += full
        count.full_tokens += emitted if full else 0
    return count


# --------------------------------------------------------------------------------------------
# The benchmark
# --------------------------------------------------------------------------------------------


class Accumulator:
    """The benchmark's counts over a group of prompts; ``+=`` pools two groups."""

    def __init__(self, draft_len: int) -> None:
        self.tallies = {(d, mode): Tally(draft_len) for d in DRAFTERS for mode in MODES}
        self.replay = {(d, k): ReplayCount() for d in DRAFTERS for k in REPLAY_KS}
        self.identical = dict.fromkeys(DRAFTERS, 0)
        self.lookup_drafts = dict.fromkeys(MODES, 0)  # combined: drafts the lookup made
        self.dist: dict[str, list[float]] = {"kl": [], "tv": [], "tv_sampled": [],
                                             "point_mass_sampled": [], "agree": []}
        self.draft_steps: list[float] = []
        self.target_steps: list[float] = []
        self.path_tokens = 0

    def __iadd__(self, other: Accumulator) -> Accumulator:
        for key, tally in other.tallies.items():
            self.tallies[key] += tally
        for key, count in other.replay.items():
            self.replay[key] += count
        for kind in DRAFTERS:
            self.identical[kind] += other.identical[kind]
        for mode in MODES:
            self.lookup_drafts[mode] += other.lookup_drafts[mode]
        for key, values in other.dist.items():
            self.dist[key] += values
        self.draft_steps += other.draft_steps
        self.target_steps += other.target_steps
        self.path_tokens += other.path_tokens
        return self

    def summary(self) -> dict:
        drafters = {}
        for kind in DRAFTERS:
            entry = {mode: self.tallies[kind, mode].summary() for mode in MODES}
            entry["greedy"]["identical_to_target"] = self.identical[kind]
            entry["greedy_tokens_per_round_by_k"] = {
                str(k): _ratio(self.path_tokens, self.replay[kind, k].rounds) for k in REPLAY_KS}
            entry["greedy_tokens_per_full_round_by_k"] = {
                str(k): _ratio(self.replay[kind, k].full_tokens, self.replay[kind, k].full_rounds)
                for k in REPLAY_KS}
            if kind == "combined":
                for mode in MODES:
                    entry[mode]["lookup_draft_share"] = _ratio(self.lookup_drafts[mode],
                                                               self.tallies[kind, mode].drafted)
            drafters[kind] = entry

        draft_ms = 1e3 * statistics.median(self.draft_steps) if self.draft_steps else None
        target_ms = 1e3 * statistics.median(self.target_steps) if self.target_steps else None
        tv_sampled = _mean(self.dist["tv_sampled"])
        return {
            "drafters": drafters,
            "latency": {
                "draft_step_ms_median": draft_ms,
                "target_step_ms_median": target_ms,
                "draft_over_target": (draft_ms / target_ms) if draft_ms and target_ms else None,
                "draft_steps": len(self.draft_steps),
                "target_steps": len(self.target_steps),
            },
            "model_vs_target": {
                "positions": len(self.dist["kl"]),
                "kl_target_draft_mean": _mean(self.dist["kl"]),
                "tv_mean": _mean(self.dist["tv"]),
                "tv_sampled_mean": tv_sampled,
                "expected_sampled_alpha": None if tv_sampled is None else 1 - tv_sampled,
                "expected_sampled_alpha_point_mass": _mean(self.dist["point_mass_sampled"]),
                "greedy_top1_agreement": _mean(self.dist["agree"]),
            },
            "path_tokens": self.path_tokens,
        }


class Bench:
    """The target, the draft and the verifier's engine, set up once; ``run`` measures one
    prompt."""

    def __init__(self, target, draft_dir: Path, max_new_tokens: int, draft_len: int,
                 threads: int | None = None) -> None:
        from cloud_verifier.engine import VerifierEngine
        from cloud_verifier.sessions import SessionStore
        from edge_client.draft_model import OnnxDraftModel
        from edge_client.drafter import DraftSampling

        self.model = OnnxDraftModel(draft_dir, intra_op_threads=threads)
        if self.model.vocab_size != target.vocab_size:
            raise ValueError(f"the draft outputs {self.model.vocab_size} logits, the target "
                             f"{target.vocab_size}")
        self.target = target
        self.engine = VerifierEngine(target.model, target.vocab_size, target.max_context)
        self.store = SessionStore(max_sessions=2 * len(DRAFTERS), ttl_s=3600.0)
        self.stop_ids = frozenset(target.eos_token_ids)
        self.max_new_tokens, self.draft_len = max_new_tokens, draft_len
        self.sampling = {"greedy": DraftSampling(),
                         "sampled": DraftSampling(SAMPLED_TEMPERATURE, 0, SAMPLED_TOP_P,
                                                  MAX_SUPPORT)}

    def run(self, index: int, ids: list[int]) -> Accumulator:
        """One prompt: the target's greedy path, the draft's trace of it, the six measured
        generations (seeded by ``index``) and the greedy replays at every K."""
        from cloud_verifier.sampling import SamplingParams
        from edge_client.combined_drafter import make_drafter
        from edge_client.ngram_drafter import ContextLookup, NgramDrafter

        acc, n_new = Accumulator(self.draft_len), self.max_new_tokens
        path, target_logits, acc.target_steps = target_greedy_path(self.target, ids, n_new,
                                                                   self.stop_ids)
        acc.path_tokens = len(path)
        draft_logits, acc.draft_steps = draft_trace(self.model, ids, path)
        for key, values in distances(target_logits, draft_logits).items():
            acc.dist[key] += values

        params = {"greedy": SamplingParams(seed=index),
                  "sampled": SamplingParams(SAMPLED_TEMPERATURE, 0, SAMPLED_TOP_P, seed=index)}
        runs, keys = [], []
        for kind in DRAFTERS:
            for mode in MODES:
                runs.append((make_drafter(kind, self.model, self.sampling[mode],
                                          np.random.default_rng(index)), params[mode]))
                keys.append((kind, mode))
        outs = run_together(self.engine, self.store, ids, runs, self.draft_len, n_new,
                            self.stop_ids, [acc.tallies[key] for key in keys])
        for (kind, mode), (drafter, _), out in zip(keys, runs, outs, strict=True):
            if mode == "greedy":
                acc.identical[kind] += out == path
            if kind == "combined":
                acc.lookup_drafts[mode] += drafter.lookup.proposed

        draft_argmax = draft_logits.argmax(-1)
        for kind in DRAFTERS:
            for k in REPLAY_KS:
                drafter = {"model": PathDrafter(len(ids), path, draft_argmax),
                           "ngram": NgramDrafter(),
                           "combined": PathDrafter(len(ids), path, draft_argmax,
                                                   ContextLookup())}[kind]
                acc.replay[kind, k] += replay_greedy_rounds(drafter, ids, path, k, n_new)
        return acc


def measure_prompts(bench: Bench, prompts: list[BenchPrompt], label: str
                    ) -> tuple[dict[str, Accumulator], Accumulator]:
    """(category -> its prompts' counts, in first-seen order; all prompts' counts pooled).
    Prompt i runs with seed i, so a set measures the same whatever else runs beside it."""
    by_category: dict[str, Accumulator] = {}
    total = Accumulator(bench.draft_len)
    for index, prompt in enumerate(prompts):
        log.info("%s prompt %d/%d (%s, %d tokens)", label, index + 1, len(prompts),
                 prompt.category, len(prompt.ids))
        one = bench.run(index, prompt.ids)
        by_category.setdefault(prompt.category, Accumulator(bench.draft_len))
        by_category[prompt.category] += one
        total += one
    return by_category, total


def run_bench_acceptance(args: argparse.Namespace) -> int:
    import onnxruntime

    from cloud_verifier.target_model import load_target
    from edge_client.tokenizer import EdgeTokenizer
    from shared.paths import default_draft_dir

    log.setLevel(logging.INFO)  # progress of a long run, whatever --log-level says
    if not 1 <= args.draft_len <= 64 or args.max_new_tokens < 1:
        raise SystemExit("--draft-len must be in [1, 64] and --max-new-tokens >= 1")
    sets = ordered_sets(getattr(args, "sets", None) or ("realistic", "heldout"))
    per_category = args.prompts
    heldout_limit = getattr(args, "heldout_prompts", None)
    heldout_limit = args.prompts if heldout_limit is None else heldout_limit
    if any(n is not None and n < 1 for n in (per_category, heldout_limit)):
        raise SystemExit("--prompts and --heldout-prompts must be >= 1")
    draft_dir = args.draft_dir or default_draft_dir()
    target = load_target(args.target)
    tokenizer = EdgeTokenizer(draft_dir)
    max_prompt = target.max_context - args.max_new_tokens - max(REPLAY_KS) - 1
    realistic = heldout = None
    if "realistic" in sets:
        evals, _ = load_realistic(per_category)
        realistic = encode_eval(tokenizer, evals, max_prompt)
    if "heldout" in sets:
        texts, source = load_heldout_prompts(heldout_limit)
        if not texts:
            raise SystemExit(f"no prompts in {source}")
        heldout = encode_prompts(tokenizer, texts, max_prompt)

    t0 = time.perf_counter()
    torch_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        bench = Bench(target, draft_dir, args.max_new_tokens, args.draft_len, args.threads)
        if realistic is not None:
            by_category, overall = measure_prompts(bench, realistic, "realistic")
        if heldout is not None:
            _, total = measure_prompts(bench, heldout, "held-out")
        threads_used = torch.get_num_threads()
    finally:
        torch.set_num_threads(torch_threads)
    config = {"sets": sets}
    if heldout is not None:
        config |= {"prompts": len(heldout), "prompt_source": source,
                   "prompt_kinds": dict(Counter(kind for _, _, kind in texts)),
                   "prompts_truncated": sum(p.truncated for p in heldout)}
    config |= {
        "max_new_tokens": args.max_new_tokens, "draft_len": args.draft_len,
        "target": target.name, "draft_dir": str(draft_dir),
        "sampled": {"temperature": SAMPLED_TEMPERATURE, "top_p": SAMPLED_TOP_P,
                    "top_k": 0, "max_support": MAX_SUPPORT},
        "tokens_per_round_by_k_method": "exact greedy replay against the target's path",
        "tokens_per_full_round_by_k_method": "the same replay, only rounds with at least "
                                             "K + 1 path tokens left (steady state)",
    }
    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "torch_threads": threads_used,
                    "onnxruntime_threads": args.threads or "default",
                    "device": str(target.device),
                    "torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
        "config": config,
    }
    if realistic is not None:
        report["realistic"] = realistic_report(
            per_category, realistic, {c: a.summary() for c, a in by_category.items()},
            overall.summary())
    if heldout is not None:
        report |= total.summary()  # the held-out split under the report's original keys
    report["wall_s"] = time.perf_counter() - t0
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2))
    print(format_report(report))
    return 0
