"""Tree verification: which drafted alternatives one verify checks, what each column sees, and the accepted path.

A DFlash draft gives a distribution at every position of its block, each independent of the tokens before it. A
chain verifies the argmax at every position; a tree verifies the `size` nodes of highest draft path probability
(the product of the draft's probabilities along the path), built best-first from each position's top candidates
(with a DFlash2 selector or a DSpark Markov head, a node's children ranked by the draft's probabilities after the
node's token, or after its whole path).
Each node is one column of the verify (column 0 is the pending token, the root); it sees the row's context, its
ancestors and itself, at the position of its depth (`tree_sees`); a hybrid target's recurrent layers run along its
root-to-leaf paths (`PathPlan`). See docs/sampling.md, "Trees".

Acceptance walks the tree from the root. Greedy: a child is kept when it is the target's argmax at its parent.
Sampling: recursive rejection sampling (SpecInfer): the children of a node are tried in turn, child x kept with
probability min(1, r(x) / q_i(x)), where q_i is the distribution the child was drawn from (q without the earlier
children, renormalised; one-hot for a candidate chosen deterministically) and r starts as the target's p at the node
and becomes norm(max(r - q_i, 0)) after each refusal; when every child is refused, the token is sampled from the
last r. This keeps the target's distribution exactly. The tree's shape comes from the draft's largest probabilities
at each position, never from the drawn tokens, so which candidates a node tries does not depend on what was drawn.

Whether a call can verify trees at all is decided here, before any forward (`tree_refusal`, `check_tree_size`).

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from .cache_dflash import host_to_device
from .devices_dflash import MASKED_ATTENTION, target_text_config
from .sampling_dflash import sample_from
from .support_dflash import windowed_mask_refusal

if TYPE_CHECKING:
    from .proposer_dflash import DFlashDraft

MAX_CANDIDATES = 8  # top tokens per block position that a tree may branch into


@dataclass
class DraftTree:
    """One step's trees, one per row, all of `size` nodes; node j is verify column j + 1 (column 0: the root)."""

    tokens: list[list[int]]  # per row: each node's token, best-first (a parent always before its children)
    parents: list[list[int]]  # per row: each node's parent column (0: the root)
    depths: list[list[int]]  # per row: each node's depth (1: the first drafted position)
    real: list[list[bool]]  # per row: False for filler nodes (a row whose tree is smaller), never accepted
    # per row: (parent column, place among the parent's tried children, token) of each candidate the call's
    # processors forbid under that parent (`build_trees`' `forbidden`): not verified, but a sampled walk tries it
    # there, a certain refusal, in its place among the children drawn (empty: none)
    refused: list[list[tuple[int, int, int]]] = field(default_factory=list)

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

    def tried_children(self, row: int) -> list[list[int]]:
        """Per column 0 .. size: its children in the order a sampled walk tries them: a real child's column, or
        -token for a child the call's processors forbid there (`refused`; never verified, refused for certain)."""
        tried = self.children(row)
        for parent, place, token in (self.refused[row] if self.refused else []):
            tried[parent].insert(place, -token)
        return tried

    def paths(self, row: int) -> list[list[int]]:
        """The row's root-to-leaf paths over its real nodes, each as its columns from the root (column 0) on."""
        children, paths, stack = self.children(row), [], [[0]]
        while stack:
            path = stack.pop()
            if children[path[-1]]:
                stack.extend(path + [child] for child in reversed(children[path[-1]]))
            else:
                paths.append(path)
        return paths


