"""Target hidden states recorded inside the target's own forwards, for drafters that draft from them (EAGLE, Medusa).

Learned draft heads read the target's hidden states: EAGLE-3 the inputs of three decoder layers, EAGLE-1/2 and
Medusa the output of the final norm. `TargetFeatures` records them with forward hooks during the prefill and the
verification forwards the speculative loop runs anyway (no second forward, no `output_hidden_states=True`), and
keeps only the rows of tokens that were committed: the pending tokens and the accepted path of the draft.
"""

from collections.abc import Callable, Sequence

import torch

from .layers import DecoderLayers
from .tree import TokenTree


def _layer_input(captured: dict, slot: int):
    """A forward pre-hook that keeps the hidden states entering a decoder layer as `captured[slot]`."""

    def hook(module, args, kwargs):
        captured[slot] = args[0] if args else kwargs["hidden_states"]

    return hook


def _module_output(captured: dict, slot: int):
    """A forward hook that keeps a module's output as `captured[slot]`."""

    def hook(module, args, output):
        captured[slot] = output

    return hook


def accepted_path(tree: TokenTree, node_ids: torch.LongTensor, new_ids: Sequence[int]) -> list[int]:
    """The draft nodes whose tokens were committed: the path from the root that follows `new_ids`.

    The verifier keeps a root-to-leaf path of the draft and then adds one token that is not a child on that path
    (a bonus token after a leaf, or a recovered token that differs from every rejected child), so following the
    committed tokens down the tree finds exactly the accepted nodes. Siblings carry distinct tokens.

    Args:
        tree (`TokenTree`): the draft's shape.
        node_ids (`torch.LongTensor` of shape `(num_nodes,)`): the draft tokens.
        new_ids (`Sequence[int]`): the tokens committed after the draft's root, in order.

    Returns:
        `list[int]`: the accepted nodes, root to leaf.
    """
    tokens, path, node = node_ids.tolist(), [], -1
    for token in new_ids:
        node = next((child for child in tree.children(node) if tokens[child] == token), None)
        if node is None:
            break
        path.append(node)
    return path


