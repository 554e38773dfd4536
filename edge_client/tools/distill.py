"""``edgespec-distill``: distil the target into a small ONNX draft, resumably.

Subcommands (each one checkpoints; kill it at any moment and rerun the same command):

gen-data  The target continues the distillation prompts (batched, left padded; some rows
          greedy, some sampled) and records, for every generated token, the top-k token ids and
          log-probabilities of the target's distribution p at temperature 1 that position was
          decided from. One ``shard-NNNNN.npz`` per ``--shard-size`` prompts, written atomically;
          a rerun skips finished shards. With ``--draft-run`` the data is on-policy: a trained
          draft writes the continuations (the text it will be asked to extend on the edge) and
          the target labels every position in one teacher-forced forward (2.4x the tokens per
          worker-minute of the target generating, on the project's 2-core CPU).
train     Trains a draft ``LlamaForCausalLM`` against those sparse distributions (from one or
          more data directories; ``--init-from`` continues from a finished run's weights):
          KL(p_topk || q) + w * TV(p_topk, q). Per-token acceptance of speculative sampling is
          1 - TV(p, q), so TV is the quantity that matters; KL gives the better gradients early.
          Checkpoints (model, optimizer, step, RNG, data position) go to ``<run>/ckpt.pt``.
export    Checkpoint -> HF dir -> ONNX (``export_draft.export_onnx``) -> dynamic int8, with a
          MODEL_CARD.md holding the held-out acceptance of fp32 and int8 and the step latency.
eval      Held-out acceptance of a checkpoint or of an ONNX draft directory.

Notation as in ``cloud_verifier.verification``: p is the target, q the draft, K the draft length.

Reduced vocabulary. A draft may keep only the ``--sub-vocab`` most frequent target tokens
(plus one <unk> slot for inputs outside them): its head is much cheaper, and this is lossless
because q is simply 0 elsewhere. ``vocab_map.npz`` beside the ONNX model (``sub_to_full``,
-1 for the <unk> slot, and ``full_vocab_size``) lets ``OnnxDraftModel`` keep taking and
returning full-vocabulary ids and logits.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from edge_client.tools.distill_prompts import SPLITS, prompt_split

log = logging.getLogger("edgespec.distill")

VOCAB_MAP_FILE = "vocab_map.npz"
EVAL_TEMPERATURE = 0.7


# ============================================================================================
# Shards: what gen-data writes and train reads
# ============================================================================================


@dataclass
class Sample:
    """One prompt and the target's continuation, with p's top-k at every generated token."""

    prompt_ids: np.ndarray  # [P] int
    gen_ids: np.ndarray  # [G] int, the generated tokens (EOS included when reached)
    topk_ids: np.ndarray  # [G, k] int: row j is p's top-k for gen token j
    topk_logp: np.ndarray  # [G, k] float16 log p, descending
    sampled: bool


def write_shard(path: Path, samples: Sequence[Sample], prompt_index: Sequence[int]) -> None:
    def flat(arrs):
        offsets = np.cumsum([0] + [len(a) for a in arrs]).astype(np.int64)
        return np.concatenate(arrs) if arrs else np.zeros(0), offsets

    prompt_flat, prompt_off = flat([s.prompt_ids.astype(np.int32) for s in samples])
    gen_flat, gen_off = flat([s.gen_ids.astype(np.int32) for s in samples])
    biggest = max(int(s.topk_ids.max(initial=0)) for s in samples)
    id_dtype = np.uint16 if biggest < 65536 else np.int32
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
    np.savez(
        tmp,
        prompt_ids=prompt_flat.astype(np.int32),
        prompt_offsets=prompt_off,
        gen_ids=gen_flat.astype(np.int32),
        gen_offsets=gen_off,
        topk_ids=np.concatenate([s.topk_ids for s in samples]).astype(id_dtype),
        topk_logp=np.concatenate([s.topk_logp for s in samples]).astype(np.float16),
        sampled=np.array([s.sampled for s in samples], dtype=bool),
        prompt_index=np.asarray(prompt_index, dtype=np.int32),
    )
    os.replace(tmp, path)


def read_shard(path: Path) -> list[Sample]:
    with np.load(path) as z:
        po, go = z["prompt_offsets"], z["gen_offsets"]
        out = []
        for i in range(len(po) - 1):
            g0, g1 = go[i], go[i + 1]
            out.append(
                Sample(
                    z["prompt_ids"][po[i] : po[i + 1]],
                    z["gen_ids"][g0:g1],
                    z["topk_ids"][g0:g1].astype(np.int64),
                    z["topk_logp"][g0:g1],
                    bool(z["sampled"][i]),
                )
            )
    return out


def list_shards(data_dir: Path) -> list[Path]:
    return sorted(Path(data_dir).glob("shard-*.npz"))


def load_samples(shards: Sequence[Path]) -> list[Sample]:
    return [s for p in shards for s in read_shard(p)]


# ============================================================================================
# gen-data
# ============================================================================================


@dataclass(frozen=True)
class GenConfig:
    target: Path | None
    out: Path
    split: str = "train"
    shard_size: int = 64
    batch_size: int = 16
    max_new_tokens: int = 128
    top_k: int = 64
    sample_fraction: float = 0.5
    temperature: float = 0.8
    seed: int = 0
    max_prompts: int = 0  # 0: all of the split
    threads: int = 0
    worker: int = 0  # this process writes the shards with shard % workers == worker
    workers: int = 1
    # On-policy data: this training run's draft writes the continuations and the target only
    # labels them (one teacher-forced forward per batch). None: the target writes them.
    draft_run: Path | None = None


def gen_data(cfg: GenConfig, prompts: Sequence | None = None) -> Path:
    """Fill ``cfg.out`` with shards; skips shards already written. Returns ``cfg.out``."""
    import torch

    from cloud_verifier.target_model import load_target
    from edge_client.tokenizer import EdgeTokenizer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if prompts is None:
        prompts = prompt_split(cfg.split)  # type: ignore[arg-type]
    order = np.random.default_rng(cfg.seed).permutation(len(prompts))
    if cfg.max_prompts:
        order = order[: cfg.max_prompts]
    _check_resume(out / "config.json", cfg)
    _write_json(out / "config.json", {**_jsonable(asdict(cfg)), "num_prompts": len(order)})

    target = load_target(cfg.target, device="cpu")
    target_dir = Path(cfg.target) if cfg.target is not None else _default_target()
    tok = EdgeTokenizer(target_dir)
    eos = set(target.eos_token_ids)
    pad_id = target.eos_token_ids[0]
    writer = target.model if cfg.draft_run is None else _HeadOnly(*load_run(cfg.draft_run,
                                                                             cfg.target))

    n_shards = math.ceil(len(order) / cfg.shard_size)
    total_tokens, t_start = 0, time.perf_counter()
    for shard in range(n_shards):
        path = out / f"shard-{shard:05d}.npz"
        if path.exists() or shard % cfg.workers != cfg.worker:
            continue
        idx = order[shard * cfg.shard_size : (shard + 1) * cfg.shard_size]
        encoded = []
        for i in idx:
            p = prompts[int(i)]
            ids = tok.encode_chat(p.text) if p.chat else tok.encode(p.text)
            # One draw per prompt decides greedy vs sampled, independent of batching.
            sampled = bool(np.random.default_rng([cfg.seed, int(i)]).random() < cfg.sample_fraction)
            encoded.append((int(i), ids, sampled))
        encoded.sort(key=lambda e: len(e[1]))  # less padding per batch
        gen = torch.Generator().manual_seed(cfg.seed * 100003 + shard)
        samples, index, t0, n_tok = [], [], time.perf_counter(), 0
        for b in range(0, len(encoded), cfg.batch_size):
            batch = encoded[b : b + cfg.batch_size]
            on_policy = writer is not target.model
            rows = _generate_batch(writer, [e[1] for e in batch], [e[2] for e in batch], cfg,
                                   eos, pad_id, gen, record_top_k=not on_policy)
            if on_policy:
                rows = _label(target.model, rows, cfg.top_k, pad_id)
            samples += rows
            index += [e[0] for e in batch]
            n_tok += sum(len(r.gen_ids) for r in rows)
            dt = time.perf_counter() - t0
            log.info("shard %d/%d: %d/%d prompts, %d tokens, %.1f tok/s", shard + 1, n_shards,
                     len(samples), len(encoded), n_tok, n_tok / max(dt, 1e-9))
        write_shard(path, samples, index)
        total_tokens += n_tok
        elapsed = time.perf_counter() - t_start
        log.info("wrote %s (%d tokens); this run %d tokens in %.0f s, %.1f tok/s", path.name,
                 n_tok, total_tokens, elapsed, total_tokens / max(elapsed, 1e-9))
        _update_manifest(out, path.name, len(samples), n_tok, time.perf_counter() - t0)
    log.info("gen-data done: %d shards in %s", n_shards, out)
    return out


# What a data directory's shards depend on; a resumed run must use the same values.
_DATA_FIELDS = ("split", "shard_size", "batch_size", "max_new_tokens", "top_k",
                "sample_fraction", "temperature", "seed", "max_prompts", "draft_run")


def _check_resume(config_path: Path, cfg: GenConfig) -> None:
    """Refuses to add shards made with other settings to an existing data directory."""
    if not config_path.exists():
        return
    stored = json.loads(config_path.read_text())
    wanted = _jsonable(asdict(cfg))
    defaults = _jsonable(asdict(GenConfig(None, Path())))  # fields older directories lack
    diff = {k: (stored.get(k, defaults[k]), wanted[k]) for k in _DATA_FIELDS
            if stored.get(k, defaults[k]) != wanted[k]}
    if diff:
        detail = ", ".join(f"--{k.replace('_', '-')} {old} (not {new})"
                           for k, (old, new) in diff.items())
        raise ValueError(f"{config_path.parent} was generated with other settings; resume "
                         f"with {detail}, or use a new --out")


def _generate_batch(model, prompts: list[list[int]], sampled: list[bool], cfg: GenConfig,
                    eos: set[int], pad_id: int, gen, record_top_k: bool = True) -> list[Sample]:
    """Left-padded batched decoding with a KV cache; finished rows leave the batch. Each
    token's top-k log-probabilities are recorded unless ``record_top_k`` is False (their
    arrays are then empty, for ``_label`` to fill)."""
    import torch
    from transformers import DynamicCache

    n, width = len(prompts), max(len(p) for p in prompts)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        input_ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    temps = torch.tensor([cfg.temperature if s else 0.0 for s in sampled])

    out_tokens: list[list[int]] = [[] for _ in range(n)]
    out_ids: list[list[np.ndarray]] = [[] for _ in range(n)]
    out_logp: list[list[np.ndarray]] = [[] for _ in range(n)]
    alive = torch.arange(n)  # original row of each batch row
    cache = DynamicCache()
    with torch.inference_mode():
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                       past_key_values=cache, use_cache=True).logits[:, -1, :].float()
        next_pos = positions[:, -1] + 1
        for _ in range(cfg.max_new_tokens):
            if record_top_k:  # [b, k]: p at temperature 1
                top_logp, top_ids = torch.log_softmax(logits, dim=-1).topk(cfg.top_k, dim=-1)
            else:
                top_logp = top_ids = torch.empty((len(alive), 0))
            greedy = logits.argmax(-1)
            t = temps[alive]
            token = greedy.clone()
            if bool((t > 0).any()):
                rows = (t > 0).nonzero().flatten()
                probs = torch.softmax(logits[rows] / t[rows, None], dim=-1)
                token[rows] = torch.multinomial(probs, 1, generator=gen).flatten()
            done = torch.zeros(len(alive), dtype=torch.bool)
            for j, r in enumerate(alive.tolist()):
                tid = int(token[j])
                out_tokens[r].append(tid)
                out_ids[r].append(top_ids[j].numpy())
                out_logp[r].append(top_logp[j].numpy().astype(np.float16))
                done[j] = tid in eos
            keep = (~done).nonzero().flatten()
            if keep.numel() == 0:
                break
            if keep.numel() < len(alive):
                cache.batch_select_indices(keep)
                mask, token, next_pos, alive = mask[keep], token[keep], next_pos[keep], alive[keep]
            mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=mask.dtype)], dim=1)
            logits = model(input_ids=token[:, None], attention_mask=mask,
                           position_ids=next_pos[:, None], past_key_values=cache,
                           use_cache=True).logits[:, -1, :].float()
            next_pos = next_pos + 1
    return [
        Sample(np.asarray(prompts[r]), np.asarray(out_tokens[r]), np.stack(out_ids[r]),
               np.stack(out_logp[r]), sampled[r])
        for r in range(n)
    ]


def _label(model, rows: list[Sample], top_k: int, pad_id: int) -> list[Sample]:
    """Replaces each row's top-k with the target's: one teacher-forced forward over the
    left-padded prompt + continuation, keeping only the positions that predict a continuation
    token."""
    import torch

    seqs = [np.concatenate([r.prompt_ids, r.gen_ids]) for r in rows]
    width, longest = max(len(s) for s in seqs), max(len(r.gen_ids) for r in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, width - len(s):] = torch.from_numpy(s.astype(np.int64))
        mask[i, width - len(s):] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        # Kept column c is position width - longest - 1 + c; it predicts the token after it.
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                       logits_to_keep=longest + 1).logits.float()
        top_logp, top_ids = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)
    out = []
    for i, r in enumerate(rows):
        cols = slice(longest - len(r.gen_ids), longest)
        out.append(replace(r, topk_ids=top_ids[i, cols].numpy(),
                           topk_logp=top_logp[i, cols].numpy().astype(np.float16)))
    return out


class _HeadOnly:
    """A run's draft as a full-vocabulary causal LM whose logits are -inf outside its head, so
    that decoding from it is decoding from the draft the edge runs (ids outside the head are
    never proposed there)."""

    def __init__(self, model, vmap: VocabMap) -> None:
        import torch

        self.twin = full_vocab_twin(model, vmap)
        self.bias = torch.full((vmap.full_vocab_size,), -math.inf)
        self.bias[torch.from_numpy(vmap.sub_to_full[vmap.sub_to_full >= 0])] = 0.0

    def __call__(self, **kwargs):
        out = self.twin(**kwargs)
        out.logits = out.logits + self.bias
        return out


def _update_manifest(out: Path, name: str, prompts: int, tokens: int, seconds: float) -> None:
    path = out / "manifest.json"
    manifest = json.loads(path.read_text()) if path.exists() else {"shards": {}}
    manifest["shards"][name] = {"prompts": prompts, "tokens": tokens, "seconds": round(seconds, 1)}
    manifest["total_prompts"] = sum(s["prompts"] for s in manifest["shards"].values())
    manifest["total_tokens"] = sum(s["tokens"] for s in manifest["shards"].values())
    _write_json(path, manifest)


# ============================================================================================
# Vocabulary subset
# ============================================================================================


@dataclass(frozen=True)
class VocabMap:
    """sub_to_full[i] is the full id of draft id i; -1 marks the <unk> input slot."""

    sub_to_full: np.ndarray  # [N] int64
    full_vocab_size: int

    @property
    def size(self) -> int:
        return len(self.sub_to_full)

    @property
    def unk(self) -> int:
        """The <unk> input slot, -1 when every full id is kept."""
        slots = np.flatnonzero(self.sub_to_full < 0)
        return int(slots[0]) if slots.size else -1

    def full_to_sub(self) -> np.ndarray:
        """[V] int64: draft id of each full id, the <unk> slot for ids outside the subset."""
        table = np.full(self.full_vocab_size, self.unk, dtype=np.int64)
        real = self.sub_to_full >= 0
        table[self.sub_to_full[real]] = np.flatnonzero(real)
        return table

    def save(self, path: Path) -> None:
        np.savez(path, sub_to_full=self.sub_to_full.astype(np.int64),
                 full_vocab_size=np.int64(self.full_vocab_size))

    @classmethod
    def load(cls, path: Path) -> VocabMap:
        with np.load(path) as z:
            return cls(z["sub_to_full"].astype(np.int64), int(z["full_vocab_size"]))

    @classmethod
    def identity(cls, vocab: int) -> VocabMap:
        # No <unk> slot needed: every id is kept. unk is then never used.
        return cls(np.arange(vocab, dtype=np.int64), vocab)


def build_vocab_map(samples: Sequence[Sample], full_vocab: int, size: int,
                    always: Sequence[int] = ()) -> VocabMap:
    """Keep the ``size - 1`` tokens with the most target probability mass, plus <unk>.

    Mass counts every token the draft reads (prompt and continuation) and the target's top-k
    probabilities at every generated position, so tokens the target likes but rarely samples
    are kept too.
    """
    counts = np.zeros(full_vocab, dtype=np.float64)
    for s in samples:
        np.add.at(counts, s.prompt_ids.astype(np.int64), 1.0)
        np.add.at(counts, s.gen_ids.astype(np.int64), 1.0)
        p = np.exp(s.topk_logp.astype(np.float32))
        np.add.at(counts, s.topk_ids.reshape(-1), p.reshape(-1))
    counts[list(always)] = np.inf
    keep_n = min(size - 1, int((counts > 0).sum()))
    keep = np.sort(np.argsort(-counts, kind="stable")[:keep_n])
    return VocabMap(np.concatenate([keep, [-1]]).astype(np.int64), full_vocab)


# ============================================================================================
# Model construction
# ============================================================================================


@dataclass(frozen=True)
class ArchConfig:
    init: str = "scratch"  # "scratch", "pca" (target embeddings projected) or "target"
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    target_layers: tuple[int, ...] = ()  # init=target: which target layers to copy
    sub_vocab: int = 16384  # 0: the full vocabulary
    max_positions: int = 2048


def build_draft(arch: ArchConfig, target_dir: Path, vmap: VocabMap, seed: int):
    """A fresh draft LlamaForCausalLM with tied embeddings over ``vmap``'s vocabulary."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    tcfg = AutoConfig.from_pretrained(target_dir)
    common = dict(
        vocab_size=vmap.size,
        max_position_embeddings=arch.max_positions,
        rms_norm_eps=tcfg.rms_norm_eps,
        rope_theta=getattr(tcfg, "rope_theta", 10000.0),
        bos_token_id=tcfg.bos_token_id,
        eos_token_id=tcfg.eos_token_id,
        pad_token_id=tcfg.pad_token_id,
        tie_word_embeddings=True,
        hidden_act="silu",
    )
    torch.manual_seed(seed)
    if arch.init in ("scratch", "pca"):
        cfg = LlamaConfig(hidden_size=arch.hidden, num_hidden_layers=arch.layers,
                          num_attention_heads=arch.heads, num_key_value_heads=arch.kv_heads,
                          intermediate_size=arch.intermediate, head_dim=arch.hidden // arch.heads,
                          initializer_range=0.02, **common)
        model = LlamaForCausalLM(cfg)
        if arch.init == "pca":
            _pca_embeddings(model, target_dir, vmap)
        return model
    if arch.init != "target":
        raise ValueError(f"unknown init {arch.init!r}")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    layers = arch.target_layers or tuple(range(arch.layers))
    cfg = LlamaConfig(hidden_size=tcfg.hidden_size, num_hidden_layers=len(layers),
                      num_attention_heads=tcfg.num_attention_heads,
                      num_key_value_heads=tcfg.num_key_value_heads,
                      intermediate_size=tcfg.intermediate_size,
                      head_dim=getattr(tcfg, "head_dim", None)
                      or tcfg.hidden_size // tcfg.num_attention_heads,
                      initializer_range=tcfg.initializer_range, **common)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        emb = target.get_input_embeddings().weight  # [V, H]
        real = vmap.sub_to_full >= 0
        new = model.get_input_embeddings().weight
        new[torch.from_numpy(np.flatnonzero(real))] = emb[torch.from_numpy(vmap.sub_to_full[real])]
        new[torch.from_numpy(np.flatnonzero(~real))] = emb.mean(0)
        for i, src in enumerate(layers):
            model.model.layers[i].load_state_dict(target.model.layers[src].state_dict())
        model.model.norm.load_state_dict(target.model.norm.state_dict())
    model.tie_weights()
    return model


