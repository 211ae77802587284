"""Token-tree shapes and their growth from per-depth draft logits, shared by every tree drafter: a static tree of
child ranks (Medusa) or a dynamic tree (EAGLE-2)."""

from collections.abc import Mapping, Sequence

import torch

from ..draft import Draft
from ..sampling import process_logits
from ..tree import TokenTree, tree_from_paths
from .spec import Setting


class DraftNodes:
    """The nodes drafted so far in one step: token, parent and cumulative draft log-probability of each (the
    working set of `StaticTree` and `DynamicTree` expansion, shared by every tree drafter)."""

    def __init__(self):
        self.token_ids: list[int] = []
        self.parent_ids: list[int] = []
        self.log_probs: list[float] = []  # log q of the whole path from the root to the node

    def add(self, parent: int, token: int, log_prob: float) -> int:
        """Adds a child of `parent` (-1: the root) with draft log-probability `log_prob`; returns its index."""
        self.token_ids.append(token)
        self.parent_ids.append(parent)
        self.log_probs.append(log_prob + (self.log_probs[parent] if parent >= 0 else 0.0))
        return len(self.token_ids) - 1

    def prefixes(self, input_ids: torch.LongTensor, nodes: list[int]):
        """Lazily, for each of `nodes`, `input_ids` `(1, length)` followed by the tokens on its path."""
        tree = TokenTree(torch.tensor(self.parent_ids, dtype=torch.long, device=input_ids.device))
        token_ids = torch.tensor(self.token_ids, dtype=torch.long, device=input_ids.device)
        yield from tree.prefixes(input_ids, token_ids, nodes)

    def draft(self, keep: list[int], device) -> Draft:
        """The draft of the nodes `keep` (ascending, closed under parents), renumbered from 0."""
        index = {node: i for i, node in enumerate(keep)}
        parent_ids = [index[self.parent_ids[node]] if self.parent_ids[node] >= 0 else -1 for node in keep]
        return Draft.from_lists([self.token_ids[node] for node in keep], parent_ids, device)


class StaticTree:
    """A fixed tree shape given as Medusa-style paths of child ranks (Cai et al. 2024).

    `(0,)` is the draft model's most likely token after the committed text, `(1,)` its second most likely, `(0, 0)`
    the most likely token after `(0,)`, and so on; every prefix of a path must be a path. Example, 6 nodes:
    `StaticTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])`.

    Args:
        paths (`Sequence[tuple[int, ...]]`): the paths, in any order.

    Raises:
        `ValueError`: for a malformed tree (see `tree_from_paths`).
    """

    def __init__(self, paths: Sequence[Sequence[int]]):
        self.parent_ids, self.ranks = tree_from_paths(paths)
        self.paths = [tuple(path) for path in paths]
        self.depth = max(len(path) for path in self.paths)
        self._depths = sorted(len(path) - 1 for path in self.paths)  # node order is breadth first
        self._has_children = {parent for parent in self.parent_ids if parent >= 0}

    def expand(self, nodes: DraftNodes, frontier: list[int], log_probs: torch.FloatTensor, depth: int) -> list[int]:
        """Adds the tree's nodes at `depth`, the children of the `frontier` nodes whose rows are `log_probs`."""
        new = [node for node in range(len(self.parent_ids)) if self._depths[node] == depth]
        top_log_probs, top_tokens = (x.tolist() for x in log_probs.topk(max(self.ranks[n] for n in new) + 1, dim=-1))
        for node in new:
            row, rank = frontier.index(self.parent_ids[node]), self.ranks[node]
            nodes.add(self.parent_ids[node], top_tokens[row][rank], top_log_probs[row][rank])
        return new

    def next_frontier(self, nodes: DraftNodes, new: list[int]) -> list[int]:
        """The new nodes that have children in the tree."""
        return [node for node in new if node in self._has_children]

    def select(self, nodes: DraftNodes) -> list[int]:
        """Every node drafted."""
        return list(range(len(nodes.token_ids)))

    def __repr__(self) -> str:
        return f"StaticTree({self.paths})"


