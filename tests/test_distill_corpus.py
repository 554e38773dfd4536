"""edgespec-distill corpus on a tiny random target (the built-in engine): chunks of prompts
continued by the target until the token count is there, a bounded run that a rerun finishes
exactly as one straight run does, the manifest's counts against the shards themselves, the
cross-chunk dedup, and the dtype chosen by the host."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edge_client.tools.distill import corpus
from edge_client.tools.distill.corpus import Corpus, CorpusConfig, resolve_dtype
from edge_client.tools.distill.prompt_file import load_prompts_file
from edge_client.tools.distill.shards import list_shards, read_shard

# The tiny target never ends a turn, so its turns are kept unfinished and kept short.
PROMPTS = {"max_user_tokens": 8, "max_answer_tokens": 4, "ime_max_tokens": 8,
           "keep_unfinished": True, "ime_openers": ("t5 t6", "t7"), "chunk_size": 2,
           "request_openers": ("t8", "t9 t10"),
           "batch_size": 4}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    from conftest import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("corpus") / "target", num_layers=2, seed=0)


def _cfg(target: Path, out: Path, tokens: int, **kw) -> CorpusConfig:
    return CorpusConfig(out=out, target=target, target_tokens=tokens, magpie=3, multiturn=1,
                        ime=2, request=0, max_new_tokens=6, top_k=4, shard_size=2, engine="builtin",
                        progress=False, prompt_settings=PROMPTS, **kw)


def _shards(out: Path) -> dict[str, list]:
    return {f"{p.parent.parent.name}/{p.name}": read_shard(p)
            for p in sorted(out.glob("chunk-*/data/shard-*.npz"))}


def test_chunks_until_the_tokens_are_there_and_the_manifest_counts_the_shards(target, tmp_path):
    out = tmp_path / "c"
    summary = Corpus(_cfg(target, out, 50)).run()
    man = json.loads((out / "corpus.json").read_text())
    shards = _shards(out)
    tokens = sum(len(s.gen_ids) for rows in shards.values() for s in rows)
    sampled = sum(len(s.gen_ids) for rows in shards.values() for s in rows if s.sampled)
    assert summary["finished"] and summary["tokens"] == tokens >= 50
    assert man["totals"]["tokens"] == tokens and man["totals"]["sampled_tokens"] == sampled
    assert man["totals"]["greedy_tokens"] == tokens - sampled
    assert 0 < sampled < tokens  # greedy and sampled mixed
    assert man["totals"]["by_engine"] == {"builtin": tokens}
    assert len(man["chunks"]) >= 2  # 6 prompts x 6 tokens a chunk cannot make 50
    for name, entry in man["chunks"].items():
        assert entry["done"] and entry["engine"] == "builtin" and entry["host"]["model"]
        assert entry["prompts"] == {"magpie": 3, "multiturn": 1, "ime": 2, "request": 0}
        assert entry["prompt_stage_tokens"] > 0
        rows = load_prompts_file(out / name / "data-prompts.jsonl")
        assert entry["data_prompts"] == len(rows) == entry["data_prompts_done"]
    # every prompt of every chunk is continued once
    texts = [json.dumps(r.messages or r.text) for name in man["chunks"]
             for r in load_prompts_file(out / name / "data-prompts.jsonl")]
    assert len(texts) == len(set(texts))


def test_a_bounded_run_stops_between_shards_and_a_rerun_lands_on_the_straight_run(
        target, tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    Corpus(_cfg(target, straight, 40)).run()
    bounded = Corpus(_cfg(target, cut, 40, max_minutes=60))
    calls = []
    # time runs out after the chunk start, its prompts stage and its first shard
    bounded.time_left = lambda seconds: calls.append(seconds) or len(calls) <= 3
    first = bounded.run()
    assert not first["finished"] and 0 < first["tokens"] < 40
    chunk = json.loads((cut / "corpus.json").read_text())["chunks"]["chunk-0000"]
    assert not chunk["done"] and chunk["shards"] == "1/3"
    again = Corpus(_cfg(target, cut, 40)).run()  # the same command without the bound
    assert again["finished"]
    a, b = _shards(straight), _shards(cut)
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(a[name], b[name], strict=True):
            assert np.array_equal(x.gen_ids, y.gen_ids)
            assert np.array_equal(x.topk_ids, y.topk_ids)
            assert np.array_equal(x.topk_logp, y.topk_logp)
    # a finished corpus asked for more goes on from where it is, rewriting nothing
    before = {p: p.stat().st_mtime_ns for p in list_shards(cut / "chunk-0000" / "data")}
    more = Corpus(_cfg(target, cut, 80)).run()
    assert more["finished"] and more["this_run_tokens"] > 0
    assert before == {p: p.stat().st_mtime_ns for p in list_shards(cut / "chunk-0000" / "data")}


def test_prompts_of_an_earlier_chunk_are_not_continued_again(target, tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "chunk_seed", lambda seed, chunk: 0 if chunk < 2 else chunk)
    out = tmp_path / "c"
    Corpus(_cfg(target, out, 60)).run()
    man = json.loads((out / "corpus.json").read_text())
    twin = man["chunks"]["chunk-0001"]  # sampled with chunk 0's seed: the same prompts
    assert twin["cross_chunk_duplicates"] == 6 and twin["data_prompts"] == 0
    assert twin["done"] and twin.get("tokens", 0) == 0
    assert man["chunks"]["chunk-0002"]["data_prompts"] > 0


def test_the_prompt_mix_is_a_chunks_own_and_may_change_between_runs(target, tmp_path):
    out, archive = tmp_path / "c", tmp_path / "archive"
    first = Corpus(_cfg(target, out, 1, archive=archive)).run()  # chunk 0 alone is enough
    assert first["finished"]
    Corpus(replace(_cfg(target, out, 40, archive=archive), request=2, magpie=1)).run()
    man = json.loads((out / "corpus.json").read_text())["chunks"]
    assert man["chunk-0000"]["mix"] == {"magpie": 3, "multiturn": 1, "ime": 2, "request": 0}
    assert man["chunk-0001"]["mix"] == {"magpie": 1, "multiturn": 1, "ime": 2, "request": 2}
    kinds = [p.kind for p in load_prompts_file(out / "chunk-0001" / "data-prompts.jsonl")]
    assert kinds.count("request") == 2 and kinds.count("magpie") == 1
    assert "request" not in {p.kind for p in load_prompts_file(
        out / "chunk-0000" / "data-prompts.jsonl")}
    # the archive keeps each chunk's mix in its entry, not as a corpus-wide setting
    assert "magpie" not in json.loads((archive / "settings.json").read_text())
    entry = json.loads((archive / "chunk-0001" / "chunk.json").read_text())["entry"]
    assert entry["mix"]["request"] == 2


def test_a_chunk_from_before_the_mix_resumes_with_the_legacy_mix(target, tmp_path, monkeypatch):
    out = tmp_path / "c"
    cut = Corpus(_cfg(target, out, 40))
    cut.time_left = lambda seconds: False  # start chunk 0's entry, then stop
    monkeypatch.setattr(corpus, "LEGACY_MIX", {"magpie": 2, "multiturn": 0, "ime": 1,
                                               "request": 0})
    man_path = out / "corpus.json"
    man = json.loads(man_path.read_text())
    man["chunks"]["chunk-0000"] = {"engine": "builtin", "dtype": "float32", "seed": 0,
                                   "host": {}, "started": "then"}  # no "mix": written before it
    man_path.write_text(json.dumps(man))
    Corpus(replace(_cfg(target, out, 1), request=2)).run()
    kinds = [p.kind for p in load_prompts_file(out / "chunk-0000" / "data-prompts.jsonl")]
    assert sorted(set(kinds)) == ["ime", "magpie"] and kinds.count("magpie") <= 2


def test_an_unfinished_chunk_in_another_dtype_waits_and_the_next_chunks_go_on(
        target, tmp_path, monkeypatch):
    """A chunk keeps its dtype: a run in another one (here a chunk marked bfloat16, the
    built-in engine's float32 run) leaves its missing shards alone, names it, and writes the
    chunks after it, whose prompts still skip the waiting chunk's (the next chunk drawn with
    the waiting one's seed: every prompt a duplicate)."""
    out = tmp_path / "c"
    cut = Corpus(_cfg(target, out, 80))
    calls = []
    cut.time_left = lambda seconds: calls.append(seconds) or len(calls) <= 7
    cut.run()
    man = json.loads((out / "corpus.json").read_text())
    waiting = next(n for n, e in man["chunks"].items() if not e["done"])
    man["chunks"][waiting]["dtype"] = "bfloat16"
    (out / "corpus.json").write_text(json.dumps(man))
    before = {k: v[0].gen_ids.tolist() for k, v in _shards(out).items()}
    twin = int(waiting.split("-")[1]) + 1
    seeds = corpus.chunk_seed
    monkeypatch.setattr(corpus, "chunk_seed", lambda seed, chunk: seeds(
        seed, chunk - 1 if chunk == twin else chunk))

    summary = Corpus(_cfg(target, out, 80)).run()
    assert summary["skipped_chunks"] == [waiting] and summary["this_run_tokens"] > 0
    after = _shards(out)
    assert {k: v[0].gen_ids.tolist() for k, v in after.items()
            if k.startswith(waiting)} == {k: v for k, v in before.items()
                                          if k.startswith(waiting)}
    man = json.loads((out / "corpus.json").read_text())
    assert man["chunks"][corpus._CHUNK.format(twin)]["data_prompts"] == 0
    assert man["chunks"][corpus._CHUNK.format(twin)]["cross_chunk_duplicates"] > 0
    assert any(k.split("/")[0] > corpus._CHUNK.format(twin) for k in after)


def test_other_data_settings_into_the_same_out_are_refused(target, tmp_path):
    out = tmp_path / "c"
    Corpus(_cfg(target, out, 10))
    with pytest.raises(ValueError, match="--max-new-tokens 6 \\(not 7\\)"):
        Corpus(replace(_cfg(target, out, 10), max_new_tokens=7))
    Corpus(_cfg(target, out, 99, max_minutes=3))  # the goal and the bound may change


@pytest.mark.parametrize("flags, dtype", [(["avx2"], "float32"),
                                          (["avx2", "avx512f"], "float32"),
                                          (["avx2", "avx512f", "avx512_bf16"], "bfloat16"),
                                          (["avx2", "amx_bf16"], "bfloat16")])
def test_auto_dtype_follows_the_host(flags, dtype):
    host = {"model": "x", "flags": flags}
    assert resolve_dtype("auto", "vllm", host) == dtype
    assert resolve_dtype("float32", "vllm", host) == "float32"
    assert resolve_dtype("auto", "builtin", host) == "float32"


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ValueError, match="at least one prompt"):
        Corpus(CorpusConfig(tmp_path, magpie=0, multiturn=0, ime=0, request=0))
    with pytest.raises(ValueError, match="--dtype"):
        Corpus(CorpusConfig(tmp_path, dtype="float16"))


