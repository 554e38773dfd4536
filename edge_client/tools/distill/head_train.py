"""``train-head``: the feature head (``head_model``) on ``gen-data --features`` data, trained
as it is used.

Every step draws ``batch_size`` chain starts uniformly over all positions of the data: a start
is a generated token g_a with the feature that decided it, f = ``Sample.features[a]``. The
chain runs ``chain_len`` steps unrolled: step 1 reads (the wire's round trip of f, g_a), every
later
step reads the head's own previous predicted feature and the next teacher token
(g_{a+1}, ...: the target's own tokens), as on the edge, where the first steps may be known
tokens replayed (a feature a round late) and the rest are drafts. Gradients flow through the
whole chain. Loss, averaged over the chain steps that exist (a chain is cut at the end of
its sample):

    KL(p_topk || q) + tv_weight * TV(p_topk, q)    (``train.distill_loss``, p restricted to
                                                    the sub-vocabulary and renormalised)
    + feature_weight * smooth L1(f^, the true next feature)

Batches are a function of (seed, step) alone, so a run resumed from ``<run>/ckpt.pt`` lands
on the same weights as one that never stopped. Held-out: ``head_eval.evaluate_torch`` every
``eval_every`` steps (teacher-forced greedy alpha, K=4).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from edge_client.tools.distill.common import (
    append_jsonl,
    as_dirs,
    default_target,
    jsonable,
    special_ids,
    target_vocab_size,
    write_json,
)
from edge_client.tools.distill.head_context import (
    context_loss,
    context_sequences,
    evaluate_context,
    make_context_batch,
)
from edge_client.tools.distill.head_eval import evaluate_torch
from edge_client.tools.distill.head_layers import load_layer_features
from edge_client.tools.distill.head_model import (
    HeadArch,
    TargetShape,
    build_head,
    head_arch_from_json,
    legacy_codec,
    save_run_meta,
    wire_round_trip,
)
from edge_client.tools.distill.shards import Sample, heldout_samples, list_shards, load_samples
from edge_client.tools.distill.train import _lr_at, _StopFlag, distill_loss
from edge_client.tools.distill.vocab import VOCAB_MAP_FILE, VocabMap, build_vocab_map
from shared.feature_codec import DEFAULT_CODEC, codec_named

log = logging.getLogger("edgespec.distill")


@dataclass(frozen=True)
class HeadTrainConfig:
    run_dir: Path
    data: Path | Sequence[Path]  # gen-data --features directories, read together
    heldout: Path | None
    target: Path | None
    arch: HeadArch = field(default_factory=HeadArch)
    steps: int = 2000
    batch_size: int = 32  # chains per step
    chain_len: int = 6  # unrolled steps per chain (a K=4 draft after up to 2 replayed tokens)
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    tv_weight: float = 1.0
    feature_weight: float = 1.0
    seed: int = 0
    ckpt_every_s: float = 300.0
    ckpt_every_steps: int = 0
    eval_every: int = 200
    eval_samples: int = 64
    threads: int = 0
    log_every: int = 10
    lr_steps: int = 0  # the cosine's horizon; 0: ``steps``
    # The wire form the verifier sends (shared.feature_codec); fixed at a run's start.
    feature_codec: str = DEFAULT_CODEC
    # A context head (``head_context``): whole sequences, ``passes`` unrolled draft steps,
    # ``batch_size`` sequences of at most ``max_len`` pairs per step. Fixed at a run's start.
    context: bool = False
    passes: int = 3
    max_len: int = 256


@dataclass
class ChainBatch:
    ids: object  # torch.LongTensor [B, L] draft ids of g_a .. g_{a+L-1}
    start_features: object  # [B, H] features[a] (true, before the wire's round trip)
    target_features: object  # [B, L, H] features[a+1 .. a+L]
    teacher_ids: object  # [B, L, k] head output indices (0 where invalid)
    teacher_p: object  # [B, L, k] p over in-subset ids, renormalised; 0 where invalid
    valid: object  # [B, L] bool: the step exists (a+step <= G-1)


class ChainIndex:
    """Every chain start (sample i, a) with a in [0, G-2], flat."""

    def __init__(self, samples: Sequence[Sample]) -> None:
        counts = np.array([max(0, len(s.gen_ids) - 1) for s in samples], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.total = int(self.offsets[-1])

    def draw(self, rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
        flat = rng.integers(0, self.total, size=n)
        sample = np.searchsorted(self.offsets, flat, side="right") - 1
        return [(int(i), int(f - self.offsets[i])) for i, f in zip(sample, flat, strict=True)]


def make_chain_batch(samples: Sequence[Sample], starts: Sequence[tuple[int, int]],
                     chain_len: int, full_to_sub: np.ndarray,
                     full_to_head: np.ndarray) -> ChainBatch:
    import torch

    b, L = len(starts), chain_len
    hidden = samples[starts[0][0]].features.shape[1]
    k = samples[starts[0][0]].topk_ids.shape[1]
    ids = np.zeros((b, L), dtype=np.int64)
    f0 = np.zeros((b, hidden), dtype=np.float32)
    tf = np.zeros((b, L, hidden), dtype=np.float32)
    t_ids = np.zeros((b, L, k), dtype=np.int64)
    t_p = np.zeros((b, L, k), dtype=np.float32)
    valid = np.zeros((b, L), dtype=bool)
    for r, (i, a) in enumerate(starts):
        s = samples[i]
        n = min(L, len(s.gen_ids) - 1 - a)  # steps whose next token exists
        ids[r, :n] = full_to_sub[s.gen_ids[a : a + n].astype(np.int64)]
        f0[r] = s.features[a]
        tf[r, :n] = s.features[a + 1 : a + 1 + n]
        head = full_to_head[s.topk_ids[a + 1 : a + 1 + n]]  # [n, k]
        ok = head >= 0  # p's mass outside the subset is out of q's reach anyway
        p = np.exp(s.topk_logp[a + 1 : a + 1 + n].astype(np.float32)) * ok
        t_p[r, :n] = p / np.maximum(p.sum(-1, keepdims=True), 1e-12)
        t_ids[r, :n] = np.where(ok, head, 0)
        valid[r, :n] = True
    return ChainBatch(*(torch.from_numpy(x) for x in (ids, f0, tf, t_ids, t_p, valid)))


def chain_loss(head, batch: ChainBatch, tv_weight: float, feature_weight: float, codec: str):
    """-> (loss, {"kl", "tv", "feature"} detached), means over the valid chain steps."""
    import torch

    feat = wire_round_trip(batch.start_features, codec)
    past_k, past_v = head.empty_cache(batch.ids.shape[0])
    logits, preds = [], []
    for j in range(batch.ids.shape[1]):
        out, feat, past_k, past_v = head(batch.ids[:, j : j + 1], feat[:, None], past_k, past_v)
        feat = feat[:, 0]
        logits.append(out[:, 0])
        preds.append(feat)
    valid = batch.valid
    logits = torch.stack(logits, 1)[valid]  # [N, M]
    preds = torch.stack(preds, 1)[valid]  # [N, H]
    dist, kl, tv = distill_loss(logits, batch.teacher_ids[valid], batch.teacher_p[valid],
                                tv_weight)
    feature = torch.nn.functional.smooth_l1_loss(preds, batch.target_features[valid])
    loss = dist + feature_weight * feature
    return loss, {"kl": float(kl), "tv": float(tv), "feature": float(feature.detach())}


def _feature_samples(data_dirs: Sequence[Path], shards: Sequence[str]) -> list[Sample]:
    samples = load_samples([Path(p) for p in shards])
    if any(s.features is None for s in samples):
        raise ValueError(f"{', '.join(map(str, data_dirs))}: shards without features; "
                         "train-head needs gen-data --features")
    return samples


def train_head(cfg: HeadTrainConfig) -> dict:
    """Train until ``cfg.steps``, resuming from ``<run_dir>/ckpt.pt`` when it exists."""
    import torch

    if cfg.arch.feature_layers and not cfg.context:
        raise ValueError("--feature-layers needs --context: chain heads read f_j alone")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    ckpt_path, run_json = run / "ckpt.pt", run / "run.json"
    data_dirs = as_dirs(cfg.data)

    state = {"step": 0, "wall_s": 0.0, "chain_steps_seen": 0, "shards": None}
    ck = torch.load(ckpt_path, map_location="cpu", weights_only=False) \
        if ckpt_path.exists() else None
    if ck is not None:
        state = ck["state"]
    if state["shards"] is None:  # fixed at the start: batches depend on (seed, step) alone
        state["shards"] = [str(p) for d in data_dirs for p in list_shards(d)]
    if not state["shards"]:
        raise ValueError(f"no shards in {', '.join(map(str, data_dirs))}; run gen-data first")
    samples = _feature_samples(data_dirs, state["shards"])

    if run_json.exists():
        saved = json.loads(run_json.read_text())
        arch, target_dir = head_arch_from_json(saved["arch"]), Path(saved["target"])
        if cfg.target is not None and Path(cfg.target) != target_dir:
            raise ValueError(f"run {run} was trained against {target_dir}, not {cfg.target}")
        if arch != cfg.arch:
            log.warning("run %s was started with %s; keeping it (ignoring %s)", run, arch,
                        cfg.arch)
        vmap = VocabMap.load(run / VOCAB_MAP_FILE)
        codec = (saved.get("feature_codec")
                 or legacy_codec(TargetShape.from_dir(target_dir).hidden))
        if codec != cfg.feature_codec:
            log.warning("run %s was started with feature codec %s; keeping it", run, codec)
        if bool(saved.get("context", False)) != cfg.context:
            raise ValueError(f"run {run} is a {'context' if saved.get('context') else 'chain'}"
                             " head run; resume it with the same --context setting")
    else:
        arch = cfg.arch
        target_dir = Path(cfg.target) if cfg.target is not None else default_target()
        full_vocab = target_vocab_size(target_dir)
        vmap = (build_vocab_map(samples, full_vocab, arch.sub_vocab,
                                always=special_ids(target_dir))
                if 0 < arch.sub_vocab < full_vocab else VocabMap.identity(full_vocab))
        vmap.save(run / VOCAB_MAP_FILE)
        codec = codec_named(cfg.feature_codec).name  # refuses an unknown name now
        save_run_meta(run, arch, target_dir, cfg.seed, {"created": time.strftime("%F %T"),
                                                        "feature_codec": codec,
                                                        "context": cfg.context})
    full_to_sub = vmap.full_to_sub()
    full_to_head = np.full(vmap.full_vocab_size, -1, dtype=np.int64)
    real = vmap.sub_to_full >= 0
    full_to_head[vmap.sub_to_full[real]] = np.arange(int(real.sum()))

    head = build_head(arch, target_dir, vmap, cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim >= 2], "weight_decay": cfg.weight_decay},
         {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95))
    if ck is not None:
        head.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        log.info("resumed %s at step %d", run, state["step"])
    n_train = sum(p.numel() for p in params)
    log.info("feature head: %s, %.2fM trained params, sub-vocab %d, chains over %d samples",
             arch, n_train / 1e6, vmap.size, len(samples))
    index = ChainIndex(samples)
    if index.total == 0:
        raise ValueError("no sample has two generated tokens: nothing to chain")
    heldout = heldout_samples(cfg.heldout, cfg.eval_samples)
    if cfg.context:
        fused = arch.feature_layers
        seqs = context_sequences(samples, load_layer_features(state["shards"], fused)
                                 if fused else None)
        heldout_seqs = context_sequences(heldout, load_layer_features(
            list_shards(cfg.heldout), fused)[:len(heldout)] if fused and heldout else None)

    def next_batch(step: int):
        """(loss, parts, positions trained) of step ``step``'s batch."""
        rng = np.random.default_rng([cfg.seed, step])
        if cfg.context:
            picked = [seqs[i] for i in rng.integers(0, len(seqs), cfg.batch_size)]
            cb = make_context_batch(picked, full_to_sub, cfg.max_len)
            cb.features = wire_round_trip(cb.features, codec)
            if cb.layers is not None:  # the verifier would send them in the same form
                cb.layers = wire_round_trip(cb.layers, codec)
            loss, parts = context_loss(head, cb, cfg.passes, cfg.tv_weight,
                                       cfg.feature_weight)
            return loss, parts, int(cb.valid.sum())
        batch = make_chain_batch(samples, index.draw(rng, cfg.batch_size), cfg.chain_len,
                                 full_to_sub, full_to_head)
        loss, parts = chain_loss(head, batch, cfg.tv_weight, cfg.feature_weight, codec)
        return loss, parts, int(batch.valid.sum())
    metrics_log = run / "metrics.jsonl"

    def save() -> None:
        tmp = ckpt_path.with_name(f".ckpt.tmp-{os.getpid()}")
        torch.save({"model": head.state_dict(), "optimizer": opt.state_dict(), "state": state,
                    "arch": asdict(arch), "train_config": jsonable(asdict(cfg))}, tmp)
        os.replace(tmp, ckpt_path)
        log.info("checkpoint at step %d", state["step"])

    def evaluate_heldout(step: int) -> None:
        head.eval()
        res = (evaluate_context(head, vmap, heldout_seqs) if cfg.context
               else evaluate_torch(head, vmap, heldout, codec))
        head.train()
        log.info("heldout @%d: greedy_alpha %s tokens/round %s step accuracy %s (%d rows)",
                 step, res["greedy_alpha"], res["tokens_per_round"], res["step_accuracy"],
                 res["samples"])
        append_jsonl(metrics_log, {"step": step, "heldout": res})
        state["heldout"] = res

    head.train()
    t_run, last_ckpt, wall0 = time.perf_counter(), time.perf_counter(), state["wall_s"]
    acc = _fresh_acc()
    with _StopFlag() as flag:
        while state["step"] < cfg.steps and not flag.stop:
            step = state["step"]
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, cfg)
            loss, parts, seen = next_batch(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            state["step"] = step = step + 1
            state["chain_steps_seen"] += seen
            state["wall_s"] = wall0 + time.perf_counter() - t_run
            acc["n"] += 1
            acc["loss"] += float(loss.detach())
            for key, v in parts.items():
                acc[key] += v
            if step % cfg.log_every == 0 or step == cfg.steps:
                dt = time.perf_counter() - acc["t"]
                rec = {"step": step, "lr": _lr_at(step - 1, cfg),
                       **{key: acc[key] / acc["n"] for key in ("loss", "kl", "tv", "feature")},
                       "steps_s": acc["n"] / max(dt, 1e-9), "wall_s": round(state["wall_s"], 1)}
                eta = (cfg.steps - step) / max(rec["steps_s"], 1e-9)
                log.info("step %d/%d lr %.2e loss %.4f kl %.4f tv %.4f (accept~%.3f) feature "
                         "%.4f, %.2f steps/s, eta %.0f s", step, cfg.steps, rec["lr"],
                         rec["loss"], rec["kl"], rec["tv"], 1 - rec["tv"], rec["feature"],
                         rec["steps_s"], eta)
                append_jsonl(metrics_log, rec)
                state["last"] = rec
                acc = _fresh_acc()
            if heldout and cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                evaluate_heldout(step)
            if (time.perf_counter() - last_ckpt >= cfg.ckpt_every_s
                    or (cfg.ckpt_every_steps and step % cfg.ckpt_every_steps == 0)):
                save()
                last_ckpt = time.perf_counter()
        save()
    write_json(run / "summary.json", {"arch": asdict(arch), "config": jsonable(asdict(cfg)),
                                      "trained_params": n_train, "state": state})
    (run / "CARD.md").write_text(_run_card(arch, cfg, state, n_train, vmap.size))
    return state


def _run_card(arch: HeadArch, cfg: HeadTrainConfig, state: dict, n_train: int,
              sub_vocab: int) -> str:
    last, held = state.get("last", {}), state.get("heldout", {})
    return "\n".join([
        "# train-head run", "",
        f"- arch: {asdict(arch)}, sub-vocabulary {sub_vocab}, {n_train / 1e6:.2f} M trained",
        f"- data: {', '.join(map(str, as_dirs(cfg.data)))} ({len(state['shards'])} shards)",
        (f"- context head: steps {state['step']}, batch {cfg.batch_size} sequences of at most "
         f"{cfg.max_len} pairs, {cfg.passes} passes, {state['chain_steps_seen']:,} positions, "
         f"lr {cfg.lr}" if cfg.context else
         f"- steps {state['step']}, batch {cfg.batch_size} chains of {cfg.chain_len}, "
         f"{state['chain_steps_seen']:,} chain steps, lr {cfg.lr}"),
        f"- wall time {state['wall_s'] / 60:.1f} min",
        f"- last logged: loss {last.get('loss')}, kl {last.get('kl')}, tv {last.get('tv')}, "
        f"feature {last.get('feature')}",
        f"- held-out (teacher-forced greedy alpha, K=4): {held.get('greedy_alpha')}, tokens "
        f"per round {held.get('tokens_per_round')}, step accuracy {held.get('step_accuracy')}",
        ""])


def _fresh_acc() -> dict:
    return {"loss": 0.0, "kl": 0.0, "tv": 0.0, "feature": 0.0, "n": 0, "t": time.perf_counter()}
