"""``train``: a draft ``LlamaForCausalLM`` against the target's sparse distributions (from one
or more data directories; ``--init-from`` continues from a finished run's weights), with the
loss KL(p_topk || q) + w * TV(p_topk, q). Per-token acceptance of speculative sampling is
1 - TV(p, q), so TV is the quantity that matters; KL gives the better gradients early.
Checkpoints (model, optimizer, step, RNG, data position) go to ``<run>/ckpt.pt``; a killed run
rerun with the same command continues where it stopped."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
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
from edge_client.tools.distill.evaluate import (
    by_category,
    evaluate,
    format_result,
    realistic_categories,
    torch_logits_fn,
)
from edge_client.tools.distill.model import ArchConfig, arch_from_json, build_draft
from edge_client.tools.distill.shards import Sample, heldout_samples, list_shards, load_samples
from edge_client.tools.distill.vocab import VOCAB_MAP_FILE, VocabMap, build_vocab_map

log = logging.getLogger("edgespec.distill")


@dataclass(frozen=True)
class TrainConfig:
    run_dir: Path
    data: Path | Sequence[Path]  # gen-data directories, read together
    heldout: Path | None
    target: Path | None
    arch: ArchConfig = field(default_factory=ArchConfig)
    steps: int = 2000
    batch_size: int = 16  # sequences per step
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    tv_weight: float = 1.0
    max_len: int = 320
    seed: int = 0
    ckpt_every_s: float = 300.0
    ckpt_every_steps: int = 0  # 0: only by time (and at the end)
    eval_every: int = 200
    eval_samples: int = 64
    threads: int = 0
    log_every: int = 10
    lr_steps: int = 0  # the cosine's horizon; 0: ``steps`` (a rerun with more steps stretches it)
    # A finished run to start from: its architecture, vocabulary and weights (not its optimizer
    # or schedule). Read only when this run has no run.json yet.
    init_from: Path | None = None


@dataclass
class Batch:
    input_ids: object  # torch.LongTensor [B, T] draft ids, right padded
    attention_mask: object  # [B, T]
    rows: object  # [N] flat index into B*T of positions with a loss
    teacher_ids: object  # [N, k] draft ids (0 where invalid)
    teacher_p: object  # [N, k] p renormalised over valid in-subset ids, 0 where invalid
    tokens: int


def make_batch(samples: Sequence[Sample], full_to_sub: np.ndarray, unk: int,
               max_len: int) -> Batch:
    """Right-padded draft ids and, for every generated token, p over in-subset ids.

    A prompt too long to leave room for its continuation inside ``max_len`` is cut from the
    left (it keeps its end, which the continuation follows), so every row has positions to
    train on: the corpus's multi-turn prompts exceed 320 tokens, and a batch of only such
    rows cut from the right had none."""
    import torch

    samples = [_fit(s, max_len) for s in samples]
    seqs, rows, t_ids, t_p = [], [], [], []
    width = min(max_len, max(len(s.prompt_ids) + len(s.gen_ids) for s in samples))
    for b, s in enumerate(samples):
        full = np.concatenate([s.prompt_ids, s.gen_ids]).astype(np.int64)[:width]
        seqs.append(full_to_sub[full])
        p_len = len(s.prompt_ids)
        n = max(0, min(len(s.gen_ids), width - p_len + 1))  # gen token j predicted at p_len-1+j
        if n == 0:
            continue
        rows.append(b * width + p_len - 1 + np.arange(n))
        ids = s.topk_ids[:n]
        sub = full_to_sub[ids]
        valid = sub != unk  # p's mass outside the subset is out of q's reach anyway
        p = np.exp(s.topk_logp[:n].astype(np.float32)) * valid
        p /= np.maximum(p.sum(-1, keepdims=True), 1e-12)
        t_ids.append(np.where(valid, sub, 0))
        t_p.append(p)
    ids = np.zeros((len(samples), width), dtype=np.int64)
    mask = np.zeros((len(samples), width), dtype=np.int64)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = 1
    rows_arr = np.concatenate(rows)
    # Rows with top-64 and one-hot rows (an archive's ids) may share a batch: pad k with p = 0,
    # which distill_loss counts as no mass.
    k = max(t.shape[1] for t in t_ids)
    t_ids = [np.pad(t, ((0, 0), (0, k - t.shape[1]))) for t in t_ids]
    t_p = [np.pad(t, ((0, 0), (0, k - t.shape[1]))) for t in t_p]
    return Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(rows_arr),
                 torch.from_numpy(np.concatenate(t_ids)), torch.from_numpy(np.concatenate(t_p)),
                 int(mask.sum()))


def _fit(s: Sample, max_len: int) -> Sample:
    """``s`` with its prompt cut from the left to leave at least min(its continuation,
    max_len / 2) positions inside ``max_len`` (unchanged when it fits)."""
    room = min(len(s.gen_ids), max_len // 2)
    keep = max(1, max_len - room)
    if len(s.prompt_ids) <= keep:
        return s
    return replace(s, prompt_ids=s.prompt_ids[-keep:])


def distill_loss(logits, teacher_ids, teacher_p, tv_weight: float):
    """logits [N, Vs]; teacher_ids, teacher_p [N, k] -> (loss, kl, tv), means over N."""
    import torch

    logq = torch.log_softmax(logits.float(), dim=-1)  # [N, Vs]
    logq_k = logq.gather(1, teacher_ids)  # [N, k]
    valid = teacher_p > 0
    q_k = logq_k.exp() * valid
    plogp = torch.where(valid, teacher_p * teacher_p.clamp_min(1e-12).log(), 0.0)
    kl = (plogp - teacher_p * logq_k).sum(-1)  # [N]
    tv = 0.5 * ((teacher_p - q_k).abs().sum(-1) + (1 - q_k.sum(-1)).clamp_min(0))  # [N]
    loss = kl.mean() + tv_weight * tv.mean()
    return loss, kl.mean().detach(), tv.mean().detach()


def _epoch_batches(n_samples: int, lengths: np.ndarray, batch_size: int, seed: int,
                   epoch: int) -> list[np.ndarray]:
    """Shuffle, bucket by length within chunks of 32 batches, shuffle the batches."""
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(n_samples)
    chunk = batch_size * 32
    batches = []
    for c in range(0, n_samples, chunk):
        part = perm[c : c + chunk]
        part = part[np.argsort(lengths[part], kind="stable")]
        batches += [part[i : i + batch_size] for i in range(0, len(part), batch_size)]
    order = rng.permutation(len(batches))
    return [batches[i] for i in order]


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    horizon = cfg.lr_steps or cfg.steps
    frac = min(1.0, (step - cfg.warmup) / max(1, horizon - cfg.warmup))
    cosine = 0.5 * (1 + math.cos(math.pi * frac))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


class _StopFlag:
    """SIGTERM/SIGINT ask the loop to checkpoint and stop after the current step."""

    def __init__(self) -> None:
        self.stop = False

    def __enter__(self):
        self._old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        for s in self._old:
            signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        log.warning("signal %d: checkpointing and stopping", signum)
        self.stop = True

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def train(cfg: TrainConfig) -> dict:
    """Train until ``cfg.steps``, resuming from ``<run_dir>/ckpt.pt`` when it exists."""
    import torch

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run = Path(cfg.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    target_dir = Path(cfg.target) if cfg.target is not None else default_target()
    ckpt_path = run / "ckpt.pt"
    run_json = run / "run.json"

    # absolute: the epoch's shard list is joined onto data_dirs[0] (see epoch_data)
    data_dirs = [d.resolve() for d in as_dirs(cfg.data)]
    empty = [str(d) for d in data_dirs if not list_shards(d)]
    if empty:  # e.g. a corpus chunk restored as ids only: training on less would go unseen
        raise RuntimeError(f"no shards in {', '.join(empty)}; run gen-data first (for a corpus "
                           f"chunk restored as ids only: corpus --restore-chunks N, or --data "
                           f"its archive dir, corpus_ids/chunk-NNNN, as one-hot labels)")
    init_weights = None
    if run_json.exists():
        saved = json.loads(run_json.read_text())
        arch = arch_from_json(saved["arch"])
        if arch != cfg.arch and cfg.init_from is None:
            log.warning("run %s was started with %s; keeping it (ignoring %s)", run, arch, cfg.arch)
        vmap = VocabMap.load(run / VOCAB_MAP_FILE)
    elif cfg.init_from is not None:
        source = Path(cfg.init_from)
        arch = arch_from_json(json.loads((source / "run.json").read_text())["arch"])
        vmap = VocabMap.load(source / VOCAB_MAP_FILE)
        init_weights = torch.load(source / "ckpt.pt", map_location="cpu",
                                  weights_only=False)["model"]
        vmap.save(run / VOCAB_MAP_FILE)
        write_json(run_json, {"arch": asdict(arch), "target": str(target_dir),
                               "seed": cfg.seed, "init_from": str(source),
                               "created": time.strftime("%F %T")})
    else:
        arch = cfg.arch
        full_vocab = target_vocab_size(target_dir)
        if arch.sub_vocab:
            samples = load_samples([p for d in data_dirs for p in list_shards(d)])
            vmap = build_vocab_map(samples, full_vocab, arch.sub_vocab,
                                   always=special_ids(target_dir))
        else:
            vmap = VocabMap.identity(full_vocab)
        vmap.save(run / VOCAB_MAP_FILE)
        write_json(run_json, {"arch": asdict(arch), "target": str(target_dir),
                               "seed": cfg.seed, "created": time.strftime("%F %T")})
    full_to_sub = vmap.full_to_sub()

    model = build_draft(arch, target_dir, vmap, cfg.seed)
    if init_weights is not None:
        model.load_state_dict(init_weights)
        log.info("starting from the weights of %s", cfg.init_from)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95))
    state = {"step": 0, "epoch": 0, "batch_in_epoch": 0, "epoch_shards": None,
             "tokens_seen": 0, "wall_s": 0.0}
    if ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        state = ck["state"]
        torch.set_rng_state(ck["rng"]["torch"])
        np.random.set_state(ck["rng"]["numpy"])
        random.setstate(ck["rng"]["python"])
        log.info("resumed %s at step %d (epoch %d, batch %d)", run, state["step"],
                 state["epoch"], state["batch_in_epoch"])
    n_params = sum(p.numel() for p in model.parameters())
    log.info("draft: %s, %.2fM params, vocab %d", arch, n_params / 1e6, vmap.size)

    heldout = heldout_samples(cfg.heldout, cfg.eval_samples)
    categories = realistic_categories(cfg.heldout, len(heldout))
    metrics_log = run / "metrics.jsonl"

    def save() -> None:
        ck = {"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state,
              "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                      "python": random.getstate()},
              "arch": asdict(arch), "train_config": jsonable(asdict(cfg))}
        tmp = ckpt_path.with_name(f".ckpt.tmp-{os.getpid()}")
        torch.save(ck, tmp)
        os.replace(tmp, ckpt_path)
        log.info("checkpoint at step %d", state["step"])

    def epoch_data():
        if state["epoch_shards"] is None:
            state["epoch_shards"] = [str(p) for d in data_dirs for p in list_shards(d)]
        # (checkpoints of one-directory runs hold bare names; an absolute path ignores the /)
        samples = load_samples([data_dirs[0] / n for n in state["epoch_shards"]])
        lengths = np.array([len(s.prompt_ids) + len(s.gen_ids) for s in samples])
        return samples, _epoch_batches(len(samples), lengths, cfg.batch_size, cfg.seed,
                                       state["epoch"])

    samples, batches = epoch_data()
    log.info("epoch %d: %d samples from %d shards", state["epoch"], len(samples),
             len(state["epoch_shards"]))
    last_ckpt, t_run = time.perf_counter(), time.perf_counter()
    wall0 = state["wall_s"]
    acc = {"loss": 0.0, "kl": 0.0, "tv": 0.0, "n": 0, "tokens": 0, "t": time.perf_counter()}
    with _StopFlag() as flag:
        while state["step"] < cfg.steps and not flag.stop:
            if state["batch_in_epoch"] >= len(batches):
                state["epoch"] += 1
                state["batch_in_epoch"] = 0
                state["epoch_shards"] = None  # pick up shards gen-data wrote meanwhile
                samples, batches = epoch_data()
                log.info("epoch %d: %d samples from %d shards", state["epoch"], len(samples),
                         len(state["epoch_shards"]))
            batch = make_batch([samples[i] for i in batches[state["batch_in_epoch"]]],
                               full_to_sub, vmap.unk, cfg.max_len)
            for g in opt.param_groups:
                g["lr"] = _lr_at(state["step"], cfg)
            hidden = model.model(input_ids=batch.input_ids,
                                 attention_mask=batch.attention_mask).last_hidden_state
            h = hidden.reshape(-1, hidden.shape[-1])[batch.rows]  # [N, H] only scored rows
            loss, kl, tv = distill_loss(model.lm_head(h), batch.teacher_ids, batch.teacher_p,
                                        cfg.tv_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            state["step"] += 1
            state["batch_in_epoch"] += 1
            state["tokens_seen"] += batch.tokens
            acc["loss"] += float(loss.detach())
            acc["kl"] += float(kl)
            acc["tv"] += float(tv)
            acc["n"] += 1
            acc["tokens"] += batch.tokens
            state["wall_s"] = wall0 + time.perf_counter() - t_run
            step = state["step"]
            if step % cfg.log_every == 0 or step == cfg.steps:
                dt = time.perf_counter() - acc["t"]
                rec = {"step": step, "epoch": state["epoch"], "lr": _lr_at(step - 1, cfg),
                       "loss": acc["loss"] / acc["n"], "kl": acc["kl"] / acc["n"],
                       "tv": acc["tv"] / acc["n"], "tok_s": acc["tokens"] / max(dt, 1e-9),
                       "wall_s": round(state["wall_s"], 1)}
                log.info("step %d ep %d lr %.2e loss %.4f kl %.4f tv %.4f (accept~%.3f) %.0f tok/s",
                         step, state["epoch"], rec["lr"], rec["loss"], rec["kl"], rec["tv"],
                         1 - rec["tv"], rec["tok_s"])
                append_jsonl(metrics_log, rec)
                acc = {"loss": 0.0, "kl": 0.0, "tv": 0.0, "n": 0, "tokens": 0,
                       "t": time.perf_counter()}
            if heldout and cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                model.eval()
                res = evaluate(torch_logits_fn(model, vmap), heldout)
                rec = {"step": step, "tokens_seen": state["tokens_seen"], "heldout": res}
                if categories:  # the realistic set (module realistic_data): per category too
                    rec["by_category"] = by_category(
                        heldout, categories, lambda rows: evaluate(
                            torch_logits_fn(model, vmap), rows)["greedy_alpha"],
                        overall=res["greedy_alpha"])
                model.train()
                log.info("heldout @%d: %s", step, format_result(res))
                append_jsonl(metrics_log, rec)
            if (time.perf_counter() - last_ckpt >= cfg.ckpt_every_s
                    or (cfg.ckpt_every_steps and step % cfg.ckpt_every_steps == 0)):
                save()
                last_ckpt = time.perf_counter()
        save()
    return state
