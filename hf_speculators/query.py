"""The query of one forward over a `RaggedCache`: every row's new tokens, where they sit and what each one sees."""

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache import RaggedCache, cache_argument
from .draft import Draft


def padded_width(num_query: int, widths: Sequence[int] | None) -> int:
    """The query width a step of `num_query` slots per row runs at: with `widths` (increasing: a compiled call's,
    `compiled.CompiledSteps.widths`), the smallest of them that holds it, past the last a multiple of the last;
    without, `num_query`."""
    if not widths:
        return num_query
    return next((width for width in widths if width >= num_query), -(-num_query // widths[-1]) * widths[-1])


@dataclass
class Query:
    """The new slots of one forward of every row of a batch, after the rows' cached tokens.

    Row i's slots hold, in order, its pending token, its draft's nodes (a chain or a token tree), the unverified
    tokens its drafter asked for (`Draft.extra_token_ids`), then holes up to the widest row. A slot's position is
    its row's cached tokens plus `offsets[i, j]` (a node at depth d: 1 + d). With `visible` set, slot j of row i
    attends to the cached tokens and the query slots `visible[i, j]` marks; without it, to every earlier query slot
    that holds a token (a chain). With `past_visible` set as well, slot j also sees the cache's last `num_past`
    slots that `past_visible[i, j]` marks, and only those of them: a token tree grown over several forwards (a
    draft model's depths), whose earlier depths are in the cache but visible only to their descendants.

    Args:
        input_ids (`torch.LongTensor` of shape `(batch_size, num_query)`): the tokens (any id in a hole).
        valid (`torch.BoolTensor` of shape `(batch_size, num_query)`, on the CPU): which slots hold a token.
        offsets (`torch.LongTensor` of shape `(batch_size, num_query)`, on the CPU): each slot's position after its
            row's cached tokens.
        visible (`torch.BoolTensor` of shape `(batch_size, num_query, num_query)`, *optional*, on the CPU): which
            query slots each slot attends to; `None` for chains.
        num_verified (`list[int]`): per row, the slots that are verified: the pending token and the draft's nodes.
        past_visible (`torch.BoolTensor` of shape `(batch_size, num_query, num_past)`, *optional*, on the CPU): which
            of the cache's last `num_past` slots each slot attends to (with `visible` only); `None`: as the cache's
            `valid` says.
    """

    input_ids: torch.LongTensor
    valid: torch.BoolTensor
    offsets: torch.LongTensor
    visible: torch.BoolTensor | None
    num_verified: list[int]
    past_visible: torch.BoolTensor | None = None

    @classmethod
    def chain(cls, input_ids: torch.LongTensor, valid: torch.BoolTensor) -> "Query":
        """A query of chains: row i's tokens are its slots that `valid` `(batch_size, num_query)` marks, in order
        (a prefill, or a draft model's forward)."""
        if bool(valid.all()):  # no holes: slot j is at offset j
            batch_size, num_query = valid.shape
            return cls(input_ids, valid, torch.arange(num_query).expand(batch_size, -1), None, [num_query] * batch_size)
        offsets = (valid.long().cumsum(dim=1) - 1).clamp_min(0)
        return cls(input_ids, valid, offsets, None, valid.sum(dim=1).tolist())

    @classmethod
    def from_drafts(cls, pending: torch.LongTensor, drafts: Sequence[Draft], pad_token_id: int,
                    widths: Sequence[int] | None = None) -> "Query":
        """The verification query of a step: each row's pending token `pending[i]` (shape `(batch_size,)`), its
        draft's nodes and unverified tokens, padded with `pad_token_id` to the widest row, and with `widths`
        (increasing) to the smallest of them that holds it, past the last to a multiple of the last (compiled
        steps run at a few widths: `k + 1` while drafts keep to the drafter's `k` tokens,
        `compiled.CompiledSteps.widths`)."""
        rows = [torch.cat([pending[i : i + 1], draft.token_ids.to(pending.device)]
                          + ([draft.extra_token_ids.to(pending.device)] if draft.num_extra else []))
                for i, draft in enumerate(drafts)]
        lengths = [len(row) for row in rows]
        num_query, batch_size = padded_width(max(lengths), widths), len(drafts)
        input_ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad_token_id)
        input_ids = torch.nn.functional.pad(input_ids, (0, num_query - input_ids.shape[1]), value=pad_token_id)
        valid = torch.arange(num_query) < torch.tensor(lengths)[:, None]
        num_verified = [1 + draft.num_nodes for draft in drafts]
        if not any(not draft.is_chain or draft.num_extra for draft in drafts):  # chains: slot j at offset j
            return cls(input_ids, valid, torch.arange(num_query).expand(batch_size, -1), None, num_verified)
        offsets = torch.zeros(batch_size, num_query, dtype=torch.long)
        visible = torch.zeros(batch_size, num_query, num_query, dtype=torch.bool)
        visible[:, :, 0] = True  # every slot sees the pending token
        for i, draft in enumerate(drafts):
            n = draft.num_nodes
            offsets[i, 1 : 1 + n] = draft.tree.depths.cpu() + 1
            visible[i, 1 : 1 + n, 1 : 1 + n] = draft.tree.ancestors.cpu()
            if draft.num_extra:
                extra = slice(1 + n, lengths[i])
                offsets[i, extra] = draft.extra_offsets.cpu()
                visible[i, extra, : lengths[i]] = draft.extra_visible.cpu()
        return cls(input_ids, valid, offsets, visible & valid[:, None, :], num_verified)


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def forward(model, cache: RaggedCache, query: Query, num_logits: int | None = None, call=None) -> torch.FloatTensor:
    """Runs the causal LM `model` over `query` after `cache` (whose rows are the query's rows) and returns logits.

    Every row sees its own tokens at its own positions (`RaggedCache.query_inputs`): one row with a chain runs with
    the model's own causal mask, chains of several rows with a 2D padding mask, token trees and unverified tokens
    with a 4D float additive mask. The caller then says which new slots each row keeps (`RaggedCache.append`).

    Args:
        model (`PreTrainedModel`): a causal LM.
        cache (`RaggedCache`): its cache.
        query (`Query`): the new slots.
        num_logits (`int`, *optional*): how many slots' logits to compute, from the end (default: all).
        call (`Callable`, *optional*): what runs the model (a compiled `model.__call__`); default: `model` itself.

    Returns:
        `torch.FloatTensor` of shape `(batch_size, num_logits or num_query, vocab_size)`.
    """
    return cache.from_batch(model_outputs(model, cache, query, num_logits, call).logits)


def model_outputs(model, cache: RaggedCache, query: Query, num_logits: int | None = None, call=None, **kwargs):
    """`forward`'s model output, every tensor over the cache's batch rows (`RaggedCache.to_batch`: with `fixed_rows`,
    rows that left included; `RaggedCache.from_batch` keeps the live ones); `kwargs` go to the model (e.g.
    `output_hidden_states=True`)."""
    input_ids = query.input_ids
    cache.reserve(input_ids.shape[1])
    attention_mask, position_ids = cache.query_inputs(query, model.dtype)
    extra = {"logits_to_keep": num_logits or input_ids.shape[1]} if _takes_logits_to_keep(type(model)) else {}
    if attention_mask is not None:  # rows that left a `fixed_rows` cache see every slot (a 2D mask's 1, a 4D mask's 0)
        attention_mask = cache.to_batch(attention_mask.to(input_ids.device), int(not attention_mask.is_floating_point()))
    return (call or model)(
        input_ids=cache.to_batch(input_ids, 0), use_cache=True, **{cache_argument(model): cache.cache},
        attention_mask=attention_mask, position_ids=cache.to_batch(position_ids.to(input_ids.device), 0), **extra,
        **kwargs,
    )


def greedy_chain(model, cache: RaggedCache, query: Query, num_steps: int, call, vocab_size: int) -> torch.LongTensor:
    """A greedy draft chain of `1 + num_steps` tokens per row in one call of `call`
    (`compiled.run_draft_model_chain`, compiled): a forward over `query` after `cache`, then `num_steps` forwards of
    one token per row, each row's argmax fed back; the cache then keeps the query's tokens and the fed ones.

    The masks and positions of every forward are built here, before the call (a chain's do not depend on its tokens:
    each step's token takes the next slot and position), so the call holds no host work between its forwards.

    Args:
        model (`PreTrainedModel`): the draft model, over a static cache.
        cache (`RaggedCache`): its cache (static: its masks are 2D over the cache's slots).
        query (`Query`): a chain query whose last slot holds a token in every row.
        num_steps (`int`): the one-token forwards after the query's.
        call (`Callable`): runs `compiled.run_draft_model_chain` on `model`.
        vocab_size (`int`): the target's logits width (the argmax reads no draft logit past it).

    Returns:
        `torch.LongTensor` of shape `(batch_size, 1 + num_steps)`: the draft tokens.
    """
    width = query.input_ids.shape[1]
    cache.reserve(width + num_steps)
    mask, position_ids = cache.query_inputs(query, model.dtype)  # [batch_size, num_keys]: static, so 2D
    first, slots = cache.num_slots + width, torch.arange(mask.shape[1])
    later = (slots >= first) & (slots < first + torch.arange(1 + num_steps)[:, None])  # step j sees j more slots
    masks = (mask[:, None, :].bool() | later).long()  # [batch_size, 1 + num_steps, num_keys]
    step_positions = position_ids[:, -1:] + torch.arange(1, 1 + num_steps)
    device = query.input_ids.device
    extra = {"logits_to_keep": 1} if _takes_logits_to_keep(type(model)) else {}
    tokens = call(cache.to_batch(query.input_ids, 0), cache.to_batch(masks.to(device), 1),
                  cache.to_batch(position_ids.to(device), 0), cache.to_batch(step_positions.to(device), 0), vocab_size,
                  use_cache=True, **{cache_argument(model): cache.cache}, **extra)
    cache.append(query.valid)
    cache.append(torch.ones(len(query.valid), num_steps, dtype=torch.bool))
    return cache.from_batch(tokens)
