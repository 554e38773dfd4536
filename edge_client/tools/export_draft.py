"""Offline: make a draft checkpoint from a target and export it to ONNX for the edge.

``build_truncated_draft`` is a stand-in draft (the target's first few layers plus its final
norm and head); a distilled draft will replace it. ``export_onnx`` turns any such Hugging Face
checkpoint into the ONNX model with a KV cache that ``edge_client.draft_model`` runs.
Both write into a temporary sibling directory and rename it into place when complete.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

from shared.atomic_dir import staging_dir

log = logging.getLogger(__name__)

# What the edge needs beside the weights: the tokenizer, its chat template and the stop ids.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


def build_truncated_draft(target_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """Save the first ``num_layers`` decoder layers of ``target_dir`` as a checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    total = model.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}], got {num_layers}")
    model.model.layers = model.model.layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    # Some configs keep a per-layer list (e.g. layer_types); it must shrink with the layers.
    for key, value in list(vars(model.config).items()):
        if isinstance(value, list) and len(value) == total and key.startswith("layer"):
            setattr(model.config, key, value[:num_layers])

    with staging_dir(out_dir) as staged:
        model.save_pretrained(staged, safe_serialization=True)
        _copy_tokenizer_files(target_dir, staged)
    log.info(
        "truncated draft (%d of %d layers) saved to %s in %.1f s",
        num_layers,
        total,
        out_dir,
        time.perf_counter() - t0,
    )
    return out_dir


def export_onnx(pt_dir: Path, onnx_dir: Path) -> Path:
    """Export a causal-LM checkpoint to ``onnx_dir/model.onnx`` with past key/values.

    Inputs: input_ids, attention_mask, position_ids, past_key_values.{i}.key/.value.
    Outputs: logits [batch, seq, V] and present.{i}.key/.value.
    """
    from optimum.exporters.onnx import main_export

    pt_dir, onnx_dir = Path(pt_dir), Path(onnx_dir)
    t0 = time.perf_counter()
    with staging_dir(onnx_dir) as staged, _quiet_export():
        main_export(
            str(pt_dir),
            output=staged,
            task="text-generation-with-past",
            device="cpu",
            local_files_only=True,
        )
        if not (staged / "model.onnx").is_file():
            raise RuntimeError(f"optimum wrote no model.onnx (got {sorted(os.listdir(staged))})")
        # optimum re-saves the tokenizer; the source's own files keep the bytes identical.
        _copy_tokenizer_files(pt_dir, staged)
    log.info("exported %s to %s in %.1f s", pt_dir, onnx_dir, time.perf_counter() - t0)
    return onnx_dir


def _copy_tokenizer_files(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


@contextlib.contextmanager
def _quiet_export() -> Iterator[None]:
    """Tracing an HF model warns at length about data-dependent branches; that is expected."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