def test_an_archive_carries_the_corpus_to_a_fresh_machine(target, tmp_path):
    """The first machine writes part of the corpus with --archive; a second machine, with the
    archive only, gets every shard back (ids as written, top-k labelled again by the target)
    and finishes the corpus as one straight run would have."""
    from edge_client.tools.distill.corpus_archive import read_ids

    straight, first, archive = tmp_path / "straight", tmp_path / "first", tmp_path / "archive"
    Corpus(_cfg(target, straight, 40)).run()
    cut = Corpus(_cfg(target, first, 40, archive=archive))
    calls = []
    cut.time_left = lambda seconds: calls.append(seconds) or len(calls) <= 3  # one shard
    assert not cut.run()["finished"]
    packed = sorted(p.relative_to(archive).as_posix() for p in archive.rglob("shard-*.npz"))
    assert packed == ["chunk-0000/shard-00000.npz"]
    ids, index = read_ids(archive / packed[0])
    assert ids[0].gen_ids.dtype == np.int64 and len(index) == 2
    with np.load(archive / packed[0]) as z:
        assert z["gen_ids"].dtype == np.uint16 and "topk_ids" not in z.files

    second = tmp_path / "second"  # a fresh machine: the archive is all it has
    summary = Corpus(_cfg(target, second, 40, archive=archive)).run()
    assert summary["finished"] and summary["restored"]["shards"] == 1
    entry = json.loads((second / "corpus.json").read_text())["chunks"]["chunk-0000"]
    assert entry["restored"]["labels"] == "builtin-float32" and entry["restored"]["shards"] == 1
    a, b = _shards(straight), _shards(second)
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(a[name], b[name], strict=True):
            assert np.array_equal(x.prompt_ids, y.prompt_ids)
            assert np.array_equal(x.gen_ids, y.gen_ids) and x.sampled == y.sampled
            # labels computed again, teacher-forced: the same top-k up to float rounding
            assert np.array_equal(x.topk_ids[:, 0], y.topk_ids[:, 0])
            np.testing.assert_allclose(x.topk_logp.astype(np.float32),
                                       y.topk_logp.astype(np.float32), atol=2e-2)
    # the second machine packed what it wrote: the archive now holds the whole corpus, and
    # its manifest entry as generated (not which machine restored what)
    assert len(list(archive.rglob("shard-*.npz"))) == len(a)
    archived = json.loads((archive / "chunk-0000" / "chunk.json").read_text())["entry"]
    assert "restored" not in archived and archived["done"]
    assert archived["tokens"] == entry["tokens"]
    third = tmp_path / "third"
    again = Corpus(_cfg(target, third, 40, archive=archive)).run()
    assert again["finished"] and again["this_run_tokens"] == 0
    assert again["restored"]["shards"] == len(a)


