"""``edgespec-bench acceptance`` on the tiny pair: the report's fields and ranges (the realistic
eval set by category, reported first, and the held-out split under the original keys), and one
exact case, a draft that is the target itself.

The tiny tokenizer is a WordLevel over t3..t95, so the eval set's English encodes to <unk>
ids; what these tests check is the report's structure and ranges, not the figures."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

K = 4
MAX_NEW = 12
HELDOUT = 2


def run(tmp_path, target_dir, draft_dir, name: str, *extra: str) -> tuple[dict, str]:
    from edge_client.bench.cli import main

    out = tmp_path / f"{name}.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(["acceptance", "--json", str(out), "--model", str(target_dir),
                   "--draft-dir", str(draft_dir), "--prompts", "1", "--heldout-prompts",
                   str(HELDOUT), "--max-new-tokens", str(MAX_NEW), "--draft-len", str(K),
                   "--threads", "1", *extra])
    assert rc == 0
    return json.loads(out.read_text()), printed.getvalue()


def in_unit(x) -> bool:
    return x is None or 0 <= x <= 1


@pytest.fixture(scope="module")
def pair_run(tiny_llama_pair, tmp_path_factory):
    return run(tmp_path_factory.mktemp("bench"), tiny_llama_pair.target_dir,
               tiny_llama_pair.draft_dir, "pair")


@pytest.fixture(scope="module")
def report(pair_run):
    return pair_run[0]


def test_realistic_comes_first(pair_run):
    report, printed = pair_run
    assert report["config"]["sets"] == ["realistic", "heldout"]
    keys = list(report)
    assert keys.index("realistic") < keys.index("drafters")
    assert 0 <= printed.index("realistic set:") < printed.index("held-out split")
    assert "**overall**" in printed


def check_headline(h: dict, prompts: int) -> None:
    assert h["prompts"] == prompts and 0 <= h["prompts_truncated"] <= prompts
    assert h["path_tokens"] == h["detail"]["path_tokens"] > 0
    assert set(h["drafters"]) == {"model", "ngram", "combined"}
    for name, m in h["drafters"].items():
        d = h["detail"]["drafters"][name]
        assert in_unit(m["greedy_alpha"]) and in_unit(m["sampled_alpha"]), name
        assert m["greedy_alpha"] == d["greedy"]["alpha"]
        assert m["greedy_judged"] == d["greedy"]["judged"]
        assert m["sampled_alpha"] == d["sampled"]["alpha"]
        tpr = m["tokens_per_round_k4"]
        assert tpr == d["greedy_tokens_per_round_by_k"]["4"]
        assert 1 <= tpr <= 5
        assert m["target_forwards_per_token_k4"] == pytest.approx(1 / tpr)
        assert 1 / 5 <= m["target_forwards_per_token_k4"] <= 1
        full = m["tokens_per_full_round_k4"]
        assert full is None or 1 <= full <= 5
    assert in_unit(h["expected_sampled_alpha"]) and in_unit(h["greedy_top1_agreement"])


def test_realistic_by_category(report):
    from edge_client.bench.eval_set import CATEGORIES

    r = report["realistic"]
    assert r["source"] == "edge_client/bench/eval_prompts"
    assert r["per_category_limit"] == 1 and r["headline_k"] == 4
    assert list(r["categories"]) == list(CATEGORIES)  # one prompt of each, in order
    assert r["prompts"] == r["overall"]["prompts"] == len(CATEGORIES)
    for h in r["categories"].values():
        check_headline(h, 1)
    check_headline(r["overall"], len(CATEGORIES))
    # Overall pools the categories' counts.
    cats, overall = r["categories"].values(), r["overall"]
    assert overall["path_tokens"] == sum(h["path_tokens"] for h in cats)
    for name in overall["drafters"]:
        for mode in ("greedy", "sampled"):
            parts = [h["detail"]["drafters"][name][mode] for h in cats]
            pooled = overall["detail"]["drafters"][name][mode]
            for key in ("accepted", "judged", "rounds", "new_tokens"):
                assert pooled[key] == sum(p[key] for p in parts), (name, mode, key)
            if pooled["judged"]:
                assert pooled["alpha"] == pytest.approx(pooled["accepted"] / pooled["judged"])
        # Greedy through the verifier's engine reproduces the target's own greedy path.
        assert overall["detail"]["drafters"][name]["greedy"]["identical_to_target"] == 8


def test_eval_prompts_are_rendered_by_shape():
    """One-turn and multi-turn prompts go through the chat template over all their turns,
    IME prefixes are encoded raw; prompts are cut from the left to fit."""
    from edge_client.bench.acceptance_sets import encode_eval
    from edge_client.bench.eval_set import EvalPrompt

    class Recording:
        def apply_chat_template(self, messages):
            return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

        def encode(self, text):
            return [ord(c) for c in text]

    prompts = [
        EvalPrompt("a", "advice", (("user", "hi"),)),
        EvalPrompt("m", "multiturn", (("user", "q1"), ("assistant", "a1"), ("user", "q2"))),
        EvalPrompt("i", "ime", raw="see you at th"),
    ]
    out = encode_eval(Recording(), prompts, max_len=40)
    text = ["".join(map(chr, p.ids)) for p in out]
    assert text == ["<user>hi<assistant>", "<user>q1<assistant>a1<user>q2<assistant>",
                    "see you at th"]
    assert [p.category for p in out] == ["advice", "multiturn", "ime"]
    assert not any(p.truncated for p in out)
    cut = encode_eval(Recording(), prompts[1:2], max_len=13)[0]
    assert cut.truncated and "".join(map(chr, cut.ids)) == "q2<assistant>"


def test_report_fields_and_ranges(report):
    c = report["config"]
    assert c["prompts"] == HELDOUT and c["draft_len"] == K and c["max_new_tokens"] == MAX_NEW
    assert c["prompt_source"]
    assert set(report["drafters"]) == {"model", "ngram", "combined"}
    for name, d in report["drafters"].items():
        for mode in ("greedy", "sampled"):
            m = d[mode]
            assert in_unit(m["alpha"]) and in_unit(m["acceptance_rate"]), (name, mode)
            assert 0 <= m["accepted"] <= m["judged"] <= m["drafted"] <= K * m["rounds"]
            assert 1 <= m["tokens_per_round"] <= K + 1
            positions = m["by_position"]
            assert [p["position"] for p in positions] == list(range(1, K + 1))
            judged = [p["judged"] for p in positions]
            assert judged == sorted(judged, reverse=True)  # position i+1 is judged only after i
            assert sum(judged) == m["judged"]
            assert all(in_unit(p["alpha"]) for p in positions)
        # Greedy through the verifier's engine reproduces the target's own greedy path.
        assert d["greedy"]["identical_to_target"] == HELDOUT
        by_k = d["greedy_tokens_per_round_by_k"]
        assert list(by_k) == [str(k) for k in range(1, 9)]
        assert all(1 <= by_k[str(k)] <= k + 1 for k in range(1, 9))
        full = d["greedy_tokens_per_full_round_by_k"]
        assert list(full) == list(by_k)
        assert all(full[str(k)] is None or 1 <= full[str(k)] <= k + 1 for k in range(1, 9))
        # The replay is exact: at K it equals the rounds the engine really ran.
        assert by_k[str(K)] == pytest.approx(d["greedy"]["tokens_per_round"])
    assert report["drafters"]["model"]["greedy"]["rounds_without_proposal"] == 0
    assert 0 <= report["drafters"]["combined"]["greedy"]["lookup_draft_share"] <= 1
    lat = report["latency"]
    assert lat["draft_step_ms_median"] > 0 and lat["target_step_ms_median"] > 0
    mv = report["model_vs_target"]
    assert mv["positions"] == report["path_tokens"] > 0
    assert mv["kl_target_draft_mean"] >= 0
    assert 0 <= mv["tv_mean"] <= 1 and 0 <= mv["tv_sampled_mean"] <= 1
    assert in_unit(mv["greedy_top1_agreement"])
    # A point mass is accepted with p(d) <= min(1, p(d)/q(d)) at every d: per position
    # sum q p <= sum min(p, q) (p q <= min(p, q) max(p, q)), so on average too.
    assert 0 <= mv["expected_sampled_alpha_point_mass"] <= mv["expected_sampled_alpha"] + 1e-9


def test_a_draft_that_is_the_target_is_always_accepted(tiny_llama_pair, tmp_path):
    from edge_client.tools.export_draft import export_onnx

    self_draft = export_onnx(tiny_llama_pair.target_dir, tmp_path / "self_onnx")
    # Sets named in the other order: the report still puts realistic first.
    report, printed = run(tmp_path, tiny_llama_pair.target_dir, self_draft, "self",
                          "--sets", "heldout", "realistic")
    assert printed.index("realistic set:") < printed.index("held-out split")
    for h in [*report["realistic"]["categories"].values(), report["realistic"]["overall"]]:
        m = h["drafters"]["model"]
        assert m["greedy_alpha"] == 1.0
        # Every round accepts all K drafts, or ends the path: at most one round per 5 tokens
        # plus one cut round per prompt.
        assert m["target_forwards_per_token_k4"] <= (1 / 5 + h["prompts"] / h["path_tokens"])
    greedy = report["drafters"]["model"]["greedy"]
    # ONNX and PyTorch differ by float noise only, which moves no argmax here.
    assert greedy["alpha"] == 1.0
    assert all(p["alpha"] in (1.0, None) for p in greedy["by_position"])
    mv = report["model_vs_target"]
    assert mv["greedy_top1_agreement"] == 1.0
    assert mv["tv_mean"] < 1e-4 and mv["kl_target_draft_mean"] < 1e-6
    assert mv["tv_sampled_mean"] < 1e-4
    assert mv["expected_sampled_alpha_point_mass"] <= mv["expected_sampled_alpha"] + 1e-9
    # Sampling with q = p accepts unless u lands within float noise of 1.
    assert report["drafters"]["model"]["sampled"]["alpha"] > 0.95


def test_path_replay_equals_replaying_the_real_drafter(tiny_llama_pair, tmp_path):
    """The greedy tokens/round by K come from the draft's trace along the target's path; for
    every K and several prompts they equal replaying the real ONNX drafter round by round,
    the model alone and combined with the per-position lookup.
    The draft is the target's first layer, so it agrees often but not always."""
    import numpy as np
    from transformers import AutoModelForCausalLM

    from cloud_verifier.target_model import load_target
    from edge_client.bench.acceptance import (
        PathDrafter,
        draft_trace,
        replay_greedy_rounds,
        target_greedy_path,
    )
    from edge_client.combined_drafter import make_drafter
    from edge_client.draft_model import OnnxDraftModel
    from edge_client.drafter import DraftSampling
    from edge_client.ngram_drafter import ContextLookup
    from edge_client.tools.export_draft import export_onnx

    truncated = AutoModelForCausalLM.from_pretrained(tiny_llama_pair.target_dir)
    truncated.model.layers = truncated.model.layers[:1]
    truncated.config.num_hidden_layers = 1
    truncated.save_pretrained(tmp_path / "pt")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (tmp_path / "pt" / name).write_bytes((tiny_llama_pair.target_dir / name).read_bytes())
    target = load_target(str(tiny_llama_pair.target_dir))
    model = OnnxDraftModel(export_onnx(tmp_path / "pt", tmp_path / "onnx"), intra_op_threads=1)
    stop = frozenset(target.eos_token_ids)
    compared, copied, agree = 0, 0, []
    for seed in range(6):
        prompt = np.random.default_rng(seed).integers(3, 90, size=4 + seed).tolist()
        path, _, _ = target_greedy_path(target, prompt, 16, stop)
        draft_argmax = draft_trace(model, prompt, path)[0].argmax(-1)
        agree += (draft_argmax == np.array(path)).tolist()
        for k in range(1, 9):
            for kind in ("model", "combined"):
                real = make_drafter(kind, model, DraftSampling(), np.random.default_rng(0))
                fast = PathDrafter(len(prompt), path, draft_argmax,
                                   ContextLookup() if kind == "combined" else None)
                assert (replay_greedy_rounds(fast, prompt, path, k, 16)
                        == replay_greedy_rounds(real, prompt, path, k, 16)), (seed, k, kind)
                copied += 0 if fast.lookup is None else fast.lookup.proposed
                compared += 1
    assert compared == 96 and copied > 0
    assert 0.2 < np.mean(agree) < 0.9, np.mean(agree)  # both branches of every round exercised