class DynamicTree:
    """A tree grown where the draft model is confident (EAGLE-2, Li et al. 2024, Section 4).

    Expansion: at each depth the `top_k` nodes of highest cumulative draft probability (the product of the draft
    probabilities on their path) are expanded with their `top_k` most likely tokens. Reranking: of all nodes
    drafted, the `num_nodes` of highest cumulative probability form the draft; a node's probability is never above
    its parent's, so the selection is a tree.

    Args:
        depth (`int`, defaults to 5): the longest path, >= 1.
        top_k (`int`, defaults to 4): nodes expanded per depth and children per expanded node, >= 1.
        num_nodes (`int`, defaults to 24): the node budget, >= 1.

    Raises:
        `ValueError`: for a value that is not an integer >= 1.
    """

    def __init__(self, depth: int = 5, top_k: int = 4, num_nodes: int = 24):
        for name, value in (("depth", depth), ("top_k", top_k), ("num_nodes", num_nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DynamicTree {name} must be an integer >= 1, got {value!r}.")
        self.depth, self.top_k, self.num_nodes = depth, top_k, num_nodes

    def expand(self, nodes: DraftNodes, frontier: list[int], log_probs: torch.FloatTensor, depth: int) -> list[int]:
        """Adds the `top_k` most likely children of every `frontier` node (rows of `log_probs`)."""
        top_log_probs, top_tokens = (x.tolist() for x in log_probs.topk(self.top_k, dim=-1))
        return [nodes.add(parent, token, log_prob) for parent, tokens, row in zip(frontier, top_tokens, top_log_probs)
                for token, log_prob in zip(tokens, row)]

    def next_frontier(self, nodes: DraftNodes, new: list[int]) -> list[int]:
        """The `top_k` new nodes of highest cumulative probability."""
        return sorted(sorted(new, key=lambda node: -nodes.log_probs[node])[: self.top_k])

    def select(self, nodes: DraftNodes) -> list[int]:
        """The `num_nodes` nodes of highest cumulative probability (ties: the earlier node), in node order."""
        ranked = sorted(range(len(nodes.token_ids)), key=lambda node: -nodes.log_probs[node])
        return sorted(ranked[: self.num_nodes])

    def __repr__(self) -> str:
        return f"DynamicTree(depth={self.depth}, top_k={self.top_k}, num_nodes={self.num_nodes})"


DYNAMIC_TREE_KEYS = ("depth", "top_k", "num_nodes")


def tree_shape(tree) -> "StaticTree | DynamicTree":
    """The tree shape `tree` describes.

    Args:
        tree: a `StaticTree` or `DynamicTree` (returned as is), a list of paths (a `StaticTree`), a mapping as
            written in a preset's `tree:` field (`{"paths": [...]}`: static; some of `{"depth", "top_k",
            "num_nodes"}`: dynamic), or `None` (`DynamicTree()`).

    Raises:
        `ValueError`: a malformed tree or a mapping with other keys.
    """
    if tree is None:
        return DynamicTree()
    if isinstance(tree, (StaticTree, DynamicTree)):
        return tree
    if not isinstance(tree, Mapping):
        return StaticTree(tree)
    if set(tree) == {"paths"}:
        return StaticTree(tree["paths"])
    if not set(tree) <= set(DYNAMIC_TREE_KEYS):
        raise ValueError(
            f"A tree mapping holds 'paths' (a static tree) or some of {DYNAMIC_TREE_KEYS} (a dynamic tree), "
            f"got keys {sorted(tree)}."
        )
    return DynamicTree(**tree)


def grow_trees(shape: "StaticTree | DynamicTree", input_ids: Sequence[torch.LongTensor], logits_processor,
               root_logits: torch.FloatTensor, max_tokens: Sequence[int], forward) -> list[Draft]:
    """Drafts one token tree per row, depth by depth and in step: the expansion loop of every tree drafter.

    At each depth every row's frontier gets its children from its processed draft scores (`shape.expand`); the
    rows' next frontiers are then fed in ONE draft forward, each node attending to its row's committed prefix, its
    fed ancestors and itself (SpecInfer, Miao et al. 2024), so a tree of depth d costs d - 1 forwards after the
    root's, for any number of rows.

    Args:
        shape (`StaticTree` or `DynamicTree`): the trees' shape.
        input_ids (`Sequence[torch.LongTensor]`): each row's committed tokens, `(1, sequence_length_i)`.
        logits_processor (`LogitsProcessorList`): the call's processors and warpers, applied to each node's row.
        root_logits (`torch.FloatTensor` of shape `(num_rows, vocab_size)`): each row's draft logits after its
            committed tokens.
        max_tokens (`Sequence[int]`): each row's deepest path allowed (0: the row drafts nothing).
        forward (`Callable[[list[tuple[DraftNodes, list[int], TokenTree] | None]], list[torch.FloatTensor | None]]`):
            runs the draft over every row's next frontier: entry i is `None` for a row that feeds nothing, else
            `(nodes, frontier, fed_tree)`, the row's nodes so far, the nodes to feed and the tree of every node fed
            so far this step (the frontier its last nodes); returns each fed row's logits `(len(frontier),
            vocab_size)` (anything for the others).

    Returns:
        `list[Draft]`: each row's tree, the nodes `shape.select` keeps of every node drafted, on its row's device.
    """
    num_rows = len(input_ids)
    nodes, fed = [DraftNodes() for _ in range(num_rows)], [[] for _ in range(num_rows)]
    frontiers, logits = [[-1] for _ in range(num_rows)], list(root_logits.split(1))
    num_depths = [min(shape.depth, budget) for budget in max_tokens]
    growing = [row for row in range(num_rows) if num_depths[row] > 0]
    for depth in range(max(num_depths, default=0)):
        # children of every growing row's frontier nodes, from their processed draft scores (one pass for all rows)
        prefixes = (prefix for row in growing for prefix in nodes[row].prefixes(input_ids[row], frontiers[row]))
        scores = process_logits(logits_processor, prefixes, torch.cat([logits[row] for row in growing]))
        log_probs = torch.log_softmax(scores, dim=-1).split([len(frontiers[row]) for row in growing])
        feeds = [None] * num_rows
        for row, row_log_probs in zip(growing, log_probs):
            new = shape.expand(nodes[row], frontiers[row], row_log_probs, depth)
            frontiers[row] = shape.next_frontier(nodes[row], new)
            if depth + 1 == num_depths[row] or not frontiers[row]:
                continue
            fed[row] += frontiers[row]
            fed_parents = [fed[row].index(nodes[row].parent_ids[node]) if nodes[row].parent_ids[node] >= 0 else -1
                           for node in fed[row]]
            feeds[row] = (nodes[row], frontiers[row],
                          TokenTree(torch.tensor(fed_parents, dtype=torch.long, device=input_ids[row].device)))
        growing = [row for row in growing if feeds[row] is not None]
        if not growing:
            break
        # one draft forward over every row's next frontier, each node attending to its fed ancestors
        fed_logits = forward(feeds)
        for row in growing:
            logits[row] = fed_logits[row]
    return [row_nodes.draft(shape.select(row_nodes), ids.device) for row_nodes, ids in zip(nodes, input_ids)]


def position_trees(shape: "StaticTree | DynamicTree", input_ids: Sequence[torch.LongTensor], logits_processor,
                   position_logits: Sequence[torch.FloatTensor], max_tokens: Sequence[int]) -> list[Draft]:
    """Token trees from per-position draft logits: a node at depth d takes its children from the logits of depth d
    whatever its parent (a block drafter's or a multi-token-prediction drafter's top-k per position, as Medusa's
    heads give them), so growing the tree costs no draft forward.

    Args:
        shape (`StaticTree` or `DynamicTree`): the trees' shape.
        input_ids (`Sequence[torch.LongTensor]`): each row's committed tokens, `(1, sequence_length_i)`.
        logits_processor (`LogitsProcessorList`): the call's processors and warpers, applied to each node's row.
        position_logits (`Sequence[torch.FloatTensor]`): each row's draft logits `(num_positions_i, vocab_size)`
            of the tokens after its committed ones (row 0 is the first draft token's).
        max_tokens (`Sequence[int]`): each row's deepest path allowed (0: an empty draft); at most
            `num_positions_i` is used.

    Returns:
        `list[Draft]`: each row's deterministic tree (`draft_probs=None`).
    """
    depth = 0
    budgets = [min(budget, len(logits)) for budget, logits in zip(max_tokens, position_logits)]
    vocab_size = max(logits.shape[-1] for logits in position_logits)

    def forward(feeds: list) -> list:
        nonlocal depth
        depth += 1
        return [None if feed is None else position_logits[i][depth].expand(len(feed[1]), -1)
                for i, feed in enumerate(feeds)]

    root_logits = torch.stack([logits[0] if len(logits) else logits.new_zeros(vocab_size)
                               for logits in position_logits])
    return grow_trees(shape, input_ids, logits_processor, root_logits, budgets, forward)


# the `method_config` keywords (and flags) of a dynamic tree's shape, for the named methods that draft trees
TREE_SETTINGS = (
    Setting("tree_top_k", low=1, help="draft-model-tree: nodes expanded per depth and children per node (default 4)"),
    Setting("tree_nodes", low=1, help="draft-model-tree: node budget (default 24)"),
)
