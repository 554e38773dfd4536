"""``gen-data``: the target continues the distillation prompts (batched, left padded; some rows
greedy, some sampled) and records, for every generated token, the top-k token ids and
log-probabilities of the target's distribution p at temperature 1 that position was decided
from. One shard per ``--shard-size`` prompts, written atomically; a rerun skips finished
shards. With ``--draft-run`` the data is on-policy: a trained draft writes the continuations
(the text it will be asked to extend on the edge) and the target labels every position in one
teacher-forced forward, which costs the target far less than generating them. The prompts are
a template split (``--split``) or a JSONL prompt file (``--prompts-file``, module
``prompt_file``)."""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from edge_client.tools.distill.common import (
    check_engine,
    default_target,
    engine_label,
    jsonable,
    write_json,
)
from edge_client.tools.distill.model import full_vocab_twin, load_run
from edge_client.tools.distill.prompt_file import encode_prompt, file_digest, load_prompts_file
from edge_client.tools.distill.prompts import prompt_split
from edge_client.tools.distill.shards import Sample, write_shard
from edge_client.tools.distill.vocab import VocabMap

log = logging.getLogger("edgespec.distill")


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
    # A JSONL prompt file (module ``prompt_file``, e.g. from ``gen-prompts``) instead of split.
    prompts_file: Path | None = None
    # Also record the target's last hidden state at every decision (Sample.features), for
    # drafts conditioned on it. Target-written data only.
    features: bool = False
    # Who runs the target: the built-in path (torch, left-padded batches) or vLLM (continuous
    # batching, module data_vllm). Either writes the same shards; the manifest says which.
    engine: str = "builtin"
    dtype: str = "float32"  # vLLM's dtype (the built-in path runs the target in float32)


def gen_data(cfg: GenConfig, prompts: Sequence | None = None, vllm_writer=None,
             time_left: Callable[[float], bool] | None = None,
             on_shard: Callable[[int], None] | None = None) -> Path:
    """Fill ``cfg.out`` with shards; skips shards already written. Returns ``cfg.out``.
    ``vllm_writer``: a running ``data_vllm.VllmWriter`` for ``--engine vllm`` (default: start
    one). ``time_left(seconds)``: whether a shard that takes as long as the last one may still
    start (``corpus`` runs in bounded chunks). ``on_shard``: called with each written shard's
    token count."""
    import torch

    from cloud_verifier.target_model import load_target
    from edge_client.tokenizer import EdgeTokenizer

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.features and cfg.draft_run is not None:
        raise ValueError("--features needs target-written data (no --draft-run)")
    check_engine(cfg.engine, cfg.dtype)
    if cfg.engine == "vllm" and (cfg.features or cfg.draft_run is not None):
        raise ValueError("--engine vllm writes target-written data without features "
                         "(no --features, no --draft-run)")
    if prompts is None and cfg.prompts_file is not None:
        prompts = load_prompts_file(cfg.prompts_file)
    elif prompts is None:
        prompts = prompt_split(cfg.split)  # type: ignore[arg-type]
    order = np.random.default_rng(cfg.seed).permutation(len(prompts))
    if cfg.max_prompts:
        order = order[: cfg.max_prompts]
    config = out / "config.json"
    _check_resume(config, cfg)
    # A prompt file may be regenerated bigger; its shards would then hold other prompts.
    digest = file_digest(cfg.prompts_file) if cfg.prompts_file else None
    if digest and config.exists() and (
            json.loads(config.read_text()).get("prompts_sha256") != digest):
        raise ValueError(f"{cfg.prompts_file} changed since {out} was generated from it; "
                         "use a new --out")
    write_json(config, {**jsonable(asdict(cfg)), "num_prompts": len(order),
                        "prompts_sha256": digest})

    target_dir = Path(cfg.target) if cfg.target is not None else default_target()
    tok = EdgeTokenizer(target_dir)
    if cfg.engine == "vllm":
        from edge_client.tools.distill.data_vllm import VllmWriter

        target = writer = vllm_writer or VllmWriter.start(cfg.target, cfg.dtype, cfg.threads)
        eos_ids = writer.eos
    else:
        target = load_target(cfg.target, device="cpu")
        eos_ids = target.eos_token_ids
        writer = target.model if cfg.draft_run is None else _HeadOnly(
            *load_run(cfg.draft_run, cfg.target))
    eos, pad_id = set(eos_ids), eos_ids[0]

    n_shards = math.ceil(len(order) / cfg.shard_size)
    total_tokens, t_start = 0, time.perf_counter()
    last_shard_s = 0.0
    for shard in range(n_shards):
        path = out / f"shard-{shard:05d}.npz"
        if path.exists() or shard % cfg.workers != cfg.worker:
            continue
        if time_left is not None and not time_left(last_shard_s):
            log.info("gen-data: time is up before shard %d/%d; rerun to go on", shard + 1,
                     n_shards)
            return out
        idx = order[shard * cfg.shard_size : (shard + 1) * cfg.shard_size]
        encoded = []
        for i in idx:
            p = prompts[int(i)]
            ids = encode_prompt(tok, p)
            # One draw per prompt decides greedy vs sampled, independent of batching.
            sampled = bool(np.random.default_rng([cfg.seed, int(i)]).random() < cfg.sample_fraction)
            encoded.append((int(i), ids, sampled))
        encoded.sort(key=lambda e: len(e[1]))  # less padding per batch
        gen = torch.Generator().manual_seed(cfg.seed * 100003 + shard)
        samples, index, t0, n_tok = [], [], time.perf_counter(), 0
        if cfg.engine == "vllm":  # vLLM batches the whole shard itself
            from edge_client.tools.distill.data_vllm import VllmRow

            samples = writer.generate([VllmRow(i, list(ids), s) for i, ids, s in encoded],
                                      cfg.max_new_tokens, cfg.top_k, cfg.temperature, cfg.seed)
            index = [e[0] for e in encoded]
            n_tok = sum(len(r.gen_ids) for r in samples)
            encoded = []
        for b in range(0, len(encoded), cfg.batch_size):
            batch = encoded[b : b + cfg.batch_size]
            on_policy = writer is not target.model
            rows = _generate_batch(writer, [e[1] for e in batch], [e[2] for e in batch], cfg,
                                   eos, pad_id, gen, record_top_k=not on_policy)
            if on_policy:
                rows = label_rows(target.model, rows, cfg.top_k, pad_id)
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
        last_shard_s = time.perf_counter() - t0
        record_shard(out, path.name, len(samples), n_tok, last_shard_s,
                         engine=engine_label(cfg.engine, cfg.dtype))
        if on_shard is not None:
            on_shard(n_tok)
    log.info("gen-data done: %d shards in %s", n_shards, out)
    return out


