"""Prompts for distilling the draft, written for this project, with a fixed held-out split.

Variety comes from templates x topics: chat answers, code, lists, short facts, and IME-style
raw prefixes (what a user is typing; no chat template). The split is by *topic* (and, for the
IME prefixes, by the prefix itself), decided by a stable hash, so a held-out prompt shares no
topic with any training prompt. ``shared.prompts.CHAT_PROMPTS`` (the benchmark's prompts) is
never in the training split.

The tables are data beside this module (shipped as package data): ``templates.json`` (the
templates and IME greetings), ``base.json`` (the topics of ``train`` and ``heldout``) and one
file per extra training split (``extra.json`` .. ``extra4.json``). This module expands them.

``prompt_split("heldout")`` is what ``edgespec-bench acceptance`` evaluates on.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Literal

# One topic bucket in HELDOUT_BUCKETS out of NUM_BUCKETS is held out.
NUM_BUCKETS = 10
HELDOUT_BUCKETS = frozenset({3})
# Further training splits, in the order they were added: a later one skips what an earlier has.
EXTRA_SPLITS = ("extra", "extra2", "extra3", "extra4")
SPLITS = ("train", "heldout", *EXTRA_SPLITS)


@dataclass(frozen=True)
class DistillPrompt:
    text: str
    kind: str  # "chat", "code", "list", "fact" or "ime"
    chat: bool  # True: wrap in the chat template; False: raw text prefix


Keyed = list[tuple[DistillPrompt, str]]  # a prompt and the key its split is decided by


@cache
def _table(name: str) -> dict[str, tuple]:
    """One data file's lists (its ``about`` note dropped)."""
    text = files(__package__).joinpath(f"{name}.json").read_text(encoding="utf-8")
    return {k: tuple(v) for k, v in json.loads(text).items() if k != "about"}


def _chat(topics) -> Keyed:
    return [(DistillPrompt(tpl.format(t=t), "chat", True), f"chat:{t}")
            for t in topics for tpl in _table("templates")["chat"]]


def _code(tasks) -> Keyed:
    tpl = _table("templates")
    return [(DistillPrompt(t.format(lang=lang, task=task), "code", True), f"code:{task}")
            for task in tasks for lang in tpl["code_langs"] for t in tpl["code"]]


def _lists(subjects) -> Keyed:
    return [(DistillPrompt(tpl.format(s=s), "list", True), f"list:{s}")
            for s in subjects for tpl in _table("templates")["list"]]


def _facts(questions) -> Keyed:
    return [(DistillPrompt(text, "fact", True), f"fact:{text}") for text in questions]


def _ime(starts) -> Keyed:
    return [(DistillPrompt(name + start, "ime", False), f"ime:{start}")
            for start in starts for name in _table("templates")["ime_names"]]


def _extra_prompts(split: str) -> Keyed:
    t = _table(split)
    return (_chat(t["chat_topics"]) + _code(t["code_tasks"]) + _lists(t["list_subjects"])
            + _facts(t["fact_questions"]) + _ime(t["ime_starts"]))


def _topic_bucket(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") % NUM_BUCKETS


def _all_prompts() -> Keyed:
    """Every base prompt with the key its split is decided by."""
    base, tpl = _table("base"), _table("templates")
    out = _chat(base["chat_topics"]) + _code(base["code_tasks"])
    out += [(DistillPrompt(text, "code", True), f"code1:{text}") for text in base["sql_tasks"]]
    out += _lists(base["list_subjects"])
    out += [(DistillPrompt(t.format(c=c), "fact", True), f"country:{c}")
            for c in base["countries"] for t in tpl["country_facts"]]
    out += _facts(base["fact_questions"])
    numbers = base["numbers"]
    for a in numbers:
        for b in numbers[:5]:
            for t in tpl["arith"]:
                if "{b}" not in t and b != numbers[0]:
                    continue
                out.append((DistillPrompt(t.format(a=a, b=b), "fact", True), f"num:{a}"))
    return out + _ime(base["ime_starts"])


@cache
def _split() -> dict[str, tuple[DistillPrompt, ...]]:
    from shared.prompts import CHAT_PROMPTS

    benchmark = set(CHAT_PROMPTS)
    train, heldout, seen = [], [], set()
    for prompt, key in _all_prompts():
        if prompt.text in seen:
            continue
        seen.add(prompt.text)
        if _topic_bucket(key) in HELDOUT_BUCKETS:
            heldout.append(prompt)
        elif prompt.text not in benchmark:
            train.append(prompt)
    out = {"train": tuple(train), "heldout": tuple(heldout)}
    for split in EXTRA_SPLITS:  # in order: a later split skips what an earlier one has
        extra = []
        for prompt, key in _extra_prompts(split):
            # a held-out topic's key always hashes into a held-out bucket
            if (prompt.text in seen or prompt.text in benchmark
                    or _topic_bucket(key) in HELDOUT_BUCKETS):
                continue
            seen.add(prompt.text)
            extra.append(prompt)
        out[split] = tuple(extra)
    return out


def prompt_split(name: Literal["train", "heldout", "extra", "extra2", "extra3", "extra4"],
                 ) -> list[DistillPrompt]:
    """A split's prompts, in a fixed order (deterministic across runs).

    ``extra``, ``extra2``, ``extra3`` and ``extra4`` are further training splits on topics that
    no earlier split has;
    ``heldout`` is the same whether or not they exist.
    """
    splits = _split()
    if name not in splits:
        raise ValueError(f"split must be one of {SPLITS}, got {name!r}")
    return list(splits[name])
