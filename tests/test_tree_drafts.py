"""The tree-draft benchmark's pieces: tree shapes, greedy tree acceptance, the tree-mask
forward against causal forwards over each node's root path, the drafted trees against the
rank replay, and SpecInfer's multi-draft acceptance."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.bench import tree_shapes as ts
from edge_client.bench.tree_drafts import (
    chain_forward,
    multi_draft_acceptance,
    prefilled_cache,
    replay_drafted_tree,
    replay_tree_rounds,
    tree_forward,
    tree_rows,
    tree_vs_paths_error,
)


def test_shapes_count_their_nodes_and_name_themselves():
    assert ts.chain(3) == ((0,), (0, 0), (0, 0, 0))
    assert ts.per_depth([2, 1, 1]) == ((0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0))
    assert len(ts.per_depth([2, 2])) == 6 and ts.name(ts.per_depth([2, 2])) == "b2-2"
    assert ts.name(ts.chain_with_siblings(3, 1)) == "chain3+s1"
    assert ts.chain_with_siblings(2, 2) == ((0,), (1,), (0, 0), (0, 1))
    assert ts.parents(ts.per_depth([2, 1])) == [-1, -1, 0, 1]
    # One forward for the root, one per node with children: a chain of K takes K.
    assert ts.draft_forwards(ts.chain(4)) == 4
    assert ts.draft_forwards(ts.per_depth([2, 1, 1])) == 5
    with pytest.raises(ValueError):
        ts.normalize([(0, 0)])  # its parent (0,) is missing


def test_best_tree_takes_the_most_probable_nodes():
    # Rank 0 right half the time, rank 1 30%: the nodes by probability are (0,) .5, (1,) .3,
    # (0, 0) .25, then (1, 0) and (0, 1) at .15 (either may come first), (0, 0, 0) .125.
    tree = ts.best_tree(4, [0.5, 0.3, 0.1])
    assert tree == ((0,), (1,), (0, 0), (1, 0)) or tree == ((0,), (1,), (0, 0), (0, 1))
    assert ts.best_tree(3, [0.9, 0.05]) == ts.chain(3)  # a sharp draft: the chain


def test_greedy_tree_acceptance_is_the_longest_matching_root_path():
    #        root
    #      /      \
    #    5(0)     7(1)
    #    |        /  \
    #    6(2)   8(3)  9(4)
    #            |
    #           10(5)
    tokens, parent = [5, 7, 6, 8, 9, 10], [-1, -1, 0, 1, 1, 3]
    assert ts.accept_greedy(tokens, parent, [7, 8, 10, 1]) == [1, 3, 5]
    assert ts.accept_greedy(tokens, parent, [7, 9, 10]) == [1, 4]
    assert ts.accept_greedy(tokens, parent, [5, 6]) == [0, 2]
    assert ts.accept_greedy(tokens, parent, [7, 8]) == [1, 3]  # the path ends first
    assert ts.accept_greedy(tokens, parent, [4, 5]) == []
    assert ts.accept_greedy(tokens, parent, []) == []
    # Duplicate siblings: the one whose subtree goes deeper.
    assert ts.accept_greedy([3, 3, 4], [-1, -1, 1], [3, 4]) == [1, 2]


def test_rank_acceptance_walks_the_shape():
    tree = ts.per_depth([2, 1])  # (0,) (1,) (0, 0) (1, 0)
    assert ts.accepted_by_rank(tree, [1, 0, 0]) == 2
    assert ts.accepted_by_rank(tree, [0, 1]) == 1
    assert ts.accepted_by_rank(tree, [2, 0]) == 0
    assert ts.accepted_by_rank(ts.chain(3), [0, 0, 0, 0]) == 3


def test_ranks_along_breaks_ties_like_a_stable_sort():
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [-np.inf, 2.0, 5.0, 2.0]])
    assert ts.ranks_along(logits, [2, 3], cap=8).tolist() == [1, 2]
    assert ts.top_ranked(logits[1], 3).tolist() == [2, 1, 3]
    assert ts.ranks_along(logits, [3, 0], cap=2).tolist() == [2, 2]


def test_tree_replay_counts_rounds_and_caps_at_the_token_limit():
    # Ranks along an 8-token path: a chain of 2 accepts (0, 0) then fails at rank 1.
    ranks = np.array([0, 0, 1, 0, 0, 0, 1, 1])
    chain_count, chain_forwards = replay_tree_rounds(ranks, ts.chain(2), 8)
    tree_count, _ = replay_tree_rounds(ranks, ts.per_depth([2, 1]), 8)
    # chain: (0, 0) + 1 -> t=3; (0, 0) + 1 -> t=6; one draft left under the limit, rank 1
    # rejected -> t=7; no room for a draft -> t=8: 4 rounds, 2 + 2 + 1 + 0 draft forwards.
    assert chain_count.rounds == 4 and chain_forwards == 5
    # tree [2, 1]: (0, 0) + 1 -> t=3; (0, 0) + 1 -> t=6; depth 1 left, (1,) accepted + 1 ->
    # t=8: 3 rounds.
    assert tree_count.rounds == 3


@pytest.mark.parametrize("shape", [ts.per_depth([2, 1, 1]), ts.chain_with_siblings(3, 2),
                                   ts.per_depth([3, 2])])
def test_tree_mask_forward_equals_causal_forwards_over_each_root_path(target, shape):
    model, gen = target.model, torch.Generator().manual_seed(3)
    context = torch.randint(0, target.vocab_size, (20,), generator=gen).tolist()
    cache = prefilled_cache(model, context)
    tokens = torch.randint(0, target.vocab_size, (len(shape) + 1,), generator=gen).tolist()
    assert tree_vs_paths_error(model, cache, tokens, shape) < 1e-4
    assert cache.get_seq_length() == len(context)  # cropped back after every forward
    # The check has teeth: without the mask (a causal forward over the same rows) the rows
    # of the second branch see the first branch's tokens and differ.
    parent, depth = tree_rows(shape)
    assert not torch.allclose(tree_forward(model, cache, tokens, parent, depth),
                              chain_forward(model, cache, tokens), atol=1e-3)


def test_drafted_trees_take_the_rounds_the_rank_replay_counts(tiny_llama_pair, target):
    from edge_client.bench.acceptance import draft_trace, target_greedy_path
    from edge_client.draft_model import OnnxDraftModel

    draft = OnnxDraftModel(tiny_llama_pair.draft_dir, intra_op_threads=1)
    prompt = [1, 17, 40, 9, 63, 22]
    path, _, _ = target_greedy_path(target, prompt, 24, frozenset())
    logits, _ = draft_trace(draft, prompt, path)
    ranks = ts.ranks_along(logits, path, cap=8)
    for shape in (ts.chain(3), ts.per_depth([2, 1]), ts.per_depth([3, 2]),
                  ts.best_tree(6, [0.3, 0.2, 0.1])):
        count, _ = replay_tree_rounds(ranks, shape, 24)
        assert replay_drafted_tree(draft, prompt, path, shape, 24) == count.rounds


def _recursive_rejection(p: np.ndarray, q: np.ndarray, k: int, rng) -> tuple[int, bool]:
    """One node of SpecInfer's verification: k drafts drawn i.i.d. from q, each accepted with
    min(1, r(x) / q(x)) against the residual r; if all fail, a sample of the last residual."""
    r = p.copy()
    for _ in range(k):
        x = _draw(q, rng)
        if rng.random() < min(1.0, r[x] / q[x]):
            return x, True
        r = np.maximum(r - q, 0)
        r /= r.sum()
    return _draw(r, rng), False


def _draw(probs: np.ndarray, rng) -> int:
    return min(int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right")),
               len(probs) - 1)


def test_multi_draft_acceptance_matches_hand_values_and_a_lossless_simulation():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.2, 0.6])
    # One draft: sum min(p, q) = 0.2 + 0.2 + 0.2 = 0.6. Residual max(p - q, 0) = (.3, .1, 0)
    # normalized (.75, .25, 0); second draft: sum min = .2 + .2 = .4, so 1 - .4 * .6 = .76.
    assert multi_draft_acceptance(p, q, 2) == pytest.approx([0.6, 0.76])
    assert multi_draft_acceptance(p, p, 3) == pytest.approx([1.0, 1.0, 1.0])
    # The estimate's premise: simulated, the scheme accepts that often and its output is
    # distributed as p (lossless). 20,000 draws: 4 standard errors is about 0.014.
    rng = np.random.default_rng(0)
    pn, qn = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.2, 0.6])
    draws = [_recursive_rejection(pn, qn, 2, rng) for _ in range(20_000)]
    assert np.mean([a for _, a in draws]) == pytest.approx(0.76, abs=0.014)
    freq = np.bincount([x for x, _ in draws], minlength=3) / len(draws)
    assert freq == pytest.approx(pn, abs=0.014)
