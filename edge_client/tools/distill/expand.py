"""``expand``: a deeper draft from a finished run, which computes exactly what the run did.

Fine-tuning the six-layer draft on the corpus flattens (docs/draft-data.md, the learning
curve), so the next candidate has more layers. Training those from scratch would throw away
what the run learned; instead each new decoder layer is a copy of the layer before it with
its two output projections (``self_attn.o_proj``, ``mlp.down_proj``) set to zero. Through the
residual stream such a layer adds nothing, so the expanded draft's logits equal the run's
(tested), and training decides what the new layers add: block expansion as in LLaMA Pro
(arXiv 2401.02415). The zero projections get gradients at once (their inputs are not zero),
the rest of the new layer from the second step on.

The result is a finished run directory like ``import-onnx``'s (``run.json``, the same
``vocab_map.npz``, ``ckpt.pt`` without optimizer state) for ``train --init-from``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from edge_client.tools.distill.common import write_json
from edge_client.tools.distill.model import arch_from_json, finished_ckpt
from edge_client.tools.distill.vocab import VOCAB_MAP_FILE, VocabMap

log = logging.getLogger("edgespec.distill")

ZEROED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def layer_plan(layers: int, insert_after: Sequence[int]) -> list[int | None]:
    """For each layer of the expanded draft, the source layer it keeps (an int) or None for
    a new one; a new layer follows source layer i for every i in ``insert_after`` (an i
    given twice inserts two)."""
    bad = [i for i in insert_after if not 0 <= i < layers]
    if bad or not insert_after:
        raise ValueError(f"--insert-after needs layer indices in 0..{layers - 1}, got "
                         f"{list(insert_after)}")
    plan: list[int | None] = []
    for i in range(layers):
        plan.append(i)
        plan.extend([None] * sum(1 for j in insert_after if j == i))
    return plan


def expand_state(state: dict, plan: Sequence[int | None]) -> dict:
    """The expanded model's state dict: kept layers renumbered, each new layer a copy of the
    kept layer before it with ``ZEROED`` set to zero."""
    prefix = "model.layers."
    out = {k: v for k, v in state.items() if not k.startswith(prefix)}
    last = None
    for new, src in enumerate(plan):
        from_layer = src if src is not None else last
        for k, v in state.items():
            if not k.startswith(f"{prefix}{from_layer}."):
                continue
            name = k[len(f"{prefix}{from_layer}."):]
            w = v.clone()
            if src is None and name in ZEROED:
                w.zero_()
            out[f"{prefix}{new}.{name}"] = w
        if src is not None:
            last = src
    return out


def expand_run(source: Path, out: Path, insert_after: Sequence[int]) -> dict:
    """Writes the expanded run at ``out`` from the finished run ``source``; returns a report
    (also ``out/expand.json``)."""
    import torch

    from shared.atomic_dir import staging_dir

    source, out = Path(source), Path(out)
    saved = json.loads((source / "run.json").read_text())
    arch = arch_from_json(saved["arch"])
    plan = layer_plan(arch.layers, insert_after)
    ck = torch.load(source / "ckpt.pt", map_location="cpu", weights_only=False)
    state = expand_state(ck["model"], plan)
    # "onnx" builds the architecture empty and takes every weight from ckpt.pt, which is
    # what an expanded run needs too.
    new_arch = replace(arch, init="onnx", layers=len(plan), target_layers=())
    report = {"source": str(source), "insert_after": list(insert_after),
              "plan": [("new" if s is None else s) for s in plan],
              "layers": len(plan), "created": time.strftime("%F %T")}
    new_ck = finished_ckpt(state, new_arch, "expanded_from", source)
    with staging_dir(out) as staged:
        torch.save(new_ck, staged / "ckpt.pt")
        VocabMap.load(source / VOCAB_MAP_FILE).save(staged / VOCAB_MAP_FILE)
        write_json(staged / "run.json", {"arch": asdict(new_arch), "target": saved["target"],
                                         "seed": saved.get("seed", 0),
                                         "init_from": str(source),
                                         "expanded_from": str(source),
                                         "created": report["created"]})
        write_json(staged / "expand.json", report)
    log.info("expanded %s from %d to %d layers into %s", source, arch.layers, len(plan), out)
    return report
