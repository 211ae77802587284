"""Token-tree drafting with a draft model (`TreeDrafter`), in the shapes of `tree_growth`."""

from collections.abc import Mapping, Sequence

import torch

from ..cache import check_tree_support
from ..draft import Draft
from ..query import Query
from .draft_model import DraftModelDrafter, DraftModelState
from .tree_growth import DynamicTree, StaticTree, grow_trees, tree_shape
from .spec import DRAFT_MODEL, MethodSpec, Variant


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
        check_tree_support(state.draft_cache.cache, self.draft_model.config, state.generation_config.max_length)
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
        root_logits = self._feed(state, self._sync(state, self._in_draft_vocabulary(state, input_ids), rows), device)
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


TREE_SPEC = MethodSpec(
    "tree", TreeDrafter, required=("draft_model",), shared=("tree", "draft_revision", "draft_quantization"),
    loads="draft-model", checkpoint=DRAFT_MODEL, variants={"draft-model-tree": Variant(length="depth")},
    no_draft_tokens="set the tree's depth in tree (e.g. tree={'depth': 5}) or give its paths.",
)
