"""Shared fixtures: tiny random Llama models built from configs, so tests need no weights."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import pytest

TINY_VOCAB = 96
TINY_MAX_POSITIONS = 128
TINY_EOS_ID = 2
TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


class TinyLlamaPair(NamedTuple):
    target_dir: Path  # HF checkpoint, 2 layers, seed 0
    draft_dir: Path  # ONNX export of the draft (what the edge loads)
    draft_pt_dir: Path  # the same draft as an HF checkpoint, 1 layer, seed 1
    vocab_size: int


def tiny_llama_config(num_layers: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_MAX_POSITIONS,
        # Large init so next-token distributions are peaked rather than near uniform.
        initializer_range=0.4,
        bos_token_id=1,
        eos_token_id=TINY_EOS_ID,
        pad_token_id=TINY_EOS_ID,
        tie_word_embeddings=False,
    )


def write_tiny_tokenizer(out_dir: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A WordLevel tokenizer with exactly ``vocab_size`` tokens: <unk> <s> </s> t3 .. tN."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "</s>",
        "model_max_length": TINY_MAX_POSITIONS,
        "chat_template": TINY_CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "chat_template.jinja").write_text(TINY_CHAT_TEMPLATE)


def save_tiny_llama(out_dir: Path, num_layers: int, seed: int) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(num_layers)).eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tiny_tokenizer(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_pair(tmp_path_factory: pytest.TempPathFactory) -> TinyLlamaPair:
    from edge_client.tools.export_draft import export_onnx

    root = tmp_path_factory.mktemp("tiny_llama")
    target = save_tiny_llama(root / "target", num_layers=2, seed=0)
    draft_pt = save_tiny_llama(root / "draft_pt", num_layers=1, seed=1)
    draft_onnx = export_onnx(draft_pt, root / "draft_onnx")
    return TinyLlamaPair(target, draft_onnx, draft_pt, TINY_VOCAB)


@pytest.fixture(scope="session")
def real_assets() -> tuple[Path, Path]:
    """(target checkpoint dir, stand-in ONNX draft dir) prepared by ``edgespec-prepare``.

    Skips on a developer machine that has not prepared them; fails under CI, where
    ``.ci/run`` prepares them, so that the real-model tests can never silently not run.
    """
    from shared import paths

    target, draft = paths.default_target_dir(), paths.standin_draft_dir()
    if (target / "model.safetensors").is_file() and (draft / "model.onnx").is_file():
        return target, draft
    message = f"real assets not prepared under {paths.cache_dir()}; run edgespec-prepare"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def target(tiny_llama_pair):
    """The tiny target loaded as the verifier loads it, shared by every test."""
    from cloud_verifier.server import load_served_target

    return load_served_target(tiny_llama_pair.target_dir)


def require_vllm() -> None:
    """Skips a vLLM test where vLLM is not installed; fails under CI, whose .venv-vllm has it
    (``make test-vllm``), so that the vLLM tests can never silently not run."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        message = f"vLLM is not installed in this environment ({err}); run `make test-vllm`"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
