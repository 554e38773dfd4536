"""Prompt files (JSONL) that ``gen-data --prompts-file`` continues instead of a template split.

``gen-prompts`` (module ``magpie``) writes them; anything else may too. One JSON object a
line, with exactly one of three shapes, because each is encoded differently for the target:

- ``"prompt"``: one user turn, wrapped in the chat template (as the template splits' chat
  prompts are);
- ``"messages"``: a conversation, a list of ``{"role", "content"}`` ending with a user turn,
  rendered whole with the chat template, so the target continues the assistant's next answer;
- ``"text"``: raw text (what a user is typing), encoded with no chat template.

Other fields (``id``, ``source``, ``seed``) are carried along for the reader. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

SHAPES = ("prompt", "messages", "text")


@dataclass(frozen=True)
class FilePrompt:
    """Duck-types ``prompts.DistillPrompt`` (``text``, ``kind``, ``chat``) for ``gen-data``."""

    text: str  # the user turn, the raw text, or a conversation's last user turn
    kind: str  # the record's "source" ("file" when it has none)
    chat: bool
    messages: tuple[tuple[str, str], ...] = ()  # (role, content); empty unless a conversation
    id: str = ""


def parse_record(obj: dict, where: str) -> FilePrompt:
    shapes = [k for k in SHAPES if k in obj]
    if len(shapes) != 1:
        raise ValueError(f"{where}: a prompt record has exactly one of {SHAPES}")
    shape, kind, pid = shapes[0], str(obj.get("source", "file")), str(obj.get("id", ""))
    if shape == "messages":
        turns = obj["messages"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: messages is a non-empty list")
        messages = tuple((t.get("role"), t.get("content")) for t in turns)
        if (any(not isinstance(r, str) or not isinstance(c, str) or not c.strip()
                for r, c in messages) or messages[-1][0] != "user"):
            raise ValueError(f"{where}: every message has a role and text; the last is the user's")
        return FilePrompt(messages[-1][1], kind, True, messages, pid)
    value = obj[shape]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {shape} is a non-empty string")
    return FilePrompt(value, kind, shape == "prompt", (), pid)


def load_prompts_file(path: Path) -> list[FilePrompt]:
    """The file's prompts in file order (blank lines skipped)."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            out.append(parse_record(json.loads(line), f"{path}:{n}"))
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def encode_prompt(tok, prompt) -> list[int]:
    """Token ids of a ``DistillPrompt`` or ``FilePrompt`` as ``gen-data`` feeds them."""
    messages = getattr(prompt, "messages", ())
    if messages:
        return tok.encode(tok.apply_chat_template([{"role": r, "content": c}
                                                   for r, c in messages]))
    return tok.encode_chat(prompt.text) if prompt.chat else tok.encode(prompt.text)


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_jsonl(path: Path, records: Iterable[dict]) -> None:
    """Writes the whole file beside its place and renames it in, so it is never half there."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a published file should not be
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
