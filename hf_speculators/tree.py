"""Token trees: the structure of a draft given by parent ids, its attention mask, position ids and paths.

A draft of `num_nodes` tokens is a tree rooted at the last committed token: node i is a child of node
`parent_ids[i]`, or of the root when `parent_ids[i] == -1`. Nodes are in topological order (every parent before
its children), so one target forward can score all of them with a tree attention mask (SpecInfer, Miao et al.
2024; Medusa, Cai et al. 2024). A chain is the tree with `parent_ids == arange(-1, num_nodes - 1)`.
"""

from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property

import torch


class TokenTree:
    """The shape of a draft: parents, depths, ancestors, attention mask, position ids and paths.

    Args:
        parent_ids (`torch.LongTensor` of shape `(num_nodes,)`):
            Index of each node's parent, -1 for a child of the last committed token; every parent comes before
            its children (`-1 <= parent_ids[i] < i`).

    Raises:
        `ValueError`: if `parent_ids` is not 1D or a node's parent is not an earlier node or -1.
    """

    def __init__(self, parent_ids: torch.LongTensor):
        if parent_ids.ndim != 1:
            raise ValueError(f"parent_ids must be 1D (num_nodes,), got shape {tuple(parent_ids.shape)}.")
        self.parent_ids = parent_ids
        self.parents: list[int] = parent_ids.tolist()  # checked in Python: cheaper than tensor ops for small trees
        self.num_nodes = len(self.parents)
        self.is_chain = self.parents == list(range(-1, self.num_nodes - 1))
        if not self.is_chain and not all(-1 <= parent < node for node, parent in enumerate(self.parents)):
            raise ValueError(
                f"Malformed token tree: parent_ids={self.parents}. Each node's parent must be an earlier node "
                "(parent_ids[i] < i) or -1 (the last committed token)."
            )

    @classmethod
    def chain(cls, num_nodes: int, device: torch.device | str = "cpu") -> "TokenTree":
        """The chain of `num_nodes` nodes (`num_nodes == 0`: no draft, as in a prefill)."""
        return cls(torch.arange(-1, num_nodes - 1, device=device))

    @cached_property
    def ancestors(self) -> torch.BoolTensor:
        """`torch.BoolTensor` of shape `(num_nodes, num_nodes)`: `[i, j]` is True when node j is on the path to node i
        (node i included)."""
        n, device = self.num_nodes, self.parent_ids.device
        if self.is_chain:
            return torch.ones(n, n, dtype=torch.bool, device=device).tril()
        rows = []  # built in Python and converted once: one tensor op per node would cost more for small trees
        for node, parent in enumerate(self.parents):
            row = list(rows[parent]) if parent >= 0 else [False] * n
            row[node] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool).reshape(n, n).to(device)

    @cached_property
    def _depths(self) -> list[int]:
        depths = []
        for parent in self.parents:
            depths.append(depths[parent] + 1 if parent >= 0 else 0)
        return depths

    @cached_property
    def depths(self) -> torch.LongTensor:
        """`torch.LongTensor` of shape `(num_nodes,)`: 0 for a child of the last committed token, 1 for its children."""
        return torch.tensor(self._depths, dtype=torch.long, device=self.parent_ids.device)

    @cached_property
    def depth(self) -> int:
        """Tokens on the longest root-to-leaf path (0 for an empty tree)."""
        return max(self._depths, default=-1) + 1

    def children(self, node: int) -> list[int]:
        """The children of `node` (-1: of the last committed token), in node order."""
        return self._children[node + 1]

    @cached_property
    def _children(self) -> list[list[int]]:
        children = [[] for _ in range(self.num_nodes + 1)]
        for child, parent in enumerate(self.parents):
            children[parent + 1].append(child)
        return children

    def path(self, node: int) -> torch.LongTensor:
        """The nodes from the root's child down to `node` (included); empty for `node == -1`."""
        if node < 0:
            return self.parent_ids.new_empty(0)
        return self.ancestors[node].nonzero()[:, 0]  # ancestors come before descendants: ascending is root to leaf

    def leftmost_path(self) -> torch.LongTensor:
        """The path that takes the first child at every node (for a chain: all nodes)."""
        nodes, node = [], -1
        while self.children(node):
            node = self.children(node)[0]
            nodes.append(node)
        return torch.tensor(nodes, dtype=torch.long, device=self.parent_ids.device)

    def longest_path(self, node_accepted: torch.BoolTensor) -> torch.LongTensor:
        """The deepest path on which every node is accepted (the first such path in node order on a tie).

        Args:
            node_accepted (`torch.BoolTensor` of shape `(num_nodes,)`): the verdict on each node on its own.

        Returns:
            `torch.LongTensor` of shape `(num_accepted,)`: the nodes of the path, root to leaf (empty if no child of
            the root is accepted).
        """
        if self.is_chain:  # the accepted prefix, with one sync
            return torch.arange(int(node_accepted.long().cumprod(0).sum()), device=self.parent_ids.device)
        path_accepted = ~(self.ancestors & ~node_accepted[None]).any(-1)  # [num_nodes]
        if not bool(path_accepted.any()):
            return self.parent_ids.new_empty(0)
        depths = torch.where(path_accepted, self.depths, -1)
        return self.path(int(depths.argmax()))

    def prefixes(self, input_ids: torch.LongTensor, token_ids: torch.LongTensor, nodes: Iterable[int]) -> Iterator:
        """For each node in `nodes` (-1: the root), `input_ids` `(1, length)` followed by the tokens on its path.

        These are the sequences whose next token the rows of a tree forward predict, for logits processors.
        """
        for node in nodes:
            yield torch.cat([input_ids, token_ids[self.path(node)][None].to(input_ids.device)], dim=-1)

    def position_ids(self, num_prefix: int, num_query: int) -> torch.LongTensor:
        """Position ids `(1, num_query)` of the last `num_query` tokens of the prefix followed by the tree.

        The sequence is `num_prefix` tokens (positions `0 .. num_prefix - 1`) then the nodes, each at position
        `num_prefix + depth`. The query is its last `num_query` entries: pending tokens and nodes not yet in a cache.
        """
        positions = torch.arange(num_prefix + self.num_nodes - num_query, num_prefix + self.num_nodes,
                                 device=self.parent_ids.device)
        num_node_queries = min(num_query, self.num_nodes)
        if num_node_queries and not self.is_chain:  # a chain's nodes are at consecutive positions already
            positions[-num_node_queries:] = num_prefix + self.depths[self.num_nodes - num_node_queries :]
        return positions[None]

    def attention_mask(self, num_prefix: int, num_query: int, dtype: torch.dtype) -> torch.FloatTensor:
        """The 4D additive attention mask of the last `num_query` tokens of the prefix followed by the tree.

        Prefix tokens attend causally; a node attends every prefix token, its ancestors and itself. The mask is
        float (0 where attention is allowed, the dtype's minimum elsewhere): transformers adds a bool 4D mask as
        0/1 under eager attention, which gives wrong logits.

        Args:
            num_prefix (`int`): committed tokens before the tree (in the cache or pending in the query).
            num_query (`int`): tokens fed in this forward, the last ones of prefix + tree.
            dtype (`torch.dtype`): the model's dtype.

        Returns:
            `torch.FloatTensor` of shape `(1, 1, num_query, num_prefix + num_nodes)`.
        """
        kv_length = num_prefix + self.num_nodes
        device = self.parent_ids.device
        query = torch.arange(kv_length - num_query, kv_length, device=device)
        allowed = torch.arange(kv_length, device=device)[None] <= query[:, None]  # causal, [num_query, kv_length]
        num_node_queries = min(num_query, self.num_nodes)
        if num_node_queries:
            allowed[-num_node_queries:, num_prefix:] = self.ancestors[self.num_nodes - num_node_queries :]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
        return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


