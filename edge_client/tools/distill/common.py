"""Small helpers the distillation stages share: JSON files, the target's config, data dirs,
the choice of engine that runs the target."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

# Who runs the target in the stages that generate (gen-data, gen-prompts): torch in
# left-padded batches, or vLLM's continuous batching (the vllm extra, .venv-vllm).
ENGINES = ("builtin", "vllm")
VLLM_DTYPES = ("float32", "bfloat16")


def add_engine_arguments(parser) -> None:
    """``--engine`` and ``--dtype``, the same for every stage that generates."""
    parser.add_argument("--engine", choices=ENGINES, default="builtin",
                        help="who runs the target: torch in left-padded batches, or vLLM with "
                             "continuous batching (needs the vllm extra: .venv-vllm)")
    parser.add_argument("--dtype", choices=VLLM_DTYPES, default="float32",
                        help="with --engine vllm: the target's dtype (docs/vllm-engine.md: "
                             "bfloat16 on CPUs)")


def check_engine(engine: str, dtype: str) -> None:
    """Refuses an unknown engine, and a dtype the built-in path would silently ignore."""
    if engine not in ENGINES:
        raise ValueError(f"--engine must be builtin or vllm, not {engine!r}")
    if dtype not in VLLM_DTYPES:
        raise ValueError(f"--dtype must be float32 or bfloat16, not {dtype!r}")
    if engine == "builtin" and dtype != "float32":
        raise ValueError("--dtype is vLLM's; the built-in path runs the target in float32")


def engine_label(engine: str, dtype: str) -> str:
    """What a manifest or stats file says wrote the data: builtin, vllm-float32, ..."""
    return engine if engine == "builtin" else f"{engine}-{dtype}"


def as_dirs(data) -> list[Path]:
    """A TrainConfig.data value (one directory or several; JSON-loaded or not) as a list."""
    if data is None:
        return []
    return [Path(data)] if isinstance(data, (str, Path)) else [Path(d) for d in data]


def default_target() -> Path:
    from shared import paths

    return paths.default_target_dir()


def target_vocab_size(target_dir: Path) -> int:
    return int(json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"])


def special_ids(target_dir: Path) -> list[int]:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    ids = {cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")}
    flat = set()
    for i in ids:
        if isinstance(i, list):
            flat.update(i)
        elif i is not None:
            flat.add(i)
    return sorted(flat)


def jsonable(obj):
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def write_json(path: Path, obj) -> None:
    tmp = Path(tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")[1])
    tmp.write_text(json.dumps(jsonable(obj), indent=2))
    os.replace(tmp, path)


def append_jsonl(path: Path, obj) -> None:
    with path.open("a") as f:
        f.write(json.dumps(jsonable(obj)) + "\n")
