"""The draft model: its architecture, its construction (from scratch, PCA-projected target
embeddings, or copied target layers), a training run's weights, and its full-vocabulary twin."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from edge_client.tools.distill.vocab import VOCAB_MAP_FILE, VocabMap


@dataclass(frozen=True)
class ArchConfig:
    # "scratch", "pca" (target embeddings projected), "target" (target layers copied) or
    # "onnx" (built like scratch; the weights come from an imported ONNX draft's ckpt.pt)
    init: str = "scratch"
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 768
    target_layers: tuple[int, ...] = ()  # init=target: which target layers to copy
    sub_vocab: int = 16384  # 0: the full vocabulary
    max_positions: int = 2048


def arch_from_json(obj: dict) -> ArchConfig:
    return ArchConfig(**{**obj, "target_layers": tuple(obj["target_layers"])})


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
    if arch.init in ("scratch", "pca", "onnx"):
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


def finished_ckpt(state_dict: dict, arch: ArchConfig, origin_key: str, origin: Path) -> dict:
    """A run checkpoint made without training (import-onnx, expand): weights and arch, no
    optimizer state, so ``train --init-from`` starts it fresh; ``origin_key`` names how it was
    made ("imported_from", "expanded_from"), which the card reads."""
    return {"model": state_dict,
            "state": {"step": 0, "epoch": 0, "batch_in_epoch": 0, "epoch_shards": [],
                      "tokens_seen": 0, "wall_s": 0.0},
            "arch": asdict(arch),
            "train_config": {"data": [], origin_key: str(origin)}}


def load_run(run: Path, target: Path | None = None):
    """(draft in eval mode, its VocabMap) from a training run's directory and checkpoint."""
    import torch

    saved = json.loads((run / "run.json").read_text())
    vmap = VocabMap.load(run / VOCAB_MAP_FILE)
    model = build_draft(arch_from_json(saved["arch"]),
                        Path(target) if target else Path(saved["target"]), vmap, 0)
    ck_path = run / "ckpt.pt"
    if ck_path.exists():
        model.load_state_dict(torch.load(ck_path, map_location="cpu", weights_only=False)["model"])
    return model.eval(), vmap