class TargetFeatures:
    """Records the target's hidden states during its forwards and keeps the rows of committed tokens.

    Each row is the concatenation, in this order, of the hidden states entering each decoder layer of `layer_ids`
    (the residual stream before layer i, which is transformers' `hidden_states[i]` and vLLM's auxiliary hidden
    state i; EAGLE-3, Li et al. 2025) and, with `final_norm`, the output of the final norm (transformers'
    `last_hidden_state`; EAGLE-1/2, Li et al. 2024, and Medusa, Cai et al. 2024).

    Use: `record(forward, input_ids, tree, num_prefix)` around each target forward; then, once the step's tokens
    are committed, `commit(committed_ids)` returns the rows of the newly committed tokens and their position.

    Args:
        model (`PreTrainedModel`): the target, a model type that `DecoderLayers` can run (Llama, Mistral, Qwen2,
            Qwen3, GPT-NeoX, GPT-2).
        layer_ids (`Sequence[int]`): decoder layers whose input is recorded, each in `[0, num_hidden_layers)`.
        final_norm (`bool`): whether to record the final norm's output.

    Raises:
        `ValueError`: nothing to record, a layer id out of range, or a model `DecoderLayers` cannot take.
    """

    def __init__(self, model, layer_ids: Sequence[int] = (), final_norm: bool = False):
        layers = DecoderLayers(model)
        if not layer_ids and not final_norm:
            raise ValueError("TargetFeatures needs layer_ids, final_norm=True, or both: it would record nothing.")
        bad = [i for i in layer_ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers.num_layers]
        if bad:
            raise ValueError(
                f"Feature layer ids {bad} are outside this target's decoder layers 0..{layers.num_layers - 1}: the "
                "draft head was made for a deeper model, or its layer ids are wrong."
            )
        self._modules = [layers.layers[i] for i in layer_ids] + ([layers.final_norm] if final_norm else [])
        self._num_layer_inputs = len(layer_ids)
        self.reset()

    def reset(self) -> None:
        """Forgets everything recorded (at the start of a generate call)."""
        # batch row -> (rows [q, width], fed ids [q], tree, num_prefix) of each forward since the row's last commit
        self._fed: dict[int, list] = {}

    def _capture(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.FloatTensor]:
        """Runs `forward()` with hooks on the feature points; returns its result and the features `(batch, q, width)`
        of every fed slot."""
        captured: dict[int, torch.Tensor] = {}  # slot i: the feature point self._modules[i], in layer_ids order
        handles = [module.register_forward_pre_hook(_layer_input(captured, slot), with_kwargs=True)
                   for slot, module in enumerate(self._modules[: self._num_layer_inputs])]
        handles += [self._modules[-1].register_forward_hook(_module_output(captured, len(self._modules) - 1))
                    for _ in range(len(self._modules) - self._num_layer_inputs)]
        try:
            result = forward()
        finally:
            for handle in handles:
                handle.remove()
        return result, torch.cat([captured[slot] for slot in range(len(self._modules))], dim=-1)

    def record(self, forward: Callable[[], torch.Tensor], input_ids: torch.LongTensor, tree: TokenTree,
               num_prefix: int) -> torch.Tensor:
        """Runs `forward()` with hooks on the feature points and keeps the rows of its fed tokens; returns its result.

        Args:
            forward (`Callable[[], torch.Tensor]`): one target forward over `input_ids`.
            input_ids (`torch.LongTensor` of shape `(1, num_query)`): the fed tokens: the last `num_query -
                tree.num_nodes` committed tokens, then the draft's nodes.
            tree (`TokenTree`): the draft's shape (an empty chain in a prefill).
            num_prefix (`int`): committed tokens, cached or fed.
        """
        result, features = self._capture(forward)
        self._fed.setdefault(0, []).append((features[0, -input_ids.shape[1]:], input_ids[0], tree, num_prefix))
        return result

    def record_batch(self, forward: Callable[[], torch.Tensor], input_ids: torch.LongTensor,
                     new_valid: torch.BoolTensor, rows: Sequence[int], num_cached: torch.LongTensor) -> torch.Tensor:
        """`record` for a forward over a batch of rows (see `RaggedCache`); returns its result.

        Row i's fed tokens (the slots `new_valid[i]` marks) continue its `num_cached[i]` cached tokens; they are kept
        as a chain: its committed ones are found as those a chain draft's are (`commit(..., row=rows[i])`).

        Args:
            forward (`Callable[[], torch.Tensor]`): one target forward over `input_ids`.
            input_ids (`torch.LongTensor` of shape `(batch_size, num_query)`): each row's fed tokens, holes included.
            new_valid (`torch.BoolTensor` of shape `(batch_size, num_query)`): which slots hold a token.
            rows (`Sequence[int]`): each row's index in the generate call's batch.
            num_cached (`torch.LongTensor` of shape `(batch_size,)`): each row's committed tokens in the cache.
        """
        result, features = self._capture(forward)
        features = features[:, -input_ids.shape[1]:]
        for i, row in enumerate(rows):
            fed_ids = input_ids[i, new_valid[i].to(input_ids.device)]
            self._fed.setdefault(row, []).append((features[i, new_valid[i].to(features.device)], fed_ids,
                                                  TokenTree.chain(len(fed_ids), fed_ids.device), int(num_cached[i])))
        return result

    def commit(self, committed_ids: torch.LongTensor, row: int = 0) -> tuple[int, torch.FloatTensor | None]:
        """The rows of the tokens committed by the forwards recorded since the last call, and the first one's position.

        Each forward's committed tokens are its fed committed tokens and the draft nodes on the path that
        `committed_ids` follows (`accepted_path`); forwards of steps without a call in between (a step without a
        draft) are resolved in order.

        Args:
            committed_ids (`torch.LongTensor` of shape `(1, sequence_length)`): every committed token.
            row (`int`, defaults to 0): the sequence's row in the generate call's batch (`record_batch`).

        Returns:
            `(position, rows)`: `rows` of shape `(num_new, width)` are the features of the tokens at positions
            `position .. position + num_new - 1`; `(sequence_length - 1, None)` when nothing was recorded.
        """
        fed = self._fed.pop(row, None)
        if not fed:
            return committed_ids.shape[1] - 1, None
        kept = []
        for rows, fed_ids, tree, num_prefix in fed:
            num_pending = len(fed_ids) - tree.num_nodes
            path = accepted_path(tree, fed_ids[num_pending:], committed_ids[0, num_prefix:].tolist())
            kept.append(rows[list(range(num_pending)) + [num_pending + node for node in path]])
        rows, fed_ids, tree, num_prefix = fed[0]
        return num_prefix - (len(fed_ids) - tree.num_nodes), torch.cat(kept)

    def commit_batch(self, committed_ids: Sequence[torch.LongTensor],
                     rows: Sequence[int]) -> list[tuple[int, torch.FloatTensor | None]]:
        """`commit` for each sequence of a batch, `committed_ids[i]` `(1, sequence_length_i)` being row `rows[i]`;
        what other rows recorded (rows that finished) is forgotten."""
        committed = [self.commit(ids, row) for ids, row in zip(committed_ids, rows)]
        self._fed.clear()
        return committed