def best_first_tree(tokens: list[list[int]], probabilities: list[list[float]], size: int, max_depth: int,
                    transitions: list[list[list[float]]] | None = None,
                    after_path: Callable[[tuple[int, ...]], list[float]] | None = None
                    ) -> tuple[list[int], list[int], list[int]]:
    """One row's tree: (tokens, parent columns, depths) of its at most `size` nodes of highest path probability,
    best-first, at most `max_depth` deep. `tokens` / `probabilities`: per block position, its candidates (the
    probabilities descending); `transitions` (DFlash2, a Markov head whose bias reads the token before only): per
    position p >= 1, the probability of each candidate after each candidate of position p - 1, by which a node's
    children are then ranked; `after_path` (a recurrent Markov head, whose state follows the whole path): the
    probability of each candidate of the next position after a node's path (its candidates' ranks from position 0),
    asked once per node planted above `max_depth`."""
    orders: dict[tuple[int, ...], list[tuple[float, int]]] = {}

    def children_of(parent_path: tuple[int, ...]) -> list[tuple[float, int]]:
        """The candidates under the node of `parent_path` (its ranks; () the root): (probability, rank), most
        probable first."""
        if parent_path not in orders:
            depth = len(parent_path) + 1
            if depth > 1 and after_path is not None:
                row = after_path(parent_path)
            elif depth > 1 and transitions is not None:
                row = transitions[depth - 1][parent_path[-1]]
            else:
                row = probabilities[depth - 1]
            orders[parent_path] = sorted(((probability, rank) for rank, probability in enumerate(row)),
                                         key=lambda item: -item[0])  # stable: ties keep the candidates' order
        return orders[parent_path]

    # frontier: (-path prob, order, parent column, sibling index, parent's path prob, parent's path of ranks)
    frontier: list[tuple[float, int, int, int, float, tuple[int, ...]]] = []
    order = itertools.count()  # ties: the node pushed first comes first

    def push(parent: int, sibling: int, base: float, parent_path: tuple[int, ...]) -> None:
        if len(parent_path) + 1 > max_depth:
            return
        siblings = children_of(parent_path)
        if sibling < len(siblings) and siblings[sibling][0] > 0.0:
            heapq.heappush(frontier, (-base * siblings[sibling][0], next(order), parent, sibling, base, parent_path))

    nodes: list[tuple[int, int, int]] = []  # (token, parent column, depth)
    push(0, 0, 1.0, ())
    while frontier and len(nodes) < size:
        negative, _, parent, sibling, base, parent_path = heapq.heappop(frontier)
        rank = children_of(parent_path)[sibling][1]
        depth = len(parent_path) + 1
        nodes.append((tokens[depth - 1][rank], parent, depth))
        push(parent, sibling + 1, base, parent_path)  # the next sibling
        push(len(nodes), 0, -negative, (*parent_path, rank))  # the first child
    return [node[0] for node in nodes], [node[1] for node in nodes], [node[2] for node in nodes]


def column_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Per column of one row's tree (0: the root; node j: column j + 1, parents before children): the tokens from the
    root's child down to it (the ids after the committed ones that the position after it sees)."""
    paths: list[list[int]] = [[]]
    for token, parent in zip(tokens, parents):
        paths.append(paths[parent] + [token])
    return paths


def drop_refused(tokens: list[int], parents: list[int], depths: list[int], forbidden: list[bool]
                 ) -> tuple[list[int], list[int], list[int], list[tuple[int, int, int]]]:
    """One row's tree (`best_first_tree`'s) without its `forbidden` nodes (the call's processors forbid them after
    their parent's path) and the subtrees under them: (tokens, parent columns, depths, refused as `DraftTree.refused`
    holds them). The shape is the one planted, so which children a sampled walk tries does not depend on which tokens
    were forbidden."""
    columns = [0]  # per old column: its new one (-1: dropped)
    places: dict[int, int] = {}  # per old parent column: its children so far
    kept: tuple[list[int], list[int], list[int]] = ([], [], [])
    refused = []
    for token, parent, depth, refuse in zip(tokens, parents, depths, forbidden):
        place = places[parent] = places.get(parent, -1) + 1
        if columns[parent] < 0 or refuse:
            if columns[parent] >= 0:
                refused.append((columns[parent], place, token))
            columns.append(-1)
            continue
        for values, value in zip(kept, (token, columns[parent], depth)):
            values.append(value)
        columns.append(len(kept[0]))
    return *kept, refused


