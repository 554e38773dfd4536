"""edgespec-distill gen-prompts on a tiny random target, and gen-data --prompts-file after it.

The tiny target never ends a turn on its own (its tokens are random), so these runs keep
unfinished turns; the filter that drops them is checked once on its own. What matters here:
the three kinds are written in their shapes, a stopped run resumes without regenerating what
exists and lands on the records one straight run writes, duplicates and eval-set overlaps are
dropped, and gen-data encodes each shape as it should (raw text without the chat template,
conversations with it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edge_client.bench.eval_set import EvalPrompt, overlaps
from edge_client.tools.distill import magpie
from edge_client.tools.distill.cli import main as distill_main
from edge_client.tools.distill.magpie import MagpieConfig, gen_prompts
from edge_client.tools.distill.prompt_file import encode_prompt, load_prompts_file
from edge_client.tools.distill.shards import list_shards, read_shard
from edge_client.tools.distill.turn_sampling import user_turn_prefix

OPENERS = ("t5 t6", "t7", "t8 t9 t10")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    from conftest import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("magpie") / "target", num_layers=2, seed=0)


def _cfg(target: Path, out: Path, n: int, **kw) -> MagpieConfig:
    counts = kw.pop("counts", dict.fromkeys(magpie.KINDS, n))
    return MagpieConfig(out=out, target=target, counts=counts, batch_size=4,
                        max_user_tokens=10, max_answer_tokens=6, ime_max_tokens=12,
                        keep_unfinished=True, ime_openers=OPENERS, request_openers=OPENERS,
                        chunk_size=3, progress=False, **kw)


def _records(out: Path, kind: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"{kind}.jsonl").read_text().splitlines()]


def test_user_turn_prefix_comes_from_the_template():
    template = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != "
                "'system' %}{{ '<|im_start|>system\nBe nice.<|im_end|>\n' }}{% endif %}"
                "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
                "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|im_start|>assistant\n' }}{% endif %}")
    tok = SimpleNamespace(chat_template=template, bos_token="<|im_start|>",
                          eos_token="<|im_end|>")
    system = "<|im_start|>system\nBe nice.<|im_end|>\n"
    assert user_turn_prefix(tok) == system + "<|im_start|>user\n"
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert user_turn_prefix(tok, history) == (system + "<|im_start|>user\nhi<|im_end|>\n"
                                              "<|im_start|>assistant\nhello<|im_end|>\n"
                                              "<|im_start|>user\n")


def test_text_filter_reasons():
    cfg = MagpieConfig(Path())

    def why(text, ids=(), done=True):
        return magpie.text_reason(text, list(ids), done, {1}, cfg, 3, 20)

    assert why("how do I fix a bike chain that keeps slipping?") is None
    assert why("how do I fix", done=False) == "unfinished"
    assert why("how do I fix", ids=[5, 1]) == "special_token"
    assert why("  \n ") == "empty"
    assert why("\x00\x01\x02 abc def ghi") == "unprintable"
    assert why("hi there") == "too_short"
    assert why(" ".join(["word"] * 21)) == "too_long"
    assert why("data science consulting, " * 6) == "repetitive"


def test_writes_the_four_kinds(target, tmp_path):
    out = tmp_path / "p"
    stats = gen_prompts(_cfg(target, out, 5), eval_prompts=[])
    for kind in magpie.KINDS:
        recs = _records(out, kind)
        assert len(recs) == 5 and stats["stages"][kind]["kept"] == 5
        assert [r["id"] for r in recs] == [f"{kind}-{i:06d}" for i in range(5)]
        assert all(r["source"] == kind and isinstance(r["seed"], int) for r in recs)
    assert all(len(r["prompt"].split()) >= 3 for r in _records(out, "magpie"))
    for r in _records(out, "multiturn"):
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user"]
        assert all(m["content"].strip() for m in r["messages"])
    for r in _records(out, "ime"):
        assert 3 <= len(r["text"].split()) <= 15 and r["text"] == r["text"].strip()
    assert {r["from"] for r in _records(out, "ime")} == {"user", "opener"}
    for r in _records(out, "request"):  # a user turn that starts with its opener
        assert r["opener"] in OPENERS and r["prompt"].startswith(r["opener"])
        assert len(r["prompt"].split()) > len(r["opener"].split())  # the target went on
    merged = load_prompts_file(out / "prompts.jsonl")
    assert [p.kind for p in merged] == (["magpie"] * 5 + ["multiturn"] * 5 + ["ime"] * 5
                                        + ["request"] * 5)
    assert all(p.chat for p in merged if p.kind == "request")
    saved = json.loads((out / "stats.json").read_text())
    assert saved["stages"]["ime"]["seconds"] > 0 and saved["records"] == 20
    assert saved["engine"] == "builtin"
    # Every sampled token counts, a multiturn round's answers included: at least the kept
    # records' own tokens (10 a user turn at most, here never finished).
    assert all(saved["stages"][k]["tokens"] >= 5 * 10 for k in ("magpie", "multiturn"))
    assert saved["stages"]["ime"]["tokens"] > 0
    assert json.loads((out / "config.json").read_text())["engine"] == "builtin"


def test_unfinished_turns_are_dropped(target, tmp_path):
    cfg = replace(_cfg(target, tmp_path / "p", 0, counts={"magpie": 2}),
                  keep_unfinished=False, max_tries=3)
    stats = gen_prompts(cfg, eval_prompts=[])["stages"]["magpie"]
    assert stats["filtered"].get("unfinished", 0) > 0
    assert stats["candidates"] >= 6  # gave up after max_tries * count candidates
    assert all(len(r["prompt"].split()) >= 3 for r in _records(tmp_path / "p", "magpie"))


def test_resume_extends_the_stream_without_regenerating(target, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    gen_prompts(_cfg(target, straight, 8), eval_prompts=[])

    out = tmp_path / "resumed"
    gen_prompts(_cfg(target, out, 4), eval_prompts=[])
    first = {k: _records(out, k) for k in magpie.KINDS}
    chunks = {p.name: p.read_bytes() for p in (out / "chunks").iterdir()}

    calls = []  # stop the magpie stage after one more round: an interrupted run
    real = magpie._ROUNDS["magpie"]

    def interrupted(sampler, seed):
        if calls:
            raise KeyboardInterrupt
        calls.append(seed)
        return real(sampler, seed)

    monkeypatch.setitem(magpie._ROUNDS, "magpie", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gen_prompts(_cfg(target, out, 8), eval_prompts=[])
    monkeypatch.setitem(magpie._ROUNDS, "magpie", real)

    done = {k: json.loads((out / "chunks" / sorted(
        p.name for p in (out / "chunks").glob(f"{k}-*"))[-1]).read_text().splitlines()[0]
    )["chunk"]["next_round"] for k in magpie.KINDS}
    seeds = []  # the rerun samples only the rounds no chunk holds
    for kind, fn in list(magpie._ROUNDS.items()):
        monkeypatch.setitem(magpie._ROUNDS, kind,
                            lambda s, seed, fn=fn, kind=kind: seeds.append((kind, seed))
                            or fn(s, seed))
    stats = gen_prompts(_cfg(target, out, 8), eval_prompts=[])
    for kind in magpie.KINDS:
        mine = [seed for k, seed in seeds if k == kind]
        assert mine[0] == magpie.round_seed(0, kind, done[kind])
    for name, data in chunks.items():
        assert (out / "chunks" / name).read_bytes() == data  # never rewritten
    for kind in magpie.KINDS:
        now = _records(out, kind)
        assert now[:4] == first[kind]
        assert now == _records(straight, kind)
    again = gen_prompts(_cfg(target, out, 8), eval_prompts=[])  # all there: nothing sampled
    assert all(again["stages"][k]["seconds_this_run"] == 0 for k in magpie.KINDS)
    assert again["stages"]["magpie"]["rounds"] == stats["stages"]["magpie"]["rounds"]


def test_rerun_with_other_settings_is_refused(target, tmp_path):
    out = tmp_path / "p"
    gen_prompts(_cfg(target, out, 0, counts={"ime": 2}), eval_prompts=[])
    with pytest.raises(ValueError, match="temperature"):
        gen_prompts(_cfg(target, out, 0, counts={"ime": 2}, temperature=0.5), eval_prompts=[])


def test_another_engine_into_the_same_out_is_refused(target, tmp_path):
    # Refused before any engine starts: no vLLM needed to see it.
    out = tmp_path / "p"
    gen_prompts(_cfg(target, out, 0, counts={"ime": 2}), eval_prompts=[])
    with pytest.raises(ValueError, match='engine "builtin" \\(not "vllm"\\)'):
        gen_prompts(_cfg(target, out, 0, counts={"ime": 2}, engine="vllm"), eval_prompts=[])
    with pytest.raises(ValueError, match="dtype"):
        gen_prompts(_cfg(target, out, 0, counts={"ime": 2}, engine="vllm", dtype="bfloat16"),
                    eval_prompts=[])
    args = ["gen-prompts", "--out", str(out), "--target", str(target), "--ime-count", "2",
            "--no-progress", "--engine", "vllm"]
    assert distill_main(args) == 2  # the CLI says it in one line


def test_the_built_in_engine_takes_no_vllm_dtype(target, tmp_path):
    with pytest.raises(ValueError, match="--dtype is vLLM's"):
        gen_prompts(_cfg(target, tmp_path / "p", 0, counts={"ime": 2}, dtype="bfloat16"),
                    eval_prompts=[])


def test_a_directory_from_before_the_engine_setting_resumes_as_builtin(target, tmp_path):
    out = tmp_path / "p"
    gen_prompts(_cfg(target, out, 0, counts={"ime": 2}), eval_prompts=[])
    config = json.loads((out / "config.json").read_text())
    del config["engine"], config["dtype"]
    (out / "config.json").write_text(json.dumps(config))
    stats = gen_prompts(_cfg(target, out, 0, counts={"ime": 4}), eval_prompts=[])
    assert stats["stages"]["ime"]["kept"] == 4
    with pytest.raises(ValueError, match="engine"):
        gen_prompts(_cfg(target, out, 0, counts={"ime": 4}, engine="vllm"), eval_prompts=[])


def test_duplicates_are_dropped(target, tmp_path):
    # Greedy user turns: every row of every round is the same text.
    cfg = _cfg(target, tmp_path / "p", 0, counts={"magpie": 3}, temperature=0.0, max_tries=2)
    stats = gen_prompts(cfg, eval_prompts=[])["stages"]["magpie"]
    assert stats["kept"] == 1 and stats["filtered"]["duplicate"] == stats["candidates"] - 1


def test_eval_set_overlaps_are_dropped(target, tmp_path):
    plain = tmp_path / "plain"
    gen_prompts(_cfg(target, plain, 4), eval_prompts=[])
    leaked = [_records(plain, "magpie")[0]["prompt"], _records(plain, "ime")[1]["text"],
              _records(plain, "multiturn")[2]["messages"][2]["content"],
              _records(plain, "request")[3]["prompt"]]
    fake = [EvalPrompt("advice-x", "advice", (("user", leaked[0]),)),
            EvalPrompt("email-x", "email", (("user", leaked[3]),)),
            EvalPrompt("ime-x", "ime", (), leaked[1]),
            EvalPrompt("multiturn-x", "multiturn",
                       (("user", "t3 t4 t5"), ("assistant", "t6"), ("user", leaked[2])))]
    out = tmp_path / "filtered"
    stats = gen_prompts(_cfg(target, out, 4), eval_prompts=fake)
    assert all(stats["stages"][k]["filtered"]["eval_overlap"] >= 1 for k in magpie.KINDS)
    texts = [t for p in load_prompts_file(out / "prompts.jsonl")
             for t in ([c for _, c in p.messages] or [p.text])]
    assert texts and not overlaps(texts, fake)


def test_gen_data_continues_a_prompts_file(target, tmp_path):
    out = tmp_path / "p"
    assert distill_main(["gen-prompts", "--out", str(out), "--target", str(target),
                         "--count", "2", "--ime-count", "3", "--batch-size", "4",
                         "--max-user-tokens", "8", "--max-answer-tokens", "5",
                         "--keep-unfinished", "--no-progress", "--threads", "1"]) == 0
    prompts = load_prompts_file(out / "prompts.jsonl")
    assert [p.kind for p in prompts] == (["magpie"] * 2 + ["multiturn"] * 2 + ["ime"] * 3
                                         + ["request"] * 2)
    data = tmp_path / "data"
    args = ["gen-data", "--out", str(data), "--target", str(target), "--prompts-file",
            str(out / "prompts.jsonl"), "--shard-size", "4", "--batch-size", "3",
            "--max-new-tokens", "6", "--top-k", "8", "--sample-fraction", "0.5"]
    assert distill_main(args) == 0

    from edge_client.tokenizer import EdgeTokenizer

    tok = EdgeTokenizer(target)
    got = {}
    for path in list_shards(data):
        with np.load(path) as z:
            index = z["prompt_index"].tolist()
        got.update(zip(index, read_shard(path), strict=True))
    assert sorted(got) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        assert got[i].prompt_ids.tolist() == encode_prompt(tok, p)
        if p.kind == "ime":
            assert got[i].prompt_ids.tolist() == tok.encode(p.text)  # no chat template
        if p.kind == "multiturn":
            msgs = [{"role": r, "content": c} for r, c in p.messages]
            assert got[i].prompt_ids.tolist() == tok.encode(tok.apply_chat_template(msgs))
    assert {s.sampled for s in got.values()} == {True, False}  # --sample-fraction applies

    # A regenerated, bigger prompt file would put other prompts in the same shards.
    assert distill_main(["gen-prompts", "--out", str(out), "--target", str(target),
                         "--count", "3", "--ime-count", "3", "--batch-size", "4",
                         "--max-user-tokens", "8", "--max-answer-tokens", "5",
                         "--keep-unfinished", "--no-progress"]) == 0
    assert distill_main(args) == 2
