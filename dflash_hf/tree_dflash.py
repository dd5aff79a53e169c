"""Tree verification: which drafted alternatives one verify checks, its attention mask, and the accepted path.

A DFlash draft gives a distribution at every position of its block, each independent of the tokens before it. A
chain verifies the argmax at every position; a tree verifies the `size` nodes of highest draft path probability
(the product of the draft's probabilities along the path), built best-first from each position's top candidates.
Each node is one column of the verify (column 0 is the pending token, the root); it sees the row's context, its
ancestors and itself, at the position of its depth. See docs/sampling.md, "Trees".

Acceptance walks the tree from the root. Greedy: a child is kept when it is the target's argmax at its parent.
Sampling: the children of a node are tried in turn, child x with probability p(x) / (1 - the mass of the children
tried before it), which is the rejection rule for a candidate chosen deterministically (its q is one-hot given the
earlier choices); when every child is refused, the token is sampled from p with the refused children removed. Both
keep the target's distribution exactly.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import torch

from .sampling_dflash import sample_from

MAX_CANDIDATES = 8  # top tokens per block position that a tree may branch into


@dataclass
class DraftTree:
    """One step's trees, one per row, all of `size` nodes; node j is verify column j + 1 (column 0: the root)."""

    tokens: list[list[int]]  # per row: each node's token, best-first (a parent always before its children)
    parents: list[list[int]]  # per row: each node's parent column (0: the root)
    depths: list[list[int]]  # per row: each node's depth (1: the first drafted position)
    real: list[list[bool]]  # per row: False for filler nodes (a row whose tree is smaller), never accepted

    @property
    def size(self) -> int:
        """Nodes per row (verify columns minus the root)."""
        return len(self.tokens[0]) if self.tokens else 0

    def children(self, row: int) -> list[list[int]]:
        """Per column 0 .. size: the columns of its real children, best-first."""
        children: list[list[int]] = [[] for _ in range(self.size + 1)]
        for node, (parent, real) in enumerate(zip(self.parents[row], self.real[row])):
            if real:
                children[parent].append(node + 1)
        return children


def best_first_tree(tokens: list[list[int]], probabilities: list[list[float]], size: int, max_depth: int
                    ) -> tuple[list[int], list[int], list[int]]:
    """One row's tree: (tokens, parent columns, depths) of its at most `size` nodes of highest path probability,
    best-first, at most `max_depth` deep; `tokens` / `probabilities`: per block position, its candidates
    (descending)."""
    frontier: list[tuple[float, int, int, int, int, float]] = []  # (-path prob, order, parent, depth, rank, base)
    order = itertools.count()  # ties: the node pushed first comes first

    def push(parent: int, depth: int, rank: int, base: float) -> None:
        if depth <= max_depth and rank < len(tokens[depth - 1]):
            heapq.heappush(frontier, (-base * probabilities[depth - 1][rank], next(order), parent, depth, rank,
                                      base))

    nodes: list[tuple[int, int, int]] = []  # (token, parent column, depth)
    push(0, 1, 0, 1.0)
    while frontier and len(nodes) < size:
        negative, _, parent, depth, rank, base = heapq.heappop(frontier)
        nodes.append((tokens[depth - 1][rank], parent, depth))
        push(parent, depth, rank + 1, base)  # the next sibling
        push(len(nodes), depth + 1, 0, -negative)  # the first child
    return [node[0] for node in nodes], [node[1] for node in nodes], [node[2] for node in nodes]


def build_trees(candidate_tokens: list[list[list[int]]], candidate_probabilities: list[list[list[float]]],
                size: int, max_depths: list[int], filler_token: list[int]) -> DraftTree:
    """Per row, the `size` nodes of highest draft path probability, best-first; at most `max_depths[row]` deep.

    candidate_tokens / candidate_probabilities: per row, per block position, the draft's top tokens and their
    probabilities (descending). A row with fewer possible nodes is filled with `filler_token[row]` nodes under the
    root that the walk never accepts.
    """
    trees = DraftTree([], [], [], [])
    for row, (tokens, probabilities) in enumerate(zip(candidate_tokens, candidate_probabilities)):
        node_tokens, parents, depths = best_first_tree(tokens, probabilities, size, max_depths[row])
        filler = size - len(node_tokens)
        trees.tokens.append(node_tokens + [filler_token[row]] * filler)
        trees.parents.append(parents + [0] * filler)
        trees.depths.append(depths + [1] * filler)
        trees.real.append([True] * len(node_tokens) + [False] * filler)
    return trees


def tree_attention_mask(trees: DraftTree, cached_valid: torch.Tensor | None, cached_width: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [n, 1, 1 + size, W + 1 + size]: a column sees the row's cached positions (`cached_valid`
    [n, W], None: all W), its ancestors and itself; 0 where it attends, the dtype's minimum elsewhere."""
    num_rows, width = len(trees.tokens), trees.size + 1
    sees = torch.zeros(num_rows, width, width, dtype=torch.bool)
    for row, parents in enumerate(trees.parents):
        sees[row, 0, 0] = True
        for node, parent in enumerate(parents, start=1):
            sees[row, node] = sees[row, parent]
            sees[row, node, node] = True
    device = cached_valid.device if cached_valid is not None else torch.device("cpu")
    cached = (torch.ones(num_rows, cached_width, dtype=torch.bool, device=device) if cached_valid is None
              else cached_valid)
    allowed = torch.cat((cached[:, None, :].expand(num_rows, width, cached_width), sees.to(device)), dim=2)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def walk_greedy(trees: DraftTree, row: int, argmax: list[int]) -> list[int]:
    """The accepted path of a row (its columns, root excluded): each child kept is the argmax [1 + size] at its
    parent."""
    children, path, column = trees.children(row), [], 0
    while True:
        kept = next((child for child in children[column] if trees.tokens[row][child - 1] == argmax[column]), None)
        if kept is None:
            return path
        path.append(kept)
        column = kept


def walk_sampled(trees: DraftTree, row: int, child_probabilities: list[float], uniforms: list[float]) -> list[int]:
    """The accepted path of a row under sampling: at each node its children are tried best-first, child x kept when
    its uniform < p(x) / (1 - mass of the children refused before it). `child_probabilities` [size]: p at each
    node's parent of the node's token; `uniforms` [size]: one per node."""
    children, path, column = trees.children(row), [], 0
    while True:
        refused, kept = 0.0, None
        for child in children[column]:
            probability = child_probabilities[child - 1]
            remaining = 1.0 - refused
            if remaining > 0.0 and uniforms[child - 1] < probability / remaining:
                kept = child
                break
            refused += probability
        if kept is None:
            return path
        path.append(kept)
        column = kept


def residual_samples(probabilities: torch.Tensor, trees: DraftTree, uniforms: torch.Tensor) -> torch.Tensor:
    """At every column [n, 1 + size]: a sample of p (probabilities [n, 1 + size, V]) with that column's real
    children's tokens removed (renormalised): the token that follows a walk ending there. Uniforms [n, 1 + size]."""
    residual = probabilities.clone()
    rows, columns, tokens = [], [], []
    for row in range(len(trees.tokens)):
        for node, (parent, real) in enumerate(zip(trees.parents[row], trees.real[row])):
            if real:
                rows.append(row)
                columns.append(parent)
                tokens.append(trees.tokens[row][node])
    if rows:
        device = probabilities.device
        residual[torch.tensor(rows, device=device), torch.tensor(columns, device=device),
                 torch.tensor(tokens, device=device)] = 0.0
    mass = residual.sum(dim=-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(residual.dtype).tiny), probabilities)
    return sample_from(residual, uniforms)