def build_trees(candidate_tokens: list[list[list[int]]], candidate_probabilities: list[list[list[float]]],
                size: int, max_depths: list[int], filler_token: list[int],
                candidate_transitions: list[list[list[list[float]]]] | None = None,
                forbidden: Callable[[int, list[list[int]], list[int]], list[bool]] | None = None,
                after_path: Callable[[int, tuple[int, ...]], list[float]] | None = None) -> DraftTree:
    """Per row, the `size` nodes of highest draft path probability, best-first; at most `max_depths[row]` deep.

    candidate_tokens / candidate_probabilities: per row, per block position, the draft's top tokens and their
    probabilities (descending); candidate_transitions (DFlash2, Markov): per row, `best_first_tree`'s transitions;
    after_path (a recurrent Markov head): `best_first_tree`'s, of the row and a node's path;
    `forbidden(row, paths, tokens)` (under the call's processors): per node, whether its token is ruled out after its
    parent's path (`column_paths`) in that row; those nodes are dropped (`drop_refused`). A row with fewer possible
    nodes is filled with `filler_token[row]` nodes under the root that the walk never accepts.
    """
    trees = DraftTree([], [], [], [])
    for row, (tokens, probabilities) in enumerate(zip(candidate_tokens, candidate_probabilities)):
        transitions = None if candidate_transitions is None else candidate_transitions[row]
        node_tokens, parents, depths = best_first_tree(tokens, probabilities, size, max_depths[row], transitions,
                                                       None if after_path is None else
                                                       lambda path, row=row: after_path(row, path))
        if forbidden is not None:
            paths = column_paths(node_tokens, parents)
            node_tokens, parents, depths, refused = drop_refused(
                node_tokens, parents, depths, forbidden(row, [paths[parent] for parent in parents], node_tokens))
            trees.refused.append(refused)
        filler = size - len(node_tokens)
        trees.tokens.append(node_tokens + [filler_token[row]] * filler)
        trees.parents.append(parents + [0] * filler)
        trees.depths.append(depths + [1] * filler)
        trees.real.append([True] * len(node_tokens) + [False] * filler)
    return trees


def tree_sees(trees: DraftTree, device: torch.device) -> torch.Tensor:
    """Which verify columns each column sees [n, 1 + size, 1 + size] (bool): its ancestors and itself."""
    width = trees.size + 1
    rows = []
    for parents in trees.parents:
        sees = [[column == 0 for column in range(width)]]  # the root sees itself
        for node, parent in enumerate(parents, start=1):
            sees.append([seen or column == node for column, seen in enumerate(sees[parent])])
        rows.append(sees)
    return host_to_device(rows, device, torch.bool)


@dataclass
class PathPlan:
    """A tree verify's recurrent mixer call: every row's P root-to-leaf paths (its last again when it has fewer) as
    rows of one batch, row r's paths at r * P .. r * P + P - 1, so that each column's recurrence sees its ancestors
    only (hybrid targets: `recurrent_dflash`, `static_recurrent_dflash`). rows [n * P]: the cache row each path starts
    from; reads [n * P, D]: the verify column of each place (b: padding); writes [n * P, D]: the column that takes its
    output (b where padding, or where an earlier path of the row already gave it); first_paths [n]: each row's first
    path."""

    width: int  # b: the verify's columns
    rows: torch.Tensor
    reads: torch.Tensor
    writes: torch.Tensor
    first_paths: torch.Tensor

    @staticmethod
    def of(tree_paths: list[list[list[int]]], width: int, device: torch.device, fixed: bool = False) -> PathPlan:
        """The call for `tree_paths` (per row, the columns of each root-to-leaf path, all starting at column 0) in a
        verify of `width` columns; `fixed`: as many paths and places as any tree of `width` columns can have (width - 1
        paths of width places), so that every tree's call has the same shapes (a compiled verify)."""
        num_paths = max(width - 1, 1) if fixed else max(len(paths) for paths in tree_paths)
        depth = width if fixed else max(len(path) for paths in tree_paths for path in paths)
        rows, reads, writes = [], [], []
        for row, paths in enumerate(tree_paths):
            owned: set[int] = set()
            for index in range(num_paths):
                path = paths[min(index, len(paths) - 1)]
                rows.append(row)
                padding = [width] * (depth - len(path))
                reads.append(path + padding)
                writes.append([width if column in owned else column for column in path] + padding)
                owned.update(path)
        return PathPlan(width, *(host_to_device(value, device) for value in (rows, reads, writes)),
                        host_to_device(list(range(0, len(rows), num_paths)), device))


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