def _pca_embeddings(model, target_dir: Path, vmap: VocabMap) -> None:
    """Narrow embeddings that keep the target's geometry: its top principal directions."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(str(Path(target_dir) / "model.safetensors"))
    emb = weights["model.embed_tokens.weight"].float()  # [V, H_target]
    real = vmap.sub_to_full >= 0
    rows = emb[torch.from_numpy(vmap.sub_to_full[real])]  # [M, H_target]
    centered = rows - rows.mean(0)
    hidden = model.config.hidden_size
    _, _, v = torch.linalg.svd(centered, full_matrices=False)  # v: [H_target, H_target]
    proj = centered @ v[:hidden].T  # [M, hidden]
    proj *= 0.02 / proj.std()  # the scale of a fresh init, so training starts out stable
    with torch.no_grad():
        new = model.get_input_embeddings().weight
        new[torch.from_numpy(np.flatnonzero(real))] = proj
        new[torch.from_numpy(np.flatnonzero(~real))] = 0.0
    model.tie_weights()


# ============================================================================================
# Training
# ============================================================================================


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
    """Right-padded draft ids and, for every generated token, p over in-subset ids."""
    import torch

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
    return Batch(torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(rows_arr),
                 torch.from_numpy(np.concatenate(t_ids)), torch.from_numpy(np.concatenate(t_p)),
                 int(mask.sum()))


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
    target_dir = Path(cfg.target) if cfg.target is not None else _default_target()
    ckpt_path = run / "ckpt.pt"
    run_json = run / "run.json"

    data_dirs = _as_dirs(cfg.data)
    if not any(list_shards(d) for d in data_dirs):
        raise RuntimeError(f"no shards in {', '.join(map(str, data_dirs))}; run gen-data first")
    init_weights = None
    if run_json.exists():
        saved = json.loads(run_json.read_text())
        arch = _arch_from_json(saved["arch"])
        if arch != cfg.arch and cfg.init_from is None:
            log.warning("run %s was started with %s; keeping it (ignoring %s)", run, arch, cfg.arch)
        vmap = VocabMap.load(run / VOCAB_MAP_FILE)
    elif cfg.init_from is not None:
        source = Path(cfg.init_from)
        arch = _arch_from_json(json.loads((source / "run.json").read_text())["arch"])
        vmap = VocabMap.load(source / VOCAB_MAP_FILE)
        init_weights = torch.load(source / "ckpt.pt", map_location="cpu",
                                  weights_only=False)["model"]
        vmap.save(run / VOCAB_MAP_FILE)
        _write_json(run_json, {"arch": asdict(arch), "target": str(target_dir),
                               "seed": cfg.seed, "init_from": str(source),
                               "created": time.strftime("%F %T")})
    else:
        arch = cfg.arch
        full_vocab = _vocab_size(target_dir)
        if arch.sub_vocab:
            samples = load_samples([p for d in data_dirs for p in list_shards(d)])
            vmap = build_vocab_map(samples, full_vocab, arch.sub_vocab,
                                   always=_special_ids(target_dir))
        else:
            vmap = VocabMap.identity(full_vocab)
        vmap.save(run / VOCAB_MAP_FILE)
        _write_json(run_json, {"arch": asdict(arch), "target": str(target_dir),
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

    heldout = _heldout_samples(cfg.heldout, cfg.eval_samples)
    metrics_log = run / "metrics.jsonl"

    def save() -> None:
        ck = {"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state,
              "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                      "python": random.getstate()},
              "arch": asdict(arch), "train_config": _jsonable(asdict(cfg))}
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
                _append_jsonl(metrics_log, rec)
                acc = {"loss": 0.0, "kl": 0.0, "tv": 0.0, "n": 0, "tokens": 0,
                       "t": time.perf_counter()}
            if heldout and cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps):
                model.eval()
                res = evaluate(torch_logits_fn(model, vmap), heldout)
                model.train()
                log.info("heldout @%d: %s", step, _fmt(res))
                _append_jsonl(metrics_log, {"step": step, "heldout": res})
            if (time.perf_counter() - last_ckpt >= cfg.ckpt_every_s
                    or (cfg.ckpt_every_steps and step % cfg.ckpt_every_steps == 0)):
                save()
                last_ckpt = time.perf_counter()
        save()
    return state


def _heldout_samples(path: Path | None, limit: int) -> list[Sample]:
    if path is None or not list_shards(path):
        return []
    samples = load_samples(list_shards(path))
    return samples[:limit] if limit else samples


# ============================================================================================
# Evaluation: the draft against the target's recorded distributions
# ============================================================================================

LogitsFn = Callable[[np.ndarray], np.ndarray]  # full ids [T] -> full-vocab logits [T, V]


def torch_logits_fn(model, vmap: VocabMap) -> LogitsFn:
    import torch

    full_to_sub = vmap.full_to_sub()
    real = vmap.sub_to_full >= 0

    def fn(ids: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            sub = model(torch.from_numpy(full_to_sub[ids])[None]).logits[0].float().numpy()
        out = np.full((len(ids), vmap.full_vocab_size), -np.inf, dtype=np.float32)
        out[:, vmap.sub_to_full[real]] = sub[:, real]
        return out

    return fn


def onnx_logits_fn(model_dir: Path, threads: int = 1) -> LogitsFn:
    from edge_client.draft_model import OnnxDraftModel

    model = OnnxDraftModel(model_dir, intra_op_threads=threads)
    return lambda ids: model.forward(model.new_cache(), ids.tolist())


def evaluate(logits_fn: LogitsFn, samples: Sequence[Sample], draft_len: int = 4,
             temperature: float = EVAL_TEMPERATURE) -> dict:
    """Per-token acceptance of the draft given the target's prefix, on recorded samples.

    greedy_alpha: argmax q == the target's greedy token (lowest id on ties, both sides).
    tokens_per_round: greedy speculative decoding with K = ``draft_len`` replayed along the
      target's greedy path (exact for greedy samples: the output is that path).
    accept_t1 / accept_t: expected acceptance 1 - TV(p, q) at temperature 1 and ``temperature``,
      with p its recorded top-k renormalised (the mass beyond top-k is negligible).
    """
    matches, a1, at, rounds, emitted = [], [], [], 0, 0
    for s in samples:
        ids = np.concatenate([s.prompt_ids, s.gen_ids]).astype(np.int64)
        logits = logits_fn(ids[:-1])[len(s.prompt_ids) - 1 :]  # [G, V]: predicts gen token j
        top1 = s.topk_ids[:, 0]
        m = np.argmax(logits, axis=-1) == top1
        matches.append(m)
        a1.append(_expected_accept(logits, s.topk_ids, s.topk_logp, 1.0))
        at.append(_expected_accept(logits, s.topk_ids, s.topk_logp, temperature))
        if not s.sampled:
            r, e = _replay_greedy(m, draft_len)
            rounds += r
            emitted += e
    m = np.concatenate(matches) if matches else np.zeros(0)
    return {
        "samples": len(samples),
        "tokens": int(m.size),
        "greedy_alpha": round(float(m.mean()), 4) if m.size else None,
        "tokens_per_round": round(emitted / rounds, 3) if rounds else None,
        "accept_t1": round(float(np.concatenate(a1).mean()), 4) if a1 else None,
        f"accept_t{temperature:g}": round(float(np.concatenate(at).mean()), 4) if at else None,
    }


def _expected_accept(logits: np.ndarray, topk_ids: np.ndarray, topk_logp: np.ndarray,
                     temperature: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    z -= z.max(-1, keepdims=True)
    q = np.exp(z)
    q /= q.sum(-1, keepdims=True)  # [G, V]
    lp = topk_logp.astype(np.float64) / temperature
    p = np.exp(lp - lp.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # [G, k]
    q_k = np.take_along_axis(q, topk_ids, axis=1)
    overlap = np.minimum(p, q_k).sum(-1)  # 1 - TV when p is zero outside its top-k
    return overlap


def _replay_greedy(match: np.ndarray, k: int) -> tuple[int, int]:
    """Rounds and tokens of greedy speculation: accept the matching prefix, plus one token."""
    pos, rounds, n = 0, 0, len(match)
    while pos < n:
        a = 0
        while a < k and pos + a < n and match[pos + a]:
            a += 1
        pos += a + 1
        rounds += 1
    return rounds, n


def _fmt(res: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in res.items())


# ============================================================================================
# Export
# ============================================================================================


@dataclass(frozen=True)
class ExportConfig:
    run_dir: Path
    out: Path
    heldout: Path | None
    target: Path | None
    fp32_out: Path | None = None  # keep the fp32 ONNX here (default: <run>/onnx-fp32)
    eval_samples: int = 0  # 0: every held-out sample
    quantize: bool = True
    per_channel: bool = True
    measure_target: bool = True  # time the target's 1-token step too, for the latency ratio
    # MatMuls whose names contain these keep fp32 activations (int8 weights only).
    keep_fp32: tuple[str, ...] = ("down_proj",)
    # The full-vocabulary PyTorch twin (bench's assisted-generation case); default:
    # shared.paths.draft_twin_dir(out).
    twin_out: Path | None = None


def export(cfg: ExportConfig) -> dict:
    """ckpt.pt -> HF checkpoint -> ONNX fp32 -> int8; evaluates both; writes MODEL_CARD.md."""
    import torch

    from edge_client.tools.export_draft import TOKENIZER_FILES, export_onnx
    from shared.atomic_dir import staging_dir
    from shared.paths import draft_twin_dir

    t_start = time.perf_counter()
    run = Path(cfg.run_dir)
    saved = json.loads((run / "run.json").read_text())
    arch = _arch_from_json(saved["arch"])
    target_dir = Path(cfg.target) if cfg.target is not None else Path(saved["target"])
    vmap = VocabMap.load(run / VOCAB_MAP_FILE)
    ck = torch.load(run / "ckpt.pt", map_location="cpu", weights_only=False)
    model = build_draft(arch if arch.init == "target" else replace(arch, init="scratch"),
                        target_dir, vmap, 0)
    model.load_state_dict(ck["model"])
    model.eval()

    pt_dir = run / "hf"
    with staging_dir(pt_dir) as staged:
        model.save_pretrained(staged, safe_serialization=True)
        for name in TOKENIZER_FILES:
            if (target_dir / name).is_file():
                shutil.copy2(target_dir / name, staged / name)
    twin_dir = Path(cfg.twin_out) if cfg.twin_out else draft_twin_dir(cfg.out)
    with staging_dir(twin_dir) as staged:
        full_vocab_twin(model, vmap).save_pretrained(staged, safe_serialization=True)
    log.info("full-vocabulary PyTorch twin in %s", twin_dir)
    fp32_dir = Path(cfg.fp32_out) if cfg.fp32_out else run / "onnx-fp32"
    export_onnx(pt_dir, fp32_dir)
    if vmap.size != vmap.full_vocab_size:
        vmap.save(fp32_dir / VOCAB_MAP_FILE)

    heldout = _heldout_samples(cfg.heldout, cfg.eval_samples)
    results: dict = {"fp32": {}, "int8": {}}
    if heldout:
        results["torch"] = evaluate(torch_logits_fn(model, vmap), heldout)
        results["fp32"] = evaluate(onnx_logits_fn(fp32_dir), heldout)
        log.info("fp32 ONNX heldout: %s", _fmt(results["fp32"]))
    results["fp32"]["bytes"] = (fp32_dir / "model.onnx").stat().st_size
    results["fp32"]["step_ms"] = measure_step_ms(fp32_dir)

    out = Path(cfg.out)
    with staging_dir(out) as staged:
        for f in fp32_dir.iterdir():
            if f.is_file() and f.name != "model.onnx":
                shutil.copy2(f, staged / f.name)
        if cfg.quantize:
            from onnxruntime.quantization import QuantType, quantize_dynamic

            # reduce_range: per-channel int8 weights without it overflow the u8 x s8 dot
            # products on CPUs without VNNI (measured: greedy acceptance 0.33 -> 0.09).
            # The MLP down projections see SmolLM's activation outliers; quantizing their
            # inputs per tensor cost 0.05 greedy acceptance, so they stay fp32 (measured).
            # The tied LM head reads the embedding through a Transpose, which dynamic
            # quantization skips (not a constant): untied, it is quantized too (measured:
            # draft step 8.6-8.9 -> 4.1-4.2 ms at 2 threads, greedy acceptance -0.0015).
            untied = staged / "untied.onnx"
            source = untied if untie_lm_head(fp32_dir / "model.onnx", untied) \
                else fp32_dir / "model.onnx"
            quantize_dynamic(source, staged / "model.onnx",
                             weight_type=QuantType.QInt8, per_channel=cfg.per_channel,
                             reduce_range=True,
                             nodes_to_exclude=_matmuls_named(source, cfg.keep_fp32))
            untied.unlink(missing_ok=True)
            for extra in staged.glob("*.onnx.data"):
                extra.unlink()
            # Those MatMuls still get int8 weights, dequantized once at load: weight-only
            # quantization keeps their fp32 activations (measured: greedy acceptance 0.4892
            # with fp32 weights, 0.4898 weight-only; the file 47 -> 31 MB).
            weight_only_int8(staged / "model.onnx",
                             _matmuls_named(staged / "model.onnx", cfg.keep_fp32))
        else:
            shutil.copy2(fp32_dir / "model.onnx", staged / "model.onnx")
        key = "int8" if cfg.quantize else "fp32_copy"
        results[key] = evaluate(onnx_logits_fn(staged), heldout) if heldout else {}
        results[key]["bytes"] = (staged / "model.onnx").stat().st_size
        results[key]["step_ms"] = measure_step_ms(staged)
        if heldout:
            log.info("%s ONNX heldout: %s", key, _fmt(results[key]))
        if cfg.measure_target:
            results["target_step_ms"] = measure_target_step_ms(target_dir)
        card = model_card(arch, model, vmap, ck, saved, results, cfg,
                          time.perf_counter() - t_start)
        (staged / "MODEL_CARD.md").write_text(card)
        _write_json(staged / "distill_results.json", _jsonable(results))
    log.info("exported draft to %s", out)
    return results


def full_vocab_twin(model, vmap: VocabMap):
    """The draft as a LlamaForCausalLM over the target's whole vocabulary, for baselines
    that need the target's vocabulary (transformers assisted generation).

    Ids outside the subset read the <unk> embedding, as on the edge. Their output rows are
    zero, so their logits are 0 where the edge has -inf: the twin drafts the same tokens
    whenever the best kept logit is positive (LM heads' top logits are).
    """
    import torch
    from transformers import LlamaForCausalLM

    cfg = model.config.to_dict()
    cfg.update(vocab_size=vmap.full_vocab_size, tie_word_embeddings=False)
    twin = LlamaForCausalLM(type(model.config).from_dict(cfg))
    state = {k: v for k, v in model.state_dict().items()
             if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    twin.load_state_dict(state, strict=False)
    full_to_sub = torch.from_numpy(vmap.full_to_sub())
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        twin.get_input_embeddings().weight.copy_(emb[full_to_sub])
        head = emb[full_to_sub].clone()
        if vmap.unk >= 0:
            head[full_to_sub == vmap.unk] = 0.0
        twin.lm_head.weight.copy_(head)
    return twin.eval()


def weight_only_int8(onnx_path: Path, node_names: Sequence[str]) -> None:
    """Stores the weights of the named fp32 MatMuls as int8 (symmetric, one scale per output
    column) behind a DequantizeLinear, in place. onnxruntime folds the dequantization into a
    constant when the session loads, so the MatMul still runs in fp32 on fp32 activations:
    a quarter of the bytes on disk, the accuracy of fp32."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(onnx_path))
    graph = model.graph
    weights = {t.name: t for t in graph.initializer}
    wanted = set(node_names)
    nodes = []
    for node in graph.node:
        if node.name in wanted and node.op_type == "MatMul" and node.input[1] in weights:
            name = node.input[1]
            w = numpy_helper.to_array(weights[name]).astype(np.float32)  # [in, out]
            scale = np.abs(w).max(axis=0) / 127.0
            scale[scale == 0] = 1.0
            q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
            graph.initializer.remove(weights[name])
            graph.initializer.extend([
                numpy_helper.from_array(q, f"{name}_int8"),
                numpy_helper.from_array(scale.astype(np.float32), f"{name}_int8_scale"),
                numpy_helper.from_array(np.zeros(q.shape[1], np.int8), f"{name}_int8_zero")])
            nodes.append(helper.make_node(
                "DequantizeLinear", [f"{name}_int8", f"{name}_int8_scale", f"{name}_int8_zero"],
                [f"{name}_dequantized"], name=f"{node.name}_dequantize", axis=1))
            node.input[1] = f"{name}_dequantized"
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(onnx_path))