def test_full_round_tokens_per_round_is_the_steady_state_formula():
    """A drafter whose every draft matches the target's path with probability a, independently:
    over full rounds, greedy tokens per round is (1 - a^(K+1)) / (1 - a) (Leviathan et al.),
    while all rounds of short generations fall below it (the last round is cut).
    3,000 paths of 16 tokens (about 20k full rounds at K=4; the per-round standard deviation
    is ~1.3, so the standard error is ~0.01); threshold 0.04."""
    import numpy as np

    from edge_client.bench.acceptance import ReplayCount, replay_greedy_rounds
    from edge_client.drafter import Proposal

    alpha, k, n_new = 0.6, 4, 16
    rng = np.random.default_rng(0)

    class IidDrafter:
        def __init__(self, prompt_len: int, path: list[int]) -> None:
            self.prompt_len, self.path = prompt_len, path

        def propose(self, committed, kk):
            t = len(committed) - self.prompt_len
            tokens = []
            while len(tokens) < kk and t + len(tokens) < len(self.path):
                right = self.path[t + len(tokens)]
                tokens.append(right if rng.random() < alpha else right + 1)
                if tokens[-1] != right:
                    break
            return Proposal(tokens, None)

    total, path_tokens = ReplayCount(), 0
    for _ in range(3000):
        path = rng.integers(0, 1000, size=n_new).tolist()
        total += replay_greedy_rounds(IidDrafter(3, path), [1, 2, 3], path, k, n_new)
        path_tokens += n_new
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)  # 2.306
    assert total.full_rounds > 15_000
    assert total.full_tokens / total.full_rounds == pytest.approx(expected, abs=0.04)
    assert path_tokens / total.rounds < expected - 0.1  # truncated tails pull it down
