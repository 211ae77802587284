"""Token-tree drafting with a draft model: a static tree of child ranks (Medusa) or a dynamic tree (EAGLE-2)."""

from collections.abc import Mapping, Sequence

import torch

from ..cache import check_tree_support
from ..draft import Draft
from ..query import Query
from ..sampling import process_logits
from ..tree import TokenTree, tree_from_paths
from .draft_model import DraftModelDrafter, DraftModelState


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


class TreeDrafter(DraftModelDrafter):
    """Drafts a token tree with a smaller causal LM: several candidates per depth, checked in one target forward.

    The tree is a `StaticTree` (Medusa-style paths of child ranks, Cai et al. 2024) or a `DynamicTree` (EAGLE-2,
    Li et al. 2024). Each depth costs one draft forward over the nodes expanded at that depth, scored with a tree
    attention mask (SpecInfer, Miao et al. 2024), so a tree of depth d costs d draft forwards, as a chain of d
    tokens does. The draft cache is handled as by `DraftModelDrafter`: it keeps the committed tokens across steps;
    the tree's nodes are dropped from it after each draft.

    For a batch every row grows its own tree (`grow_trees`), and each depth is one draft forward over every row's
    frontier: a node sees its row's committed tokens and, of the nodes fed at earlier depths (in the draft cache),
    its ancestors only (`Query.past_visible`). Rows' trees may differ in shape; the target scores them in one
    forward as well.

    Children are the draft model's most likely tokens after the call's logits processors and warpers, so the draft
    is deterministic (`draft_probs=None`): under sampling, rejection verification treats each node as one-hot
    (EAGLE's scheme), which is lossless.

    Args:
        draft_model (`PreTrainedModel`): a causal LM with the target's vocabulary and full-attention layers, on the
            target's device.
        tree (`StaticTree`, `DynamicTree`, a list of paths or a mapping, defaults to `DynamicTree()`): the tree's
            shape (see `tree_shape`); a list of paths is a `StaticTree`.
        draft_tokenizer (`PreTrainedTokenizerBase`, *optional*): as for `DraftModelDrafter`.

    Raises:
        `ValueError`: for a malformed tree; at the start of generation, for a draft model of another vocabulary or
            with sliding-window or linear-attention layers.
    """

    name = "tree"
    drafts_trees = True

    def __init__(self, draft_model, tree: "StaticTree | DynamicTree | Sequence | Mapping | None" = None,
                 draft_tokenizer=None):
        self.tree = tree_shape(tree)
        super().__init__(draft_model, num_draft_tokens=self.tree.depth, draft_tokenizer=draft_tokenizer)

    def start(self, state: DraftModelState) -> None:
        """As `DraftModelDrafter.start`; also checks that the draft cache can hold trees and the tree's ranks.

        Raises:
            `ValueError`: as `DraftModelDrafter.start`; a draft model of another tokenizer (token trees are drafted in
                the target's vocabulary); a draft model with sliding-window or linear-attention layers; a static
                tree asking for a child rank beyond the vocabulary.
        """
        super().start(state)
        if state.bridge is not None:
            raise ValueError("The draft model's tokenizer differs from the target's, and token trees are drafted in "
                             "the target's vocabulary: use DraftModelDrafter (chains) for a draft of another tokenizer.")
        check_tree_support(state.draft_cache.cache)
        if isinstance(self.tree, StaticTree) and max(self.tree.ranks) >= state.vocab_size:
            raise ValueError(
                f"The tree asks for child rank {max(self.tree.ranks)} of a {state.vocab_size}-token vocabulary."
            )

    @torch.no_grad()
    def propose(self, state: DraftModelState, input_ids, max_tokens, rows) -> list[Draft]:
        """Each row's token tree, at most `max_tokens[i]` deep: one batched draft forward per depth over every
        row's frontier (see `Drafter.propose` for the arguments)."""
        device = input_ids[0].device
        # 1. each row's cache rolled back to the committed tokens it holds; the rest fed: the roots' logits
        root_logits = self._feed(state, self._in_draft_vocabulary(state, input_ids), rows, device)
        cache = state.draft_cache
        committed = cache.lengths
        # per row, the node each slot fed during this step holds (None: a hole); the same number for every row
        slots = [[] for _ in input_ids]

        def forward(feeds: list) -> list:
            growing = [i for i, feed in enumerate(feeds) if feed is not None]
            trees, frontiers = [feeds[i][0] for i in growing], [feeds[i][1] for i in growing]
            width, num_past = max(map(len, frontiers)), len(slots[0])
            # per row and slot: [token, offset, valid, then what it sees of the fed nodes' slots and of this query's]
            table = [[[0, 0, False] + [False] * (num_past + width) for _ in range(width)] for _ in slots]
            for i, nodes, frontier in zip(growing, trees, frontiers):
                fed = {node: slot for slot, node in enumerate(slots[i]) if node is not None}
                for j, node in enumerate(frontier):
                    entry, parent, depth = table[i][j], nodes.parent_ids[node], 0
                    entry[0], entry[2], entry[3 + num_past + j] = nodes.token_ids[node], True, True
                    while parent >= 0:  # each node sees its ancestors' slots, fed at earlier depths
                        entry[3 + fed[parent]] = True
                        parent, depth = nodes.parent_ids[parent], depth + 1
                    entry[1] = depth - len(fed)  # its position: the cache counts the fed nodes as the row's tokens
            table = torch.tensor(table, dtype=torch.long).view(len(slots), width, 3 + num_past + width)
            valid, seen = table[..., 2].bool(), table[..., 3:].bool()
            query = Query(table[..., 0].to(state.draft_device), valid, table[..., 1], seen[..., num_past:],
                          valid.sum(dim=1).tolist(), past_visible=seen[..., :num_past])
            logits = self._logits(state, query, None, device)  # [rows, width, vocab]
            for row_slots in slots:
                row_slots.extend([None] * width)
            for i, frontier in zip(growing, frontiers):
                slots[i][num_past : num_past + len(frontier)] = frontier
            fed_logits = [None] * len(feeds)
            for i, frontier in zip(growing, frontiers):
                fed_logits[i] = logits[i, : len(frontier)]
            return fed_logits

        # 2. expand depth by depth, one draft forward per depth for all rows; no compaction while slots are tracked
        max_holes, cache.max_holes = cache.max_holes, float("inf")
        try:
            return grow_trees(self.tree, input_ids, state.logits_processor, root_logits, max_tokens, forward)
        finally:
            # 3. drop the nodes from the draft cache: it holds the committed tokens, as after DraftModelDrafter's feed
            cache.max_holes = max_holes
            cache.truncate(committed)

    def __repr__(self) -> str:
        return f"TreeDrafter({type(self.draft_model).__name__}, tree={self.tree!r})"