def test_a_run_that_only_grows_the_corpus_labels_no_finished_chunk(target, tmp_path):
    """--restore-chunks none: a fresh machine takes the archive's prompts and counts (so the
    dedup and the totals hold) and labels only the unfinished chunk it goes on with; the new
    chunks equal a straight run's, and a later run labels just the chunks it is asked for."""
    straight, archive = tmp_path / "straight", tmp_path / "archive"
    Corpus(_cfg(target, straight, 80)).run()
    first = Corpus(_cfg(target, tmp_path / "first", 80, archive=archive))
    calls = []
    first.time_left = lambda seconds: calls.append(seconds) or len(calls) <= 7
    assert not first.run()["finished"]
    entries = {c.name: json.loads((c / "chunk.json").read_text())["entry"]
               for c in sorted(archive.glob("chunk-*"))}
    finished = [n for n, e in entries.items() if e["done"]]
    open_ = [n for n, e in entries.items() if not e["done"]]
    assert finished and len(open_) == 1 and open_[0] > finished[-1]

    second = tmp_path / "second"
    summary = Corpus(_cfg(target, second, 80, archive=archive, restore_chunks="none")).run()
    assert summary["finished"] and summary["restored"]["unlabelled_chunks"] == len(finished)
    manifest = json.loads((second / "corpus.json").read_text())
    for name in finished:
        assert not (second / name / "data").exists()
        assert (second / name / "data-prompts.jsonl").exists()
        assert manifest["chunks"][name]["restored"]["labels"] is None
    assert manifest["chunks"][open_[0]]["restored"]["labels"] == "builtin-float32"
    a, b = _shards(straight), _shards(second)
    assert set(b) == {k for k in a if k.split("/")[0] not in finished}
    for name in b:
        for x, y in zip(a[name], b[name], strict=True):
            assert np.array_equal(x.prompt_ids, y.prompt_ids)
            assert np.array_equal(x.gen_ids, y.gen_ids)
    assert manifest["totals"]["tokens"] == json.loads(
        (straight / "corpus.json").read_text())["totals"]["tokens"]

    third = tmp_path / "third"
    again = Corpus(_cfg(target, third, 80, archive=archive,
                        restore_chunks=finished[0].split("-")[1])).run()
    assert again["finished"] and again["this_run_tokens"] == 0
    assert {k.split("/")[0] for k in _shards(third)} == {finished[0]}


