"""The realistic evaluation set: natural prompts kept apart from every training source.

The prompts are data beside this module (``eval_prompts/*.jsonl``, shipped as package data;
provenance and the dedupe rule in ``eval_prompts/README.md``), one file per category. Three
shapes: a single user turn (``prompt``), a conversation (``turns``: user, assistant, user),
rendered with the chat template over all turns, and an IME prefix (``text``), raw text with no
chat template.

``overlaps(texts)`` is the check that keeps them apart: it finds the eval prompts that share an
8-word shingle with any given text, which every training pipeline must run on its prompts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import NamedTuple

CATEGORIES = ("advice", "howto", "email", "lists", "code", "creative", "multiturn", "ime")
SHINGLE_WORDS = 8
_ROLES = ("user", "assistant")


@dataclass(frozen=True)
class EvalPrompt:
    id: str
    category: str
    messages: tuple[tuple[str, str], ...] = ()  # (role, content); empty for a raw prompt
    raw: str | None = None  # an IME prefix, encoded without the chat template

    @property
    def chat(self) -> bool:
        return self.raw is None

    def chat_messages(self) -> list[dict[str, str]]:
        """The conversation as ``apply_chat_template`` takes it (chat prompts only)."""
        if not self.chat:
            raise ValueError(f"{self.id} is a raw prompt, not a conversation")
        return [{"role": role, "content": content} for role, content in self.messages]

    def parts(self) -> list[str]:
        """The texts a person wrote: every turn, or the raw prefix."""
        return [self.raw] if self.raw is not None else [c for _, c in self.messages]

    @property
    def text(self) -> str:
        return "\n".join(self.parts())


class Overlap(NamedTuple):
    eval_id: str
    text_index: int  # which of the given texts
    shingle: str  # the shared words, normalized


def normalize(text: str) -> str:
    """Lowercased, punctuation dropped, whitespace collapsed (stricter than whitespace alone:
    "terms." and "terms" are the same word here)."""
    return " ".join(_words(text))


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", text.lower()).split()


def _shingles(words: list[str]) -> set[tuple[str, ...]]:
    """The text's 8-word shingles; a text of fewer words is its own single shingle."""
    if len(words) < SHINGLE_WORDS:
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + SHINGLE_WORDS]) for i in range(len(words) - SHINGLE_WORDS + 1)}


def _parse(line: str, where: str) -> EvalPrompt:
    obj = json.loads(line)
    pid, category = obj.get("id"), obj.get("category")
    if not isinstance(pid, str) or not pid or category not in CATEGORIES:
        raise ValueError(f"{where}: needs a string id and a category in {CATEGORIES}")
    shapes = [key for key in ("prompt", "turns", "text") if key in obj]
    expected = {"multiturn": "turns", "ime": "text"}.get(category, "prompt")
    if shapes != [expected]:
        raise ValueError(f"{where}: a {category} prompt has exactly the field {expected!r}")
    if category == "ime":
        messages, raw = (), obj["text"]
    elif category == "multiturn":
        turns = obj["turns"]
        messages = tuple((t.get("role"), t.get("content")) for t in turns)
        roles = tuple(role for role, _ in messages)
        if (len(roles) < 3 or roles[-1] != "user"
                or roles != tuple(_ROLES[i % 2] for i in range(len(roles)))):
            raise ValueError(f"{where}: turns alternate user/assistant and end with the user")
        raw = None
    else:
        messages, raw = (("user", obj["prompt"]),), None
    prompt = EvalPrompt(pid, category, messages, raw)
    if not all(isinstance(p, str) and p.strip() for p in prompt.parts()):
        raise ValueError(f"{where}: empty text")
    return prompt


@cache
def _load_all() -> tuple[EvalPrompt, ...]:
    folder = files(__package__).joinpath("eval_prompts")
    out = []
    for category in CATEGORIES:
        name = f"{category}.jsonl"
        lines = folder.joinpath(name).read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines, 1):
            if line.strip():
                prompt = _parse(line, f"eval_prompts/{name}:{n}")
                if prompt.category != category:
                    raise ValueError(f"eval_prompts/{name}:{n}: category {prompt.category!r}")
                out.append(prompt)
    ids = [p.id for p in out]
    if len(set(ids)) != len(ids):
        raise ValueError("eval prompt ids are not unique")
    return tuple(out)


def load_eval(categories: Iterable[str] | None = None) -> list[EvalPrompt]:
    """The eval prompts of ``categories`` (default: all), in category order, then file order."""
    wanted = CATEGORIES if categories is None else tuple(categories)
    unknown = set(wanted) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"unknown categories {sorted(unknown)}; known: {CATEGORIES}")
    return [p for p in _load_all() if p.category in wanted]


def overlaps(texts: Iterable[str], prompts: Iterable[EvalPrompt] | None = None
             ) -> list[Overlap]:
    """Every (eval prompt, text) pair whose normalized texts share an 8-word shingle.

    Each part of an eval prompt (a turn, or the IME prefix) is shingled on its own. A text of
    fewer than 8 words is its own single shingle, and an eval part that short also matches
    when its words appear in a row anywhere in the text, so an eval prefix that a training
    prompt starts with is caught. ``prompts`` defaults to the whole eval set.
    """
    index: dict[tuple[str, ...], set[str]] = {}
    short_lengths: set[int] = set()
    for prompt in load_eval() if prompts is None else prompts:
        for part in prompt.parts():
            words = _words(part)
            if len(words) < SHINGLE_WORDS:
                short_lengths.add(len(words))
            for shingle in _shingles(words):
                index.setdefault(shingle, set()).add(prompt.id)
    found: dict[tuple[str, int], str] = {}  # the first shared shingle in the text's order
    lengths = sorted(short_lengths | {SHINGLE_WORDS})
    for i, text in enumerate(texts):
        words = _words(text)
        grams = [tuple(words)] if 0 < len(words) < SHINGLE_WORDS else []
        grams += [tuple(words[j:j + n]) for j in range(len(words)) for n in lengths
                  if j + n <= len(words)]
        for gram in grams:
            for eval_id in index.get(gram, ()):
                found.setdefault((eval_id, i), " ".join(gram))
    return [Overlap(eval_id, i, shingle) for (eval_id, i), shingle in sorted(found.items())]
