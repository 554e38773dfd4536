"""``export-head``: a train-head run -> ONNX (one chain step with this chain's KV cache, the
graph ``edge_client.feature_draft`` runs) -> int8, with ``feature_head.json`` (what target
feature the head reads, with the target weights fingerprint), ``vocab_map.npz``,
MODEL_CARD.md and ``head_results.json`` (held-out alpha of torch, fp32 and int8, size, step
times)."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edge_client.tools.distill.common import as_dirs, write_json
from edge_client.tools.distill.head_eval import evaluate_runtime, evaluate_torch
from edge_client.tools.distill.head_model import (
    FEATURE_LAYER,
    TargetShape,
    legacy_codec,
    load_head_run,
    target_fingerprint,
)
from edge_client.tools.distill.quantize import matmuls_named, weight_only_int8
from edge_client.tools.distill.shards import heldout_samples
from edge_client.tools.distill.vocab import VOCAB_MAP_FILE

log = logging.getLogger("edgespec.distill")

INPUTS = ("input_ids", "features", "past_key", "past_value")
OUTPUTS = ("logits", "next_features", "present_key", "present_value")
OPSET = 17


@dataclass(frozen=True)
class HeadExportConfig:
    run_dir: Path
    out: Path
    heldout: Path | None = None
    target: Path | None = None
    eval_samples: int = 0  # 0: every held-out sample
    quantize: bool = True
    # MatMuls whose names contain these keep fp32 activations (int8 weights only). SmolLM2's
    # final hidden states have outlier dimensions (median |f| 0.84, max about 20 on real
    # text): dynamic int8 of the LM head's input changed the target's own argmax at 7% of
    # 103 real positions, weight-only int8 at none (measured). down_proj as in the draft.
    keep_fp32: tuple[str, ...] = ("down_proj", "lm_head")
    measure_target: bool = True


def head_metadata(shape: TargetShape, vmap, fingerprint: str, codec: str, max_chain: int,
                  target_name: str, trained_chain_len: int) -> dict:
    """``feature_head.json``: what the runtime (``edge_client.feature_draft``) checks and
    needs."""
    return {
        "kind": "feature-head",
        "format": 1,
        "feature_layer": FEATURE_LAYER,
        "hidden_size": shape.hidden,
        "feature_dtype": codec,  # a shared.feature_codec name
        "target_fingerprint": fingerprint,
        "target": target_name,
        "vocab_size": vmap.full_vocab_size,
        "sub_vocab": vmap.size,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "max_chain": max_chain,
        "trained_chain_len": trained_chain_len,
        "inputs": list(INPUTS),
        "outputs": list(OUTPUTS),
        "opset": OPSET,
    }


def export_onnx(head, path: Path) -> None:
    """The torch head as an fp32 ONNX graph with dynamic batch, step and cache lengths."""
    import torch

    h = head.fc.weight.shape[0]
    ids = torch.zeros((1, 1), dtype=torch.long)
    feats = torch.zeros((1, 1, h))
    past = torch.zeros((1, head.kv_heads, 2, head.head_dim))
    axes = {"input_ids": {0: "batch", 1: "steps"}, "features": {0: "batch", 1: "steps"},
            "past_key": {0: "batch", 2: "past"}, "past_value": {0: "batch", 2: "past"},
            "logits": {0: "batch", 1: "steps"}, "next_features": {0: "batch", 1: "steps"},
            "present_key": {0: "batch", 2: "length"}, "present_value": {0: "batch", 2: "length"}}
    # The TorchScript exporter (dynamo=False): it needs no onnxscript and handles the cache's
    # dynamic length through dynamic_axes; torch 2.13 still ships it (deprecated).
    with torch.no_grad():
        torch.onnx.export(head, (ids, feats, past, past), str(path), input_names=list(INPUTS),
                          output_names=list(OUTPUTS), dynamic_axes=axes, opset_version=OPSET,
                          dynamo=False, do_constant_folding=True)


def quantize_int8(fp32: Path, out: Path, keep_fp32: tuple[str, ...]) -> None:
    """Dynamic int8 (weights int8 per channel, activations at run time), the embedding
    gather int8 too; the named MatMuls weight-only (``quantize.weight_only_int8``)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    # reduce_range: per-channel int8 weights overflow u8 x s8 dot products on CPUs without
    # VNNI otherwise (the draft export measured it).
    quantize_dynamic(fp32, out, weight_type=QuantType.QInt8, per_channel=True,
                     reduce_range=True, nodes_to_exclude=matmuls_named(fp32, keep_fp32))
    weight_only_int8(out, matmuls_named(out, keep_fp32))