def untie_lm_head(onnx_in: Path, onnx_out: Path) -> bool:
    """Writes ``onnx_in`` to ``onnx_out`` with the LM head's weight as its own constant when
    the head is tied (a MatMul on a Transpose of the embedding initializer). Returns False,
    writing nothing, when the head already has a constant weight or is not found."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(onnx_in))
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {out: n for n in graph.node for out in n.output}
    heads = [n for n in graph.node if n.op_type == "MatMul" and "lm_head" in n.name]
    if len(heads) != 1 or heads[0].input[1] in inits:
        return False
    head = heads[0]
    transpose = producer.get(head.input[1])
    if transpose is None or transpose.op_type != "Transpose" \
            or transpose.input[0] not in inits:
        return False
    weight = numpy_helper.to_array(inits[transpose.input[0]])
    perm = next((list(a.ints) for a in transpose.attribute if a.name == "perm"), None)
    name = "lm_head.weight_untied"
    graph.initializer.append(numpy_helper.from_array(
        np.ascontiguousarray(np.transpose(weight, perm)), name))
    head.input[1] = name
    if not any(transpose.output[0] in n.input for n in graph.node):
        graph.node.remove(transpose)
    onnx.save(model, str(onnx_out))
    return True


def _matmuls_named(onnx_path: Path, patterns: Sequence[str]) -> list[str]:
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return [n.name for n in graph.node
            if n.op_type == "MatMul" and any(p in n.name for p in patterns)]


def measure_step_ms(model_dir: Path, context: int = 128, steps: int = 32,
                    threads: int = 1) -> float:
    """Median wall time of one single-token draft step after ``context`` cached tokens."""
    from edge_client.draft_model import OnnxDraftModel

    model = OnnxDraftModel(model_dir, intra_op_threads=threads)
    rng = np.random.default_rng(0)
    cache = model.new_cache()
    vocab = model.vocab_size
    model.forward(cache, rng.integers(0, vocab, size=context).tolist())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model.forward(cache, [int(rng.integers(0, vocab))])
        times.append(time.perf_counter() - t0)
    return round(1000 * float(np.median(times)), 3)


def measure_target_step_ms(target_dir: Path, context: int = 128, steps: int = 16) -> float:
    """Median wall time of one single-token step of the target (PyTorch, this process's threads)."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(0))
    cache, times = DynamicCache(), []
    with torch.inference_mode():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        for i in range(steps):
            t0 = time.perf_counter()
            model(input_ids=ids[:, i : i + 1], past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
    return round(1000 * float(np.median(times)), 3)


def model_card(arch: ArchConfig, model, vmap: VocabMap, ck: dict, saved: dict, results: dict,
               cfg: ExportConfig, export_s: float) -> str:
    st, tc = ck["state"], ck.get("train_config", {})
    n_params = sum(p.numel() for p in model.parameters())
    lines = [
        "# edgespec distilled draft",
        "",
        "A small Llama-architecture draft for SmolLM2-135M-Instruct, distilled on the target's",
        "own top-k distributions (`edgespec-distill`), exported to ONNX with a KV cache and",
        "dynamically quantized to int8 (weights; activations quantized at run time), except",
        f"the MatMuls named {list(cfg.keep_fp32)}, whose weights are int8 but whose",
        "activations stay fp32 (weight-only: dequantized once when the model loads). A tied",
        "LM head is stored apart from the embedding in the ONNX file, so it is int8 too.",
        "",
        "## Architecture",
        "",
        f"- init: `{arch.init}`" + (f", target layers {list(arch.target_layers)}"
                                   if arch.init == "target" else ""),
        f"- hidden {model.config.hidden_size}, layers {model.config.num_hidden_layers}, heads "
        f"{model.config.num_attention_heads} (kv {model.config.num_key_value_heads}), MLP "
        f"{model.config.intermediate_size}, tied embeddings",
        f"- vocabulary: {vmap.size} draft ids"
        + (f" ({vmap.size - 1} most frequent target tokens + 1 `<unk>` input slot; "
           f"`vocab_map.npz` maps them to the {vmap.full_vocab_size}-token target vocabulary)"
           if vmap.size != vmap.full_vocab_size else " (the full target vocabulary)"),
        f"- parameters: {n_params / 1e6:.2f} M",
        "",
        "## Training",
        "",
        f"- data: {', '.join(f'`{d}`' for d in _as_dirs(tc.get('data')))} (shards "
        f"{len(st.get('epoch_shards') or [])} in the last epoch), target top-k distributions "
        "at temperature 1",
        *([f"- started from the weights of run `{saved['init_from']}` (its own lineage is in "
           "the wall-time table)"] if saved.get("init_from") else []),
        f"- loss: KL(p_topk || q) + {tc.get('tv_weight')} * TV(p_topk, q)",
        f"- steps {st['step']}, batch {tc.get('batch_size')} sequences, epochs {st['epoch']}, "
        f"tokens seen {st['tokens_seen']:,}, lr {tc.get('lr')} (AdamW, cosine), seed "
        f"{saved.get('seed')}",
        f"- wall time {st['wall_s'] / 60:.1f} min on the 2-core CPU VM",
        "",
        "## Held-out acceptance (prompts never trained on)",
        "",
        "greedy_alpha: draft argmax == target greedy token given the target's prefix; "
        "tokens_per_round: greedy, K=4, replayed on the target's greedy path; accept_t*: "
        "expected 1 - TV(p, q) at that temperature.",
        "",
        "| model | " + " | ".join(k for k in results.get("fp32", {}) ) + " |",
        "|---|" + "---|" * len(results.get("fp32", {})),
    ]
    for name in ("torch", "fp32", "int8", "fp32_copy"):
        if name in results:
            lines.append(f"| {name} | " + " | ".join(str(results[name].get(k, ""))
                                                    for k in results.get("fp32", {})) + " |")
    lines += ["", "step_ms: median single-token ONNX step with 128 cached tokens, 1 thread."]
    if "target_step_ms" in results:
        lines.append(f"The target's 1-token step (PyTorch, same machine, same moment): "
                     f"{results['target_step_ms']} ms.")
    stages = _pipeline_stages(Path(cfg.run_dir), ck)
    for name, m in stages["data"].items():
        lines.append(f"Data `{name}` at export time: {m.get('total_prompts')} prompts, "
                     f"{m.get('total_tokens')} generated tokens with top-k p"
                     + (f" (continuations written by run `{m['draft_run']}`'s draft, labelled "
                        "by the target)" if m.get("draft_run") else "") + ".")
    lines += ["", "## Pipeline wall time", "",
              "Every stage behind these weights, including the runs they started from. gen-data"
              " is the sum over shards; each shard is one single-thread worker, so parallel"
              " workers overlap.", "", "| stage | minutes |", "|---|---|"]
    total = export_s
    for name, m in stages["data"].items():
        lines.append(f"| gen-data `{Path(name).name}` | {m['seconds'] / 60:.1f} |")
        total += m["seconds"]
    for name, seconds in stages["train"]:
        lines.append(f"| train `{Path(name).name}` | {seconds / 60:.1f} |")
        total += seconds
    lines += [f"| export (ONNX, int8, evaluation) | {export_s / 60:.1f} |",
              f"| total | {total / 60:.1f} |", ""]
    return "\n".join(lines)


# ============================================================================================
# Helpers and command line
# ============================================================================================


def _as_dirs(data) -> list[Path]:
    """A TrainConfig.data value (one directory or several; JSON-loaded or not) as a list."""
    if data is None:
        return []
    return [Path(data)] if isinstance(data, (str, Path)) else [Path(d) for d in data]


def _pipeline_stages(run: Path, ck: dict) -> dict:
    """The gen-data directories and training runs behind a run's weights, following
    ``init_from`` back: {"data": {dir: manifest + seconds + draft_run}, "train": [(run,
    seconds)], oldest run first}."""
    import torch

    data: dict[str, dict] = {}
    train_runs: list[tuple[str, float]] = []
    while True:
        train_runs.insert(0, (str(run), ck["state"]["wall_s"]))
        for d in _as_dirs(ck.get("train_config", {}).get("data")):
            manifest, config = d / "manifest.json", d / "config.json"
            if str(d) in data or not manifest.is_file():
                continue
            m = json.loads(manifest.read_text())
            m["seconds"] = sum(sh.get("seconds", 0.0) for sh in m.get("shards", {}).values())
            if config.is_file():
                m["draft_run"] = json.loads(config.read_text()).get("draft_run")
            data[str(d)] = m
        parent = json.loads((run / "run.json").read_text()).get("init_from")
        if not parent or not (Path(parent) / "ckpt.pt").is_file():
            return {"data": dict(sorted(data.items())), "train": train_runs}
        run = Path(parent)
        # mmap: only the metadata read here is paged in, not weights and optimizer state
        ck = torch.load(run / "ckpt.pt", map_location="cpu", weights_only=False, mmap=True)


def _arch_from_json(obj: dict) -> ArchConfig:
    return ArchConfig(**{**obj, "target_layers": tuple(obj["target_layers"])})


def _default_target() -> Path:
    from shared import paths

    return paths.default_target_dir()


def _vocab_size(target_dir: Path) -> int:
    return int(json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"])


def _special_ids(target_dir: Path) -> list[int]:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    ids = {cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    flat = set()
    for i in ids:
        if isinstance(i, list):
            flat.update(i)
        elif i is not None:
            flat.add(i)
    return sorted(flat)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {k: _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _write_json(path: Path, obj) -> None:
    tmp = Path(tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")[1])
    tmp.write_text(json.dumps(_jsonable(obj), indent=2))
    os.replace(tmp, path)


def _append_jsonl(path: Path, obj) -> None:
    with path.open("a") as f:
        f.write(json.dumps(_jsonable(obj)) + "\n")


def _parse_layers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip()) if text else ()


def parse_args(argv: Sequence[str] | None):
    p = argparse.ArgumentParser(prog="edgespec-distill", description=__doc__.split("\n")[0])
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("gen-data", help="record the target's top-k distributions")
    g.add_argument("--out", type=Path, required=True)
    g.add_argument("--target", type=Path, default=None)
    g.add_argument("--split", choices=SPLITS, default="train")
    g.add_argument("--shard-size", type=int, default=64)
    g.add_argument("--batch-size", type=int, default=16)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--top-k", type=int, default=64)
    g.add_argument("--sample-fraction", type=float, default=0.5,
                   help="share of prompts continued by sampling (the rest greedy)")
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-prompts", type=int, default=0)
    g.add_argument("--threads", type=int, default=0)
    g.add_argument("--worker", default="0/1",
                   help="i/n: run as worker i of n parallel processes (disjoint shards)")
    g.add_argument("--draft-run", type=Path, default=None,
                   help="on-policy data: this training run's draft writes the continuations, "
                        "the target labels them")

    t = sub.add_parser("train", help="distil a draft (resumes from <run-dir>/ckpt.pt)")
    t.add_argument("--run-dir", type=Path, required=True)
    t.add_argument("--data", type=Path, nargs="+", required=True, help="gen-data dirs")
    t.add_argument("--init-from", type=Path, default=None,
                   help="start from this finished run's architecture, vocabulary and weights")
    t.add_argument("--heldout", type=Path, default=None, help="gen-data dir of held-out prompts")
    t.add_argument("--target", type=Path, default=None)
    t.add_argument("--init", choices=["scratch", "pca", "target"], default="scratch")
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--intermediate", type=int, default=768)
    t.add_argument("--target-layers", type=_parse_layers, default=(),
                   help="init=target: comma-separated target layers to copy, e.g. 0,1,2,29")
    t.add_argument("--sub-vocab", type=int, default=16384, help="0: the full vocabulary")
    t.add_argument("--steps", type=int, default=2000)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=50)
    t.add_argument("--tv-weight", type=float, default=1.0)
    t.add_argument("--max-len", type=int, default=320)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--ckpt-every-s", type=float, default=300.0)
    t.add_argument("--ckpt-every-steps", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=200)
    t.add_argument("--eval-samples", type=int, default=64)
    t.add_argument("--log-every", type=int, default=10)
    t.add_argument("--threads", type=int, default=0)
    t.add_argument("--lr-steps", type=int, default=0,
                   help="cosine horizon (default --steps); fix it to extend a run unchanged")

    e = sub.add_parser("export", help="ONNX + int8 + MODEL_CARD.md from a run's checkpoint")
    e.add_argument("--run-dir", type=Path, required=True)
    e.add_argument("--out", type=Path, required=True)
    e.add_argument("--heldout", type=Path, default=None)
    e.add_argument("--target", type=Path, default=None)
    e.add_argument("--fp32-out", type=Path, default=None)
    e.add_argument("--eval-samples", type=int, default=0)
    e.add_argument("--no-quantize", action="store_true")
    e.add_argument("--no-target-timing", action="store_true")
    e.add_argument("--threads", type=int, default=0)

    v = sub.add_parser("eval", help="held-out acceptance of a run or an ONNX draft dir")
    v.add_argument("what", type=Path, help="a run dir (ckpt.pt) or an ONNX draft dir")
    v.add_argument("--heldout", type=Path, required=True)
    v.add_argument("--target", type=Path, default=None)
    v.add_argument("--eval-samples", type=int, default=0)
    v.add_argument("--threads", type=int, default=0)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return _run(args)
    except ValueError as exc:  # bad settings: say so in one line
        log.error("%s", exc)
        return 2


def _run(args) -> int:
    if args.cmd == "gen-data":
        gen_data(GenConfig(args.target, args.out, args.split, args.shard_size, args.batch_size,
                           args.max_new_tokens, args.top_k, args.sample_fraction,
                           args.temperature, args.seed, args.max_prompts, args.threads,
                           *map(int, args.worker.split("/")), draft_run=args.draft_run))
    elif args.cmd == "train":
        arch = ArchConfig(args.init, args.hidden, args.layers, args.heads, args.kv_heads,
                          args.intermediate, args.target_layers, args.sub_vocab)
        train(TrainConfig(args.run_dir, args.data, args.heldout, args.target, arch, args.steps,
                          args.batch_size, args.lr, warmup=args.warmup,
                          tv_weight=args.tv_weight, max_len=args.max_len, seed=args.seed,
                          ckpt_every_s=args.ckpt_every_s, ckpt_every_steps=args.ckpt_every_steps,
                          eval_every=args.eval_every, eval_samples=args.eval_samples,
                          threads=args.threads, log_every=args.log_every,
                          lr_steps=args.lr_steps, init_from=args.init_from))
    elif args.cmd == "export":
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        res = export(ExportConfig(args.run_dir, args.out, args.heldout, args.target,
                                  args.fp32_out, args.eval_samples, not args.no_quantize,
                                  measure_target=not args.no_target_timing))
        print(json.dumps(_jsonable(res), indent=2))
    elif args.cmd == "eval":
        print(json.dumps(_jsonable(eval_command(args.what, args.heldout, args.target,
                                                args.eval_samples, args.threads)), indent=2))
    return 0


def eval_command(what: Path, heldout: Path, target: Path | None, limit: int,
                 threads: int) -> dict:
    samples = _heldout_samples(heldout, limit)
    if (Path(what) / "model.onnx").exists():
        return evaluate(onnx_logits_fn(Path(what), threads or 1), samples)
    import torch

    if threads:
        torch.set_num_threads(threads)
    model, vmap = load_run(Path(what), target)
    return evaluate(torch_logits_fn(model, vmap), samples)


def load_run(run: Path, target: Path | None = None):
    """(draft in eval mode, its VocabMap) from a training run's directory and checkpoint."""
    import torch

    saved = json.loads((run / "run.json").read_text())
    vmap = VocabMap.load(run / VOCAB_MAP_FILE)
    model = build_draft(_arch_from_json(saved["arch"]),
                        Path(target) if target else Path(saved["target"]), vmap, 0)
    ck_path = run / "ckpt.pt"
    if ck_path.exists():
        model.load_state_dict(torch.load(ck_path, map_location="cpu", weights_only=False)["model"])
    return model.eval(), vmap




if __name__ == "__main__":
    raise SystemExit(main())
