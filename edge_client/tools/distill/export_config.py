"""``ExportConfig``: what ``export`` (edge_client.tools.distill.export) makes of a distilled
checkpoint, which the model card (edge_client.tools.distill.card) describes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
    # One int8 (or 4-bit) table for the embedding and the tied LM head (quantize.share_embedding).
    share_embedding: bool = False
    # MatMuls whose names contain these get 4-bit weight-only MatMulNBits (quantize.int4_matmuls).
    int4: tuple[str, ...] = ()
    int4_block: int = 32
    # MatMulNBits accuracy_level: 4 quantizes activations to int8 per block (measured on v7,
    # 1 thread, the 2-core VM: int4 gate/up step 50 ms at level 0 vs 41 ms at 4 and 42 ms
    # all-int8 under load; greedy acceptance 0.4522 / 0.4475, 1 - TV equal); 0 keeps fp32.
    int4_accuracy: int = 4
    # "traced": optimum's export through PyTorch; "fused": one graph of onnxruntime's fused
    # operators (tools.fused_graph; measured on v7: the same acceptance, a 0.77x step).
    graph: str = "traced"

    def __post_init__(self) -> None:
        if self.graph not in ("traced", "fused"):
            raise ValueError(f"graph must be 'traced' or 'fused', got {self.graph!r}")