def choose_child(target_probabilities: torch.Tensor, child_tokens: list[int], draft_probabilities: torch.Tensor | None,
                 uniforms: list[float]) -> tuple[int | None, torch.Tensor]:
    """Recursive rejection sampling at one node: (the index of the child kept, None when all are refused; the
    residual r [V] a refusal leaves). `target_probabilities` [V]: p at the node; `draft_probabilities` [V]: the q the
    children were drawn from without replacement (None: chosen deterministically); one uniform per child."""
    residual = target_probabilities.double()
    remaining = None if draft_probabilities is None else draft_probabilities.double().clone()
    for index, (token, uniform) in enumerate(zip(child_tokens, uniforms)):
        if remaining is None:  # q_i is one-hot at the token
            proposal = torch.zeros_like(residual)
            proposal[token] = 1.0
        else:
            proposal = remaining / remaining.sum()
            remaining[token] = 0.0
        if uniform * float(proposal[token]) < float(residual[token]):  # u < r(x) / q_i(x)
            return index, residual
        refused = (residual - proposal).clamp_(min=0.0)
        mass = float(refused.sum())
        if mass <= 0.0:  # r <= q_i everywhere: r(x) / q_i(x) was 1 but for rounding
            return index, residual
        residual = refused / mass
    return None, residual


def walk_sampled(trees: DraftTree, row: int, target_probabilities: torch.Tensor,
                 draft_probabilities: torch.Tensor | None, child_uniforms: list[float], final_uniforms: list[float]
                 ) -> tuple[list[int], int]:
    """A row's accepted path under sampling (its columns, root excluded) and the token after it, by `choose_child`
    at each node. target_probabilities [1 + size, V]: p at every column; draft_probabilities [depth, V]: q at each
    block position (None: deterministic candidates); child_uniforms [size], final_uniforms [1 + size]."""
    children, path, column = trees.tried_children(row), [], 0
    while True:
        depth = trees.depths[row][column - 1] if column else 0
        tokens = [trees.tokens[row][child - 1] if child > 0 else -child for child in children[column]]
        draft = None if draft_probabilities is None or not tokens else draft_probabilities[depth]  # children's q
        # a refused child's uniform is never read: r is 0 at its token, so it is refused whatever it is
        kept, residual = choose_child(target_probabilities[column], tokens, draft,
                                      [child_uniforms[child - 1] if child > 0 else 1.0 for child in children[column]])
        if kept is None:
            final = sample_from(residual, torch.tensor(final_uniforms[column], dtype=torch.float64))
            return path, int(final)
        column = children[column][kept]
        path.append(column)


def check_tree_size(tree_size: Any, target: torch.nn.Module, draft: DFlashDraft | None,
                    adaptive_widths: bool) -> None:
    """Raise when `tree_size` is not a positive int (or None), or when the call cannot verify a tree
    (`adaptive_widths`: the call was given step costs, which choose a chain's verify width per step)."""
    if tree_size is None:
        return
    if tree_size == "auto":
        raise ValueError("tree_size='auto' is a choice timed on this machine, made once and not per call: pass the "
                         "size that dflash_hf.cost_model.choose_tree_size(draft, target, prompt, ...) returns (bench "
                         "and demo do this; docs/sampling.md, \"Trees\").")
    if isinstance(tree_size, bool) or not isinstance(tree_size, int) or tree_size < 1:
        raise ValueError(f"tree_size must be a positive int (drafted tokens per step) or None (a chain), got "
                         f"{tree_size!r}.")
    refusal = tree_refusal(target, draft, adaptive_widths)
    if refusal is not None:
        raise ValueError(refusal)


def tree_refusal(target: torch.nn.Module, draft: DFlashDraft | None, adaptive_widths: bool = False) -> str | None:
    """Why calls with this target and draft (and, with `adaptive_widths`, step costs) cannot verify trees
    (`spec_generate(tree_size=N)` raises it), or None."""
    if adaptive_widths:
        return "tree_size and step_costs (verify widths chosen per step) cannot be combined; pass one."
    config = target_text_config(target)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in MASKED_ATTENTION:
        return (f"tree_size needs the target's attention to take a 4-D mask ({', '.join(MASKED_ATTENTION)}); this "
                f"target uses {implementation!r}: load it with attn_implementation=\"sdpa\".")
    refusal = windowed_mask_refusal(config)
    if refusal is not None:
        return (f"tree_size is not supported with {type(target).__name__}: {refusal} (a tree's mask is built by "
                "position for full and sliding-window attention); pass tree_size=None.")
    return None
