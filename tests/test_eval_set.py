"""The realistic eval set (edge_client/bench/eval_prompts): its size and shape, and that no
prompt of it shares an 8-word shingle with any training source: every split of the
distillation prompt generator, every string of its data files (templates included),
``shared.prompts.CHAT_PROMPTS``, and the text data committed beside the distillation tools and
the shipped drafts."""

from __future__ import annotations

import json
from collections import Counter
from importlib.resources import files
from pathlib import Path

import pytest

from edge_client.bench.eval_set import CATEGORIES, EvalPrompt, load_eval, normalize, overlaps

ROOT = Path(__file__).resolve().parents[1]
# Committed data beside the training tools and the drafts; tokenizer vocabularies hold tokens,
# not text anyone wrote.
DATA_DIRS = ("edge_client/tools", "edge_client/drafts")
DATA_SUFFIXES = (".json", ".jsonl", ".txt", ".gz")  # .gz: the corpus archive's prompt files
NOT_TEXT = {"tokenizer.json", "vocab.json", "merges.txt"}


def _strings(obj) -> list[str]:
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in _strings(k) + _strings(v)]
    if isinstance(obj, list | tuple):
        return [s for v in obj for s in _strings(v)]
    return []


def _json_strings(path: Path) -> list[str]:
    if path.suffix == ".gz":  # corpus_ids/chunk-*/data-prompts.jsonl.gz
        import gzip

        text = gzip.decompress(path.read_bytes()).decode("utf-8")
        return [s for line in text.splitlines() if line.strip() for s in _strings(json.loads(line))]
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        return text.splitlines()
    if path.suffix == ".jsonl":
        return [s for line in text.splitlines() if line.strip() for s in _strings(json.loads(line))]
    return _strings(json.loads(text))


def generator_texts() -> list[str]:
    """Every prompt of every split the distillation generator has, and every string of its
    data files (topics, tasks, templates, IME starts and greetings, notes)."""
    from edge_client.tools.distill import prompts as distill_prompts
    from edge_client.tools.distill.prompts import SPLITS, prompt_split

    texts = [p.text for split in SPLITS for p in prompt_split(split)]
    tables = [f for f in files(distill_prompts).iterdir() if f.name.endswith(".json")]
    assert len(tables) >= 6  # templates, base, extra .. extra4
    for table in tables:
        texts += _strings(json.loads(table.read_text(encoding="utf-8")))
    return texts


def committed_texts() -> list[str]:
    paths = [p for d in DATA_DIRS for p in sorted((ROOT / d).rglob("*"))
             if p.suffix in DATA_SUFFIXES and p.name not in NOT_TEXT and p.is_file()]
    assert any(p.parent.name == "prompts" for p in paths)  # the generator's own tables
    assert any(p.name == "data-prompts.jsonl.gz" for p in paths)  # the corpus's prompts
    return [s for p in paths for s in _json_strings(p)]


@pytest.fixture(scope="module")
def prompts() -> list[EvalPrompt]:
    return load_eval()


def test_counts_ids_and_texts(prompts):
    assert len(prompts) >= 200
    counts = Counter(p.category for p in prompts)
    assert set(counts) == set(CATEGORIES)
    assert min(counts.values()) >= 25, counts
    assert len({p.id for p in prompts}) == len(prompts)
    assert len({normalize(p.text) for p in prompts}) == len(prompts)


def test_shapes(prompts):
    for p in prompts:
        if p.category == "ime":
            assert not p.chat and p.raw and not p.messages
        else:
            assert p.chat and p.messages[-1][0] == "user"
            assert len(p.messages) == (3 if p.category == "multiturn" else 1)
    counts = Counter(p.category for p in prompts)
    picked = [p.category for p in load_eval(["ime", "code"])]  # in category order
    assert picked == ["code"] * counts["code"] + ["ime"] * counts["ime"]
    with pytest.raises(ValueError):
        load_eval(["nonsense"])


def test_overlaps_finds_shared_shingles_and_short_prefixes():
    a = EvalPrompt("a", "advice", (("user", "How do I keep my basil plant alive on a "
                                            "windowsill in winter?"),))
    b = EvalPrompt("b", "ime", raw="see you at the")
    texts = ["Tips: how do i keep my BASIL plant alive on a windowsill, please",
             "I will see you at the station", "see you at", "nothing in common here"]
    found = overlaps(texts, [a, b])
    assert [(o.eval_id, o.text_index) for o in found] == [("a", 0), ("b", 1)]
    assert found[0].shingle.split() == "how do i keep my basil plant alive".split()


def test_no_overlap_with_the_distillation_generator(prompts):
    texts = generator_texts()
    assert len(texts) > 10_000
    assert overlaps(texts, prompts) == []


def test_no_overlap_with_the_benchmark_chat_prompts(prompts):
    from shared.prompts import CHAT_PROMPTS

    assert CHAT_PROMPTS
    assert overlaps(CHAT_PROMPTS, prompts) == []


def test_no_overlap_with_committed_text_data(prompts):
    assert overlaps(committed_texts(), prompts) == []