def tree_from_paths(paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Parses a static tree given as Medusa-style paths of child ranks (Cai et al. 2024).

    Each path lists, from the root down, which candidate to take at every depth: `(0,)` is the most likely
    child of the last committed token, `(0, 1)` the second most likely child of that node. Every prefix of a
    path must be a path too. Nodes come out breadth first (by depth, then by ranks).

    Args:
        paths (`Sequence[Sequence[int]]`): e.g. `[(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]`.

    Returns:
        `(parent_ids, ranks)`: two lists of length `len(paths)`, each node's parent (-1: the root) and rank.

    Raises:
        `ValueError`: an empty list, an empty or repeated path, a rank that is not an integer >= 0, or a path
            whose parent path is missing.
    """
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence) or not paths:
        raise ValueError(f"A static tree needs a non-empty list of paths, e.g. [(0,), (0, 0)]; got {paths!r}.")
    normalized = []
    for path in paths:
        if not isinstance(path, (list, tuple)) or len(path) == 0 or not all(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path
        ):
            raise ValueError(
                f"Malformed tree path {path!r}: a path is a non-empty tuple of child ranks (integers >= 0)."
            )
        normalized.append(tuple(path))
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"Malformed tree: repeated paths in {list(paths)!r}.")
    ordered = sorted(normalized, key=lambda path: (len(path), path))
    index = {path: i for i, path in enumerate(ordered)}
    missing = [path for path in ordered if len(path) > 1 and path[:-1] not in index]
    if missing:
        raise ValueError(f"Malformed tree: the parent of path {missing[0]} ({missing[0][:-1]}) is not a path.")
    parent_ids = [index[path[:-1]] if len(path) > 1 else -1 for path in ordered]
    return parent_ids, [path[-1] for path in ordered]


def trie_from_sequences(sequences: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Merges token sequences into one trie: sequences that share a prefix share its nodes.

    Nodes come in the order they are first met, so the first sequence is nodes `0 .. len - 1`, a chain.

    Args:
        sequences (`Sequence[Sequence[int]]`): token continuations of the committed text.

    Returns:
        `(token_ids, parent_ids)`: two lists with one entry per node.
    """
    token_ids, parent_ids, node_of = [], [], {}  # node_of: (parent, token) -> node
    for sequence in sequences:
        parent = -1
        for token in sequence:
            if (parent, token) not in node_of:
                node_of[parent, token] = len(token_ids)
                token_ids.append(token)
                parent_ids.append(parent)
            parent = node_of[parent, token]
    return token_ids, parent_ids
