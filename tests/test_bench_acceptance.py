"""``edgespec-bench acceptance`` on the tiny pair: the report's fields and ranges, and one
exact case, a draft that is the target itself."""

from __future__ import annotations

import json

import pytest

K = 4
MAX_NEW = 12


def run(tmp_path, target_dir, draft_dir, name: str) -> dict:
    from edge_client.bench.cli import main

    out = tmp_path / f"{name}.json"
    rc = main(["acceptance", "--json", str(out), "--model", str(target_dir),
               "--draft-dir", str(draft_dir), "--prompts", "2", "--max-new-tokens",
               str(MAX_NEW), "--draft-len", str(K), "--threads", "1"])
    assert rc == 0
    return json.loads(out.read_text())


def in_unit(x) -> bool:
    return x is None or 0 <= x <= 1


@pytest.fixture(scope="module")
def report(tiny_llama_pair, tmp_path_factory):
    return run(tmp_path_factory.mktemp("bench"), tiny_llama_pair.target_dir,
               tiny_llama_pair.draft_dir, "pair")


def test_report_fields_and_ranges(report):
    c = report["config"]
    assert c["prompts"] == 2 and c["draft_len"] == K and c["max_new_tokens"] == MAX_NEW
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
        assert d["greedy"]["identical_to_target"] == 2
        by_k = d["greedy_tokens_per_round_by_k"]
        assert list(by_k) == [str(k) for k in range(1, 9)]
        assert all(1 <= by_k[str(k)] <= k + 1 for k in range(1, 9))
        full = d["greedy_tokens_per_full_round_by_k"]
        assert list(full) == list(by_k)
        assert all(full[str(k)] is None or 1 <= full[str(k)] <= k + 1 for k in range(1, 9))
        # The replay is exact: at K it equals the rounds the engine really ran.
        assert by_k[str(K)] == pytest.approx(d["greedy"]["tokens_per_round"])
    assert report["drafters"]["model"]["greedy"]["rounds_without_proposal"] == 0
    assert 0 <= report["drafters"]["combined"]["greedy"]["ngram_round_share"] <= 1
    lat = report["latency"]
    assert lat["draft_step_ms_median"] > 0 and lat["target_step_ms_median"] > 0
    mv = report["model_vs_target"]
    assert mv["positions"] == report["path_tokens"] > 0
    assert mv["kl_target_draft_mean"] >= 0
    assert 0 <= mv["tv_mean"] <= 1 and 0 <= mv["tv_sampled_mean"] <= 1
    assert in_unit(mv["greedy_top1_agreement"])


def test_a_draft_that_is_the_target_is_always_accepted(tiny_llama_pair, tmp_path):
    from edge_client.tools.export_draft import export_onnx

    self_draft = export_onnx(tiny_llama_pair.target_dir, tmp_path / "self_onnx")
    report = run(tmp_path, tiny_llama_pair.target_dir, self_draft, "self")
    greedy = report["drafters"]["model"]["greedy"]
    # ONNX and PyTorch differ by float noise only, which moves no argmax here.
    assert greedy["alpha"] == 1.0
    assert all(p["alpha"] in (1.0, None) for p in greedy["by_position"])
    mv = report["model_vs_target"]
    assert mv["greedy_top1_agreement"] == 1.0
    assert mv["tv_mean"] < 1e-4 and mv["kl_target_draft_mean"] < 1e-6
    assert mv["tv_sampled_mean"] < 1e-4
    # Sampling with q = p accepts unless u lands within float noise of 1.
    assert report["drafters"]["model"]["sampled"]["alpha"] > 0.95


def test_path_replay_equals_replaying_the_real_drafter(tiny_llama_pair, tmp_path):
    """The greedy tokens/round by K come from the draft's trace along the target's path; for
    every K and several prompts they equal replaying the real ONNX drafter round by round.
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
    compared, agree = 0, []
    for seed in range(6):
        prompt = np.random.default_rng(seed).integers(3, 90, size=4 + seed).tolist()
        path, _, _ = target_greedy_path(target, prompt, 16, stop)
        draft_argmax = draft_trace(model, prompt, path)[0].argmax(-1)
        agree += (draft_argmax == np.array(path)).tolist()
        for k in range(1, 9):
            real = make_drafter("model", model, DraftSampling(), np.random.default_rng(0))
            fast = PathDrafter(len(prompt), path, draft_argmax)
            assert (replay_greedy_rounds(fast, prompt, path, k, 16)
                    == replay_greedy_rounds(real, prompt, path, k, 16)), (seed, k)
            compared += 1
    assert compared == 48
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