@pytest.mark.parametrize(("spec", "chunks"), [("all", None), ("none", set()), ("3", {3}),
                                              ("15-17, 40", {15, 16, 17, 40})])
def test_restore_chunks_are_parsed(spec, chunks):
    assert corpus.parse_chunks(spec) == chunks


@pytest.mark.parametrize("spec", ["some", "4-2", "1-x", "-3"])
def test_bad_restore_chunks_are_refused(spec, tmp_path):
    with pytest.raises(ValueError, match="--restore-chunks"):
        Corpus(CorpusConfig(tmp_path, restore_chunks=spec))


def test_an_archive_refuses_other_settings_and_a_changed_prompt_file(target, tmp_path):
    import gzip

    archive = tmp_path / "archive"
    Corpus(_cfg(target, tmp_path / "a", 10, archive=archive)).run()
    with pytest.raises(ValueError, match="--top-k 4 \\(not 5\\)"):
        Corpus(replace(_cfg(target, tmp_path / "b", 10, archive=archive), top_k=5))
    gz = archive / "chunk-0000" / "data-prompts.jsonl.gz"
    gz.write_bytes(gzip.compress(gzip.decompress(gz.read_bytes()) + b"{}\n"))
    with pytest.raises(ValueError, match="does not match its digest"):
        Corpus(_cfg(target, tmp_path / "c", 10, archive=archive)).run()