def export_head(cfg: HeadExportConfig) -> dict:
    from shared.atomic_dir import staging_dir

    t0 = time.perf_counter()
    run = Path(cfg.run_dir)
    head, vmap, saved, ck = load_head_run(run, cfg.target)
    if saved.get("context"):
        raise ValueError(f"{run} is a context head: the edge runtime and the verifier's context "
                         "features are not built yet (docs/feature-draft.md), so it has no "
                         "export; its held-out figures are in the run's metrics.jsonl")
    target_dir = Path(cfg.target) if cfg.target else Path(saved["target"])
    shape = TargetShape.from_dir(target_dir)
    fingerprint = target_fingerprint(target_dir)
    codec = saved.get("feature_codec") or legacy_codec(shape.hidden)
    heldout = heldout_samples(cfg.heldout, cfg.eval_samples)
    results: dict = {}
    if heldout:
        results["torch"] = evaluate_torch(head, vmap, heldout, codec)
    out = Path(cfg.out)
    with staging_dir(out) as staged:
        fp32_dir = run / "onnx-fp32"
        fp32_dir.mkdir(exist_ok=True)
        export_onnx(head, fp32_dir / "model.onnx")
        meta = head_metadata(shape, vmap, fingerprint, codec, saved["arch"]["max_chain"],
                             target_dir.name, ck["train_config"]["chain_len"])
        for d in (fp32_dir, staged):
            write_json(d / "feature_head.json", meta)
            vmap.save(d / VOCAB_MAP_FILE)
        if cfg.quantize:
            quantize_int8(fp32_dir / "model.onnx", staged / "model.onnx", cfg.keep_fp32)
        else:
            shutil.copy2(fp32_dir / "model.onnx", staged / "model.onnx")
        for name, d in (("fp32", fp32_dir), ("int8" if cfg.quantize else "fp32_copy", staged)):
            res = evaluate_runtime(d, heldout) if heldout else {}
            res["bytes"] = (d / "model.onnx").stat().st_size
            res["step_ms"] = measure_head_step_ms(d)
            results[name] = res
            log.info("%s: %s", name, res)
        if cfg.measure_target:
            from edge_client.tools.distill.export import measure_target_step_ms

            results["target_step_ms"] = measure_target_step_ms(target_dir)
        (staged / "MODEL_CARD.md").write_text(
            head_card(head, vmap, saved, ck, meta, results, cfg, time.perf_counter() - t0))
        write_json(staged / "head_results.json", results)
    log.info("exported feature head to %s", out)
    return results


def measure_head_step_ms(model_dir: Path, chains: int = 32, k: int = 4,
                         threads: int = 1) -> float:
    """Median wall time of one chain step: chains of one known token and k greedy drafts."""
    from edge_client.drafter import DraftSampling
    from edge_client.feature_draft import FeatureHead, read_spec

    head = FeatureHead(model_dir, read_spec(model_dir), intra_op_threads=threads)
    rng = np.random.default_rng(0)
    greedy, times = DraftSampling(), []
    for _ in range(chains):
        feature = head.codec.encode(rng.standard_normal(head.spec.hidden_size))
        before, t = head.steps_run, time.perf_counter()
        head.propose(feature, [int(rng.integers(head.vocab_size))], k, greedy, rng)
        times.append((time.perf_counter() - t) / (head.steps_run - before))
    return round(1000 * float(np.median(times)), 3)


def head_card(head, vmap, saved: dict, ck: dict, meta: dict, results: dict,
              cfg: HeadExportConfig, export_s: float) -> str:
    st, tc = ck["state"], ck["train_config"]
    trained = sum(p.numel() for p in head.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in head.parameters() if not p.requires_grad)
    lines = [
        "# edgespec feature head",
        "",
        "A one-layer draft head conditioned on the target's final hidden state (EAGLE-style):",
        "each chain step reads (feature, token) and predicts the next feature, read by the",
        "target's own LM head restricted to the sub-vocabulary. Runtime:",
        "`edge_client.feature_draft`; design: `docs/feature-draft.md`.",
        "",
        "## Target feature",
        "",
        f"- layer `{meta['feature_layer']}`, hidden {meta['hidden_size']}, "
        f"wire codec `{meta['feature_dtype']}` (`shared.feature_codec`)",
        f"- target `{meta['target']}`, weights fingerprint `{meta['target_fingerprint']}` "
        "(`shared.fingerprint`); the runtime refuses any other",
        "",
        "## Architecture",
        "",
        f"- fc(concat(norm(emb), norm(feature))) -> one decoder layer (heads "
        f"{head.heads}, kv {head.kv_heads}, head_dim {head.head_dim}, MLP "
        f"{head.gate_proj.weight.shape[0]}) -> RMSNorm (from the target's final norm) -> "
        "frozen target LM-head rows",
        f"- sub-vocabulary {vmap.size} draft ids ({vmap.size - 1 if vmap.unk >= 0 else vmap.size}"
        f" output ids), chain-local RoPE, at most {meta['max_chain']} positions per chain",
        f"- parameters: {trained / 1e6:.2f} M trained, {frozen / 1e6:.2f} M frozen (target rows)",
        "",
        "## Training",
        "",
        f"- data: {', '.join(f'`{d}`' for d in as_dirs(tc['data']))}"
        f" ({len(st['shards'])} shards)",
        f"- unrolled chains of {tc['chain_len']} steps from the true feature's wire round trip, "
        f"teacher tokens; loss KL + {tc['tv_weight']} TV + {tc['feature_weight']} "
        "smooth-L1(feature)",
        f"- steps {st['step']}, batch {tc['batch_size']} chains, {st['chain_steps_seen']:,} chain "
        f"steps, lr {tc['lr']} (AdamW, cosine), seed {saved.get('seed')}",
        f"- wall time {st['wall_s'] / 60:.1f} min training, {export_s / 60:.1f} min export",
        "",
        "## Held-out (teacher-forced greedy alpha, K=4, on greedy rows; `head_eval`)",
        "",
        "| model | greedy_alpha | tokens_per_round | bytes | step_ms |",
        "|---|---|---|---|---|",
    ]
    for name in ("torch", "fp32", "int8", "fp32_copy"):
        r = results.get(name)
        if r is not None:
            lines.append(f"| {name} | {r.get('greedy_alpha')} | {r.get('tokens_per_round')} | "
                         f"{r.get('bytes', '')} | {r.get('step_ms', '')} |")
    lines += ["", "step_ms: median ONNX chain step (one known token, 4 drafts), 1 thread."]
    if "target_step_ms" in results:
        lines.append(f"The target's 1-token step (PyTorch, same machine, same moment): "
                     f"{results['target_step_ms']} ms.")
    lines += ["", f"Export settings: {asdict(cfg)}", ""]
    return "\n".join(lines)
