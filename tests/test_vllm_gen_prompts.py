"""``gen-prompts --engine vllm`` on the real SmolLM2 target, in the vLLM environment (``make
test-vllm``): the three kinds come out in their shapes and pass the filters, the stream is
the same on every run (a deleted chunk comes back identical, a larger count extends it, a run
with eval prompts to avoid drops exactly the overlapping records of the same stream), greedy
duplicates are dropped, and an engine or dtype change into the same --out is refused.

vLLM is started once for the module (about 100 s on the 2-core VM); the counts are small.
Under CI a missing vLLM fails.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import require_vllm

from edge_client.bench.eval_set import EvalPrompt, load_eval, overlaps
from edge_client.tools.distill import magpie
from edge_client.tools.distill.magpie import MagpieConfig, gen_prompts

pytestmark = pytest.mark.vllm

COUNTS = {"magpie": 6, "multiturn": 4, "ime": 6}
BATCH = 4  # small batches: each kind takes several rounds, so a chunk resumes mid-stream


@pytest.fixture(scope="module")
def writer(real_assets):
    require_vllm()
    from edge_client.tools.distill.data_vllm import VllmWriter

    return VllmWriter.start(real_assets[0], "float32", threads=0)


def _cfg(target: Path, out: Path, **kw) -> MagpieConfig:
    return MagpieConfig(out=out, target=target, counts=kw.pop("counts", dict(COUNTS)),
                        batch_size=BATCH, max_user_tokens=64, max_answer_tokens=48,
                        ime_max_tokens=24, chunk_size=2, seed=5, progress=False,
                        engine="vllm", **kw)


def _records(out: Path, kind: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"{kind}.jsonl").read_text().splitlines()]


def _texts(record: dict) -> list[str]:
    if "messages" in record:
        return [m["content"] for m in record["messages"]]
    return [record.get("prompt") or record["text"]]


def _body(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "id"}


@pytest.fixture(scope="module")
def straight(writer, real_assets, tmp_path_factory):
    """One run against the whole realistic set (the default overlap check)."""
    cfg = _cfg(real_assets[0], tmp_path_factory.mktemp("vllm-prompts") / "straight")
    return cfg, gen_prompts(cfg, vllm_writer=writer)


def test_records_have_their_shapes_and_pass_the_filters(straight, real_assets):
    from edge_client.tokenizer import EdgeTokenizer
    from edge_client.tools.distill.turn_sampling import special_ids

    cfg, stats = straight
    tok, special = EdgeTokenizer(real_assets[0]), special_ids(real_assets[0])
    assert stats["engine"] == "vllm-float32"
    assert json.loads((cfg.out / "config.json").read_text())["engine"] == "vllm"

    def passes(text: str, lo: int, hi: int) -> bool:
        return magpie.text_reason(text, tok.encode(text), True, special, cfg, lo, hi) is None

    for kind, n in COUNTS.items():
        recs = _records(cfg.out, kind)
        st = stats["stages"][kind]
        assert len(recs) == n == st["kept"]
        assert [r["id"] for r in recs] == [f"{kind}-{i:06d}" for i in range(n)]
        assert all(r["source"] == kind and isinstance(r["seed"], int) for r in recs)
        # Every row of every round is accounted for: kept, or dropped for one reason.
        assert st["candidates"] == st["rounds"] * BATCH
        assert st["generated"] + sum(st["filtered"].values()) == st["candidates"]
        assert st["tokens"] > 0 and st["tokens_per_s"] > 0
        keys = {magpie.record_key(kind, r) for r in recs}
        assert len(keys) == n  # deduplicated
    for r in _records(cfg.out, "magpie"):
        assert passes(r["prompt"], cfg.min_words, cfg.max_words), r
    for r in _records(cfg.out, "multiturn"):
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["user", "assistant", "user"]
        assert all(m["content"].strip() for m in r["messages"])
        assert passes(r["messages"][0]["content"], cfg.min_words, cfg.max_words)
        assert passes(r["messages"][2]["content"], cfg.min_words, cfg.max_words)
        assert r["messages"][2]["content"] != r["messages"][0]["content"]
    for r in _records(cfg.out, "ime"):
        assert passes(r["text"], cfg.ime_min_words, cfg.ime_max_words), r
        assert r["text"] == r["text"].strip() and "\n" not in r["text"]
        assert r["from"] in ("user", "opener")
    texts = [t for k in COUNTS for r in _records(cfg.out, k) for t in _texts(r)]
    assert not overlaps(texts, load_eval())


def test_a_deleted_chunk_comes_back_identical_and_a_larger_count_extends(straight, writer,
                                                                        tmp_path):
    cfg, _ = straight
    out = tmp_path / "resumed"
    shutil.copytree(cfg.out, out)
    chunks = out / "chunks"
    lost = {}
    for kind in COUNTS:
        last = sorted(chunks.glob(f"{kind}-*.jsonl"))[-1]
        lost[last.name] = last.read_text().splitlines()
        last.unlink()
    resumed = replace(cfg, out=out)
    gen_prompts(resumed, vllm_writer=writer)
    for name, lines in lost.items():
        again = (chunks / name).read_text().splitlines()
        meta, meta_again = json.loads(lines[0])["chunk"], json.loads(again[0])["chunk"]
        meta.pop("seconds"), meta_again.pop("seconds")
        assert meta_again == meta  # the same rounds, candidates, filters and tokens
        assert again[1:] == lines[1:]
    for kind in COUNTS:
        assert _records(out, kind) == _records(cfg.out, kind)

    before = {p.name: p.read_bytes() for p in chunks.iterdir()}
    more = replace(resumed, counts={**COUNTS, "magpie": COUNTS["magpie"] + 3})
    stats = gen_prompts(more, vllm_writer=writer)
    assert all(stats["stages"][k]["seconds_this_run"] == 0 for k in ("multiturn", "ime"))
    assert all((chunks / n).read_bytes() == b for n, b in before.items())  # never rewritten
    longer = _records(out, "magpie")
    assert len(longer) == COUNTS["magpie"] + 3
    assert longer[:COUNTS["magpie"]] == _records(cfg.out, "magpie")


def test_overlaps_with_the_eval_set_are_dropped_from_the_same_stream(straight, writer,
                                                                    tmp_path):
    cfg, _ = straight
    # Leak each kind's longest record (a short IME prefix would also match other records
    # that merely contain its words) into a stand-in evaluation set.
    leaked = {k: max(_records(cfg.out, k), key=lambda r: len(" ".join(_texts(r)).split()))
              for k in COUNTS}
    fake = [EvalPrompt("advice-x", "advice", (("user", leaked["magpie"]["prompt"]),)),
            EvalPrompt("ime-x", "ime", (), leaked["ime"]["text"]),
            EvalPrompt("multiturn-x", "multiturn",
                       tuple((m["role"], m["content"]) for m in leaked["multiturn"]["messages"]))]
    out = tmp_path / "filtered"
    stats = gen_prompts(replace(cfg, out=out), eval_prompts=fake, vllm_writer=writer)
    for kind in COUNTS:
        assert stats["stages"][kind]["filtered"]["eval_overlap"] >= 1
        got = [_body(r) for r in _records(out, kind)]
        assert not overlaps([t for r in got for t in _texts(r)], fake)
        # The same rounds sampled the same candidates; only the overlapping ones are gone.
        expected = [_body(r) for r in _records(cfg.out, kind) if not overlaps(_texts(r), fake)]
        assert got[:len(expected)] == expected


def test_greedy_user_turns_are_duplicates(writer, real_assets, tmp_path):
    cfg = _cfg(real_assets[0], tmp_path / "greedy", counts={"magpie": 2}, temperature=0.0,
               max_tries=1)
    st = gen_prompts(cfg, eval_prompts=[], vllm_writer=writer)["stages"]["magpie"]
    assert st["candidates"] == BATCH
    if st["generated"]:  # the greedy turn passed the filters once; its copies did not
        assert st["generated"] == 1 and st["filtered"] == {"duplicate": BATCH - 1}
    else:  # or every copy failed the same filter
        assert list(st["filtered"].values()) == [BATCH]


def test_another_engine_or_dtype_into_the_same_out_is_refused(straight):
    cfg, _ = straight
    with pytest.raises(ValueError, match='engine "vllm" \\(not "builtin"\\)'):
        gen_prompts(replace(cfg, engine="builtin"))
    with pytest.raises(ValueError, match='dtype "float32" \\(not "bfloat16"\\)'):
        gen_prompts(replace(cfg, dtype="bfloat16"))