def test_a_vllm_run_restores_through_its_writer_and_names_its_labels(target, tmp_path,
                                                                     monkeypatch):
    """With --engine vllm the restore labels through the run's vLLM writer (one call per
    shard) and the manifest says so; a stand-in writer labels with the built-in target here,
    so the shards must come back as the builtin restore writes them."""
    from edge_client.tools.distill.corpus_archive import _Labeller

    archive = tmp_path / "archive"
    Corpus(_cfg(target, tmp_path / "first", 20, archive=archive)).run()
    calls, dtypes = [], []

    class Writer:
        def label(self, rows, top_k):
            calls.append((len(rows), top_k))
            return _Labeller(target, top_k, 8)(rows)

    def writer(self, dtype):
        dtypes.append(dtype)
        return Writer()

    monkeypatch.setattr(corpus.Corpus, "_writer", writer)
    out = tmp_path / "second"
    summary = Corpus(replace(_cfg(target, out, 20, archive=archive), engine="vllm",
                             dtype="float32")).run()
    shards = sorted(archive.rglob("shard-*.npz"))
    assert summary["finished"] and summary["restored"]["shards"] == len(shards) > 0
    assert [k for _, k in calls] == [4] * len(shards) and set(dtypes) == {"float32"}
    entries = json.loads((out / "corpus.json").read_text())["chunks"].values()
    assert {e["restored"]["labels"] for e in entries if "restored" in e} == {"vllm-float32"}
    a, b = _shards(tmp_path / "first"), _shards(out)
    assert a.keys() == b.keys()
    for name in a:
        for x, y in zip(a[name], b[name], strict=True):
            assert np.array_equal(x.gen_ids, y.gen_ids)
            assert np.array_equal(x.topk_ids[:, 0], y.topk_ids[:, 0])
