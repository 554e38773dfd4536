"""Token-tree shapes for the tree-draft benchmark, and their greedy acceptance.

A shape is a set of nodes, each named by its *rank path*: node (0, 1) is the draft's
second-best token after its best first token. The root (the last committed token, which the
verify forward feeds first, as a chain round does) is the empty path and is not a node, so a
shape of n nodes costs n + 1 verified rows, the same as a chain of n drafts. A chain of K is
((0,), (0, 0), ..., (0,) * K).

Under greedy verification the target accepts the longest root path whose tokens equal its
own greedy continuation. Sibling tokens are distinct (they are different ranks of one
distribution), so at most one child of a node can match, and the node that matches at depth d
has, as its context, exactly the committed text plus d tokens of the target's greedy path.
Its children are therefore the draft's top ranks at that point of the path, which one trace
of the draft along the path gives (``edge_client.bench.acceptance.draft_trace``). That makes
``accepted_by_rank`` exact without drafting the off-path branches, the same argument as
``acceptance.PathDrafter`` makes for chains; ``accept_greedy`` is the same rule on a concrete
token tree, and the benchmark checks the two agree on drafted trees.

No torch here: numpy and the standard library.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import numpy as np

Node = tuple[int, ...]
Shape = tuple[Node, ...]


def normalize(nodes: Iterable[Sequence[int]]) -> Shape:
    """Nodes in breadth-first order (depth, then rank path); every prefix must be a node, so
    each node's parent is in the tree."""
    shape = tuple(sorted({tuple(int(r) for r in n) for n in nodes}, key=lambda n: (len(n), n)))
    known = set(shape)
    for n in shape:
        if not n or min(n) < 0:
            raise ValueError(f"bad node {n}: rank paths are non-empty, ranks >= 0")
        if len(n) > 1 and n[:-1] not in known:
            raise ValueError(f"node {n} has no parent {n[:-1]} in the tree")
    return shape


def chain(k: int) -> Shape:
    return tuple((0,) * d for d in range(1, k + 1))


def per_depth(branches: Sequence[int]) -> Shape:
    """``branches[d]`` children under every node of depth d: [2, 1, 1] is the top-2 first
    tokens, each followed by the draft's chain of 2."""
    level: list[Node] = [()]
    nodes: list[Node] = []
    for b in branches:
        level = [n + (r,) for n in level for r in range(b)]
        nodes += level
    return normalize(nodes)


def chain_with_siblings(k: int, siblings: int) -> Shape:
    """A chain of k drafts plus, at each of its first ``siblings`` depths, the draft's
    second-best token there as a leaf."""
    return normalize(chain(k) + tuple((0,) * d + (1,) for d in range(siblings)))


def best_tree(rows: int, rank_probs: Sequence[float]) -> Shape:
    """The ``rows`` nodes most likely to be on the target's path when the target's token has
    draft rank r with probability ``rank_probs[r]`` at every step, independently: a node's
    probability is the product over its rank path, so the best tree of n nodes is the n most
    probable nodes (each no likelier than its parent or its lower-rank sibling, so they form a
    tree). Grown best first, as Sequoia and SpecInfer's expansion do."""
    p = list(rank_probs)
    heap = [(-p[0], (0,))] if p and p[0] > 0 else []
    nodes: list[Node] = []
    while heap and len(nodes) < rows:
        neg, node = heapq.heappop(heap)
        nodes.append(node)
        heapq.heappush(heap, (neg * p[0], node + (0,)))  # its best child
        r = node[-1] + 1
        if r < len(p) and p[r] > 0:  # its next sibling
            heapq.heappush(heap, (neg / p[node[-1]] * p[r], node[:-1] + (r,)))
    return normalize(nodes)


