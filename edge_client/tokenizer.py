"""Text <-> token ids on the device, with the `tokenizers` library and the model's chat
template (rendered with jinja2, as transformers does). No torch, no transformers."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from shared.token_spelling import TokenSpelling, spelling_of
from shared.tokenizer_fingerprint import vocab_fingerprint


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def _token_text(value) -> str | None:
    # tokenizer_config.json stores special tokens as a string or as {"content": ...}.
    return value.get("content") if isinstance(value, dict) else value


class EdgeTokenizer:
    """The tokenizer files shipped beside the ONNX draft (tokenizer.json and friends)."""

    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing; the draft directory must ship the "
                                    "tokenizer it was trained with")
        self._tok = Tokenizer.from_file(str(path))
        config = _read_json(model_dir / "tokenizer_config.json")
        template_file = model_dir / "chat_template.jinja"
        self.chat_template: str | None = (template_file.read_text(encoding="utf-8")
                                          if template_file.exists()
                                          else config.get("chat_template"))
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        if eos is None and self.eos_token is not None:
            eos = self._tok.token_to_id(self.eos_token)
        self.eos_token_ids: tuple[int, ...] = tuple(
            eos if isinstance(eos, list) else ([] if eos is None else [eos]))
        self.fingerprint = vocab_fingerprint(self._tok.get_vocab(with_added_tokens=True))
        self._spelling: TokenSpelling | None | bool = False  # False: not built yet

    @property
    def spelling(self) -> TokenSpelling | None:
        """Each token's bytes, for token healing (None: not a byte-level BPE tokenizer).
        Built on first use (about 0.4 s for a 49k vocabulary)."""
        if self._spelling is False:
            self._spelling = spelling_of(self._tok.to_str())
        return self._spelling

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        """Renders a conversation ending with the assistant's turn to write."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template; pass raw text instead")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=True,
                               bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, user_text: str) -> list[int]:
        return self.encode(self.apply_chat_template([{"role": "user", "content": user_text}]))


class TextStream:
    """Turns committed token chunks into printable text increments with the `tokenizers`
    incremental decoder: each token is decoded once, and a piece that ends inside a
    multi-byte character waits for the tokens that complete it."""

    def __init__(self, tokenizer: EdgeTokenizer) -> None:
        self._tok = tokenizer._tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        pieces = (self._stream.step(self._tok, int(i)) for i in ids)
        return "".join(p for p in pieces if p)
