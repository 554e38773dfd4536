"""Feature heads for tests: an untrained head over the tiny target, exported as the edge loads
it (ONNX fp32, ``feature_head.json``, ``vocab_map.npz``). Its drafts are poor, which is all a
correctness test needs: whatever the head proposes, the output must be the target's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge_client.tools.distill.common import write_json
from edge_client.tools.distill.head_export import export_onnx, head_metadata
from edge_client.tools.distill.head_model import (
    HeadArch,
    TargetShape,
    build_head,
    target_fingerprint,
)
from edge_client.tools.distill.vocab import VOCAB_MAP_FILE, VocabMap
from shared.feature_codec import DEFAULT_CODEC

SUB_VOCAB = 48  # of the tiny 96 ids: 47 real ones and the <unk> input slot


def distill_prompts(n: int, offset: int = 0):
    """n distillation prompts over the tiny vocabulary, half chat, half raw (IME)."""
    from edge_client.tools.distill.prompts import DistillPrompt

    return [DistillPrompt(" ".join(f"t{3 + (7 * i + 5 * j) % 40}" for j in range(3 + i % 4)),
                          "chat" if i % 2 else "ime", chat=bool(i % 2))
            for i in range(offset, offset + n)]


def context_data(root: Path) -> dict[str, Path]:
    """A tiny target (two layers) and gen-data --features shards of it for context heads:
    12 training prompts (half sampled) and 4 greedy held-out ones."""
    from dataclasses import replace

    from conftest import save_tiny_llama

    from edge_client.tools.distill.data import GenConfig, gen_data

    target = save_tiny_llama(root / "target", num_layers=2, seed=0)
    cfg = GenConfig(target=target, out=root / "train", shard_size=6, batch_size=6,
                    max_new_tokens=16, top_k=8, sample_fraction=0.5, features=True,
                    threads=1)
    gen_data(cfg, distill_prompts(12))
    gen_data(replace(cfg, out=root / "heldout", sample_fraction=0.0), distill_prompts(4, offset=40))
    return {"train": root / "train", "heldout": root / "heldout", "target": target,
            "root": root}


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two cores shared with other jobs: more torch threads than free cores spin, not work."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def export_untrained_head(target_dir: Path, out: Path, codec: str = DEFAULT_CODEC,
                          fingerprint: str | None = None, max_chain: int = 16,
                          seed: int = 0) -> Path:
    """A head over the first 47 ids of the tiny target (others enter as <unk> and are never
    proposed); ``fingerprint`` overrides the target's (a head for other weights)."""
    import torch

    shape = TargetShape.from_dir(target_dir)
    ids = np.arange(SUB_VOCAB, dtype=np.int64)
    ids[-1] = -1
    vmap = VocabMap(ids, shape.vocab)
    arch = HeadArch(sub_vocab=SUB_VOCAB, intermediate=64, max_chain=max_chain)
    head = build_head(arch, target_dir, vmap, seed).eval()
    with torch.no_grad():  # an init large enough that its drafts differ from step to step
        head.fc.weight.normal_(0, 0.4)
    out.mkdir(parents=True, exist_ok=True)
    export_onnx(head, out / "model.onnx")
    write_json(out / "feature_head.json",
               head_metadata(shape, vmap, fingerprint or target_fingerprint(target_dir), codec,
                             max_chain, target_dir.name, 0))
    vmap.save(out / VOCAB_MAP_FILE)
    return out


def save_untrained_context_run(target_dir: Path, run: Path, seed: int = 0,
                               feature_layers: tuple[int, ...] = ()) -> Path:
    """A ``train-head --context`` run directory holding an untrained head (as ``load_head_run``
    reads it; fusing ``feature_layers``), for the benches that take one."""
    import torch

    from edge_client.tools.distill.head_model import save_run_meta

    shape = TargetShape.from_dir(target_dir)
    ids = np.arange(SUB_VOCAB, dtype=np.int64)
    ids[-1] = -1
    vmap = VocabMap(ids, shape.vocab)
    arch = HeadArch(sub_vocab=SUB_VOCAB, intermediate=64, max_chain=16,
                    feature_layers=feature_layers)
    head = build_head(arch, target_dir, vmap, seed)
    with torch.no_grad():
        head.fc.weight.normal_(0, 0.4)
        if feature_layers:
            head.fuse.weight.normal_(0, 0.1)
    run.mkdir(parents=True, exist_ok=True)
    vmap.save(run / VOCAB_MAP_FILE)
    save_run_meta(run, arch, target_dir, seed, {"feature_codec": DEFAULT_CODEC, "context": True})
    torch.save({"model": head.state_dict()}, run / "ckpt.pt")
    return run
