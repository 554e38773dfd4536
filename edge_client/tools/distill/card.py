"""MODEL_CARD.md for an exported draft: architecture, training, held-out acceptance, and the
wall time of every stage behind the weights (following ``init_from`` back)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from edge_client.tools.distill.common import as_dirs
from edge_client.tools.distill.model import ArchConfig
from edge_client.tools.distill.vocab import VocabMap

if TYPE_CHECKING:
    from edge_client.tools.distill.export_config import ExportConfig


def model_card(arch: ArchConfig, model, vmap: VocabMap, ck: dict, saved: dict, results: dict,
               cfg: ExportConfig, export_s: float) -> str:
    st, tc = ck["state"], ck.get("train_config", {})
    n_params = sum(p.numel() for p in model.parameters())
    source = Path(cfg.run_dir) / "SOURCE_MODEL_CARD.md"
    imported = saved.get("imported_from")
    lines = [
        "# edgespec distilled draft",
        "",
        "A small Llama-architecture draft for SmolLM2-135M-Instruct, distilled on the target's",
        "own top-k distributions (`edgespec-distill`), exported to ONNX with a KV cache and",
        "dynamically quantized to int8 (weights; activations quantized at run time), except",
        f"the MatMuls named {list(cfg.keep_fp32)}, whose weights are int8 but whose",
        "activations stay fp32 (weight-only: dequantized once when the model loads). A tied",
        "LM head is stored apart from the embedding in the ONNX file, so it is int8 too.",
        *([f"The MatMuls named {list(cfg.int4)} are 4-bit weight-only (MatMulNBits, blocks of "
           f"{cfg.int4_block}, accuracy level {cfg.int4_accuracy})."] if cfg.int4 else []),
        *(["The embedding is looked up in the quantized LM head's weight (one stored copy of "
           "the tied matrix)."] if cfg.share_embedding else []),
        *(["The graph is built from onnxruntime's fused operators (GroupQueryAttention with "
           "rotary, SkipSimplifiedLayerNormalization, one QKV projection a layer; "
           "`edge_client/tools/fused_graph.py`), not traced."]
          if cfg.graph == "fused" else []),
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
        *(_training(tc, st, saved) if not imported else [
            "## Training",
            "",
            f"- weights: the ONNX draft `{imported}`, imported ({saved.get('created')}) with "
            "`edgespec-distill import-onnx` (its int8 weights dequantized) and exported again "
            "here; how they were trained, and the wall time behind them, are in that draft's "
            "card" + (", kept at the end under \"Source card\"" if source.is_file() else ""),
            f"- seed {saved.get('seed')}",
            ""]),
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
    for name, seconds, stage in stages["train"]:
        lines.append(f"| {stage} `{Path(name).name}` | {seconds / 60:.1f} |")
        total += seconds
    lines += [f"| export (ONNX, int8, evaluation) | {export_s / 60:.1f} |",
              f"| total | {total / 60:.1f} |", ""]
    if imported and source.is_file():
        lines += [f"## Source card (`{imported}`, as imported)", ""]
        # Its headings one level down, under this one.
        lines += [("#" + ln if ln.startswith("#") else ln)
                  for ln in source.read_text().splitlines()]
        lines.append("")
    return "\n".join(lines)


def _training(tc: dict, st: dict, saved: dict) -> list[str]:
    return [
        "## Training",
        "",
        f"- data: {', '.join(f'`{d}`' for d in as_dirs(tc.get('data')))} (shards "
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
    ]


def _pipeline_stages(run: Path, ck: dict) -> dict:
    """The gen-data directories and training runs behind a run's weights, following
    ``init_from`` back: {"data": {dir: manifest + seconds + draft_run}, "train": [(run,
    seconds, stage)], oldest run first}; stage is "train", or "import-onnx" / "expand" for a
    run whose weights were made by those commands rather than trained (0 s here; an imported
    draft's own history is in its source card)."""
    import torch

    data: dict[str, dict] = {}
    train_runs: list[tuple[str, float, str]] = []
    while True:
        tc = ck.get("train_config", {})
        stage = ("import-onnx" if "imported_from" in tc else
                 "expand" if "expanded_from" in tc else "train")
        train_runs.insert(0, (str(run), ck["state"]["wall_s"], stage))
        for d in as_dirs(tc.get("data")):
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