# What a data directory's shards depend on; a resumed run must use the same values.
_DATA_FIELDS = ("split", "shard_size", "batch_size", "max_new_tokens", "top_k",
                "sample_fraction", "temperature", "seed", "max_prompts", "draft_run",
                "prompts_file", "features")


def _check_resume(config_path: Path, cfg: GenConfig) -> None:
    """Refuses to add shards made with other settings to an existing data directory."""
    if not config_path.exists():
        return
    stored = json.loads(config_path.read_text())
    wanted = jsonable(asdict(cfg))
    defaults = jsonable(asdict(GenConfig(None, Path())))  # fields older directories lack
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
    arrays are then empty, for ``label_rows`` to fill)."""
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
    out_feat: list[list[np.ndarray]] = [[] for _ in range(n)]
    alive = torch.arange(n)  # original row of each batch row
    cache = DynamicCache()
    prompt_feat: list[np.ndarray | None] = [None] * n

    def step(prefill: bool = False, **kwargs):
        """Last-position logits (float32) and, with ``cfg.features``, the hidden state the LM
        head read there (float16 numpy); the prefill also keeps every prompt position's."""
        if not cfg.features:
            return model(**kwargs, use_cache=True).logits[:, -1, :].float(), None
        states = model.model(**kwargs, use_cache=True).last_hidden_state
        if prefill:  # rows are left padded
            every = states.to(torch.float16).numpy()
            for r, p in enumerate(prompts):
                prompt_feat[r] = every[r, width - len(p):]
        hidden = states[:, -1, :]
        return model.lm_head(hidden).float(), hidden.to(torch.float16).numpy()

    with torch.inference_mode():
        logits, feat = step(True, input_ids=input_ids, attention_mask=mask,
                            position_ids=positions, past_key_values=cache)
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
                if feat is not None:
                    out_feat[r].append(feat[j])
                done[j] = tid in eos
            keep = (~done).nonzero().flatten()
            if keep.numel() == 0:
                break
            if keep.numel() < len(alive):
                cache.batch_select_indices(keep)
                mask, token, next_pos, alive = mask[keep], token[keep], next_pos[keep], alive[keep]
            mask = torch.cat([mask, torch.ones((len(alive), 1), dtype=mask.dtype)], dim=1)
            logits, feat = step(input_ids=token[:, None], attention_mask=mask,
                                position_ids=next_pos[:, None], past_key_values=cache)
            next_pos = next_pos + 1
    return [
        Sample(np.asarray(prompts[r]), np.asarray(out_tokens[r]), np.stack(out_ids[r]),
               np.stack(out_logp[r]), sampled[r],
               np.stack(out_feat[r]) if cfg.features else None, prompt_feat[r])
        for r in range(n)
    ]


def label_rows(model, rows: list[Sample], top_k: int, pad_id: int) -> list[Sample]:
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


def record_shard(out: Path, name: str, prompts: int, tokens: int, seconds: float,
                     engine: str) -> None:
    path = out / "manifest.json"
    manifest = json.loads(path.read_text()) if path.exists() else {"shards": {}}
    manifest["shards"][name] = {"prompts": prompts, "tokens": tokens,
                                "seconds": round(seconds, 1), "engine": engine}
    manifest["total_prompts"] = sum(s["prompts"] for s in manifest["shards"].values())
    manifest["total_tokens"] = sum(s["tokens"] for s in manifest["shards"].values())
    write_json(path, manifest)