def name(shape: Shape) -> str:
    """A short label: chain4, b2-1-1 (per depth), chain3+s1, or the node count."""
    depth = max((len(n) for n in shape), default=0)
    if shape == chain(depth):
        return f"chain{depth}"
    branches = branches_of(shape)
    if branches is not None:
        return "b" + "-".join(map(str, branches))
    for s in range(1, depth + 1):
        if shape == chain_with_siblings(depth, s):
            return f"chain{depth}+s{s}"
    return f"tree{len(shape)}"


def branches_of(shape: Shape) -> list[int] | None:
    """The per-depth branching of a ``per_depth`` shape (a chain: all 1), else None."""
    depth = max((len(n) for n in shape), default=0)
    widths = [sum(len(n) == d for n in shape) for d in range(1, depth + 1)]
    if not widths:
        return None
    branches = [widths[0]] + [w // v for v, w in zip(widths, widths[1:], strict=False)]
    return branches if per_depth(branches) == shape else None


def parents(shape: Shape) -> list[int]:
    """Index of each node's parent in ``shape``, -1 for a child of the root."""
    index = {n: i for i, n in enumerate(shape)}
    return [index[n[:-1]] if len(n) > 1 else -1 for n in shape]


def truncate(shape: Shape, max_depth: int) -> Shape:
    """The nodes at depth <= max_depth (a round near the token limit drafts fewer)."""
    return tuple(n for n in shape if len(n) <= max_depth)


def draft_forwards(shape: Shape) -> int:
    """Draft forwards that drafting the shape takes with one forward per expanded node: the
    root's, and one for each node with children (a chain of K: K)."""
    return 1 + len({n[:-1] for n in shape if len(n) > 1})


def accepted_by_rank(shape: Shape | frozenset, ranks: Sequence[int]) -> int:
    """Greedy acceptance from the target's tokens' draft ranks along its path: ``ranks[j]``
    is the rank, in the draft's distribution at path step j, of the target's token there.
    Returns the number of drafts accepted (module docstring)."""
    nodes = shape if isinstance(shape, frozenset) else frozenset(shape)
    node: Node = ()
    for r in ranks:
        if node + (int(r),) not in nodes:
            break
        node += (int(r),)
    return len(node)


def accept_greedy(tokens: Sequence[int], parent: Sequence[int], path: Sequence[int]
                  ) -> list[int]:
    """The node indices, root first, of the longest root path of a token tree whose tokens
    equal ``path``'s first tokens (the target's greedy continuation). ``parent[i]`` is node
    i's parent index, -1 for the root's children. With two matching children (duplicates) the
    one leading deepest wins; ties go to the lower index."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parent):
        children.setdefault(p, []).append(i)

    def deepest(node: int, depth: int) -> list[int]:
        best: list[int] = []
        if depth < len(path):
            for c in children.get(node, ()):
                if tokens[c] == path[depth]:
                    below = [c] + deepest(c, depth + 1)
                    if len(below) > len(best):
                        best = below
        return best

    return deepest(-1, 0)


def ancestry(parent: Sequence[int]) -> np.ndarray:
    """Bool [n, n]: row i may attend to column j iff j is i or one of i's ancestors."""
    n = len(parent)
    seen = np.eye(n, dtype=bool)
    for i, p in enumerate(parent):
        if p >= i:
            raise ValueError("parents must come before their children")
        if p >= 0:
            seen[i] |= seen[p]
    return seen


def ranks_along(draft_logits: np.ndarray, path: Sequence[int], cap: int) -> np.ndarray:
    """[n]: the rank of path[t] among the draft's logits row t, ties to the lower id (as
    ``np.argsort(-row, kind='stable')`` orders them), capped at ``cap``."""
    out = np.empty(len(path), dtype=np.int64)
    for t, token in enumerate(path):
        row = draft_logits[t]
        v = row[token]
        out[t] = min(cap, int((row > v).sum() + (row[:token] == v).sum()))
    return out


def top_ranked(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k best logits, best first, ties to the lower id."""
    return np.argsort(-row, kind="stable")[:k]
