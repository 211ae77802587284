"""The only module that touches transformers `Cache` objects (with `static_cache`, its static-layer operations): the
argument that carries one, checks, rollback, truncation and tree compaction."""

import functools
import inspect

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticLayer

from .growing_cache import GrowingLayer, use_growing_layers
from .static_cache import (ensure_room, is_static, prepare_static_cache, reset_length, select_rows, static_length,
                           store_slots)

DEFAULT_MAX_HOLES = 32  # RaggedCache: hole slots the widest row may carry before compaction (examples/batch_compaction.py)

def slots_per_row(max_length: int, num_draft_tokens: int, batch_size: int) -> int:
    """The most slots a row of a call may hold in a step (a static cache's size): `max_length`, a draft and, in a
    batch, the masked holes a `RaggedCache` carries before compaction."""
    return max_length + num_draft_tokens + (DEFAULT_MAX_HOLES if batch_size > 1 else 0)


FULL_ATTENTION_LAYERS = (DynamicLayer, GrowingLayer)  # the dynamic layers that hold every token (`type(layer) in`)

# the names a forward may take its cache under: `cache` from transformers 5.24 on, `past_key_values` before (and
# still accepted, with a deprecation warning, until 5.40), `layer_past` in some families' decoder layers (GPT-NeoX)
CACHE_ARGUMENT_NAMES = ("cache", "past_key_values", "layer_past")


@functools.cache
def _cache_argument_of(forward) -> str | None:
    parameters = inspect.signature(forward).parameters  # follows functools.wraps to the undecorated signature
    return next((name for name in CACHE_ARGUMENT_NAMES if name in parameters), None)


def cache_argument(module: torch.nn.Module) -> str:
    """The name under which `module`'s forward takes its cache, read from that forward's own signature (never from
    a version string), e.g. `"cache"` for a Llama of transformers 5.24, `"past_key_values"` for one of 5.23.

    Every forward this package runs with a cache (targets, draft models, decoder layers, MTP layers, drafter
    modules) passes it under this name, so no call of ours meets a deprecated argument.

    Raises:
        `ValueError`: a module whose forward takes no cache argument (none of `CACHE_ARGUMENT_NAMES`).
    """
    name = _cache_argument_of(type(module).forward)
    if name is None:
        raise ValueError(
            f"{type(module).__name__}.forward takes no cache argument (looked for {' / '.join(CACHE_ARGUMENT_NAMES)}): "
            "speculative decoding needs a module that keeps a KV cache across forwards."
        )
    return name


def passed_cache(model_kwargs: dict) -> Cache | None:
    """The cache a `generate` call carries in `model_kwargs`, under either name (`cache` from transformers 5.24 on,
    `past_key_values` before), or `None`.

    Raises:
        `ValueError`: two different caches, one under each name.
    """
    new, old = model_kwargs.get("cache"), model_kwargs.get("past_key_values")
    if new is not None and old is not None and new is not old:
        raise ValueError("Two caches were passed, cache= and past_key_values=: pass one (cache= from transformers 5.24 on).")
    return new if new is not None else old


def prepare_cache(cache: Cache | None, config, num_slots: int | None = None) -> Cache:
    """Returns a cache that speculative decoding can roll back, creating a `DynamicCache` if `cache` is `None`.

    The empty full-attention layers of a dynamic cache become `GrowingLayer`s of `num_slots` slots, which append in
    place rather than copy the whole cache at every forward (`growing_cache`); the cache object stays the one passed.

    A static cache (`cache_implementation="static"`, or a `StaticCache` passed) is kept when it holds `num_slots`
    slots per row, or replaced, when empty, by one of a length bucket that does (`static_cache.prepare_static_cache`):
    rejected tokens then leave it by a length reset.

    Args:
        cache: the cache the generate call carries (`passed_cache`), or `None`.
        config: the model's config, used to create a new cache.
        num_slots (`int`, *optional*): the most slots per row the call may write (a static cache's least length, a
            growing layer's first buffer); without it a static cache is refused.

    Raises:
        `ValueError`: for another fixed-size cache, a static cache that cannot serve (`prepare_static_cache`), and
            a cache with layers that cannot be cropped (`check_croppable`).
    """
    if cache is None:
        cache = DynamicCache(config=config)
    if num_slots is not None and is_static(cache):
        return prepare_static_cache(cache, config, num_slots)
    if not isinstance(cache, DynamicCache):
        raise ValueError(
            f"Speculative decoding needs a DynamicCache or a StaticCache, got {type(cache).__name__}: rejected draft "
            "tokens must be dropped from the cache. Remove the cache you passed (or its cache_implementation) and retry."
        )
    check_croppable(cache, config)
    use_growing_layers(cache, num_slots)
    cache.activate_past_recording()  # sliding-window layers keep what a rollback needs
    return cache


def check_croppable(cache: Cache, config) -> None:
    """Raises `ValueError` unless every layer of `cache` can drop its last tokens, read from the layers' classes
    before any forward.

    Linear-attention layers (Mamba, gated DeltaNet, short convolutions: Qwen3-Next, Qwen3.5, LFM2 and other
    hybrids) keep a recurrent state that a crop cannot put back as it was (transformers #49036), and report
    themselves not croppable until a forward has told otherwise; quantized layers cannot crop at all. Refusing
    them up front replaces a rollback that may be silently wrong.
    """
    refused = sorted({type(layer).__name__ for layer in cache.layers if not layer.is_croppable})
    if refused:
        layer_types = getattr(config, "layer_types", None)
        raise ValueError(
            f"Speculative decoding drops rejected draft tokens from the cache, which this model's cache layers "
            f"{refused} cannot do (they keep a recurrent state; layer types: "
            f"{sorted(set(layer_types)) if layer_types else 'not declared'}): use plain generate for this model."
        )


def rollback(cache: Cache, num_tokens: int) -> None:
    """Drops the last `num_tokens` tokens (>= 0) from every layer of `cache` (a static layer: a length reset)."""
    num_tokens = int(num_tokens)
    if num_tokens <= 0:
        return
    if is_static(cache):
        for layer in cache.layers:
            reset_length(layer, num_tokens)
    else:
        cache.crop(-num_tokens)


def seq_length(cache: Cache) -> int:
    """The tokens `cache` holds, as an `int` (a static cache counts them in a tensor)."""
    return int(cache.get_seq_length())


def truncate_layers(cache: Cache, length: int) -> None:
    """Keeps the first `length` tokens in every layer of `cache`, whatever each layer holds (layers may differ).

    Unlike `truncate`, which crops every layer by the first layer's excess, this reads each layer's own length:
    for attention layers only (layer skip, its one user, checks that with `check_layerwise_support`).
    """
    for layer in cache.layers:
        excess = layer.get_seq_length() - length
        if excess > 0:
            layer.crop(-excess)


def truncate(cache: Cache, length: int) -> None:
    """Keeps the first `length` tokens of `cache` (no-op if it holds `length` or fewer)."""
    rollback(cache, seq_length(cache) - length)


def layer_states(cache: Cache, layer_idx: int, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values `(batch_size, num_key_value_heads, num_slots, head_dim)` that layer `layer_idx` of `cache`
    holds (only its last `last` slots when given), as that layer's attention saw them (after its norms and RoPE):
    what a drafter that attends to the target's own keys and values reads (Gemma 4 assistants)."""
    layer = cache.layers[layer_idx]
    if last is None:
        return layer.keys, layer.values
    return layer.keys[..., -last:, :], layer.values[..., -last:, :]


def declared_windows(config) -> list[int]:
    """The sliding windows (in tokens) of the attention layers `config` declares, whatever cache a call passes: a
    `DynamicCache()` built without a config holds full-attention layers for a sliding-window model."""
    layers = DynamicCache(config=config).layers
    return sorted({layer.sliding_window for layer in layers if isinstance(layer, DynamicSlidingWindowLayer)})


def _check_windows(config, max_length: int, what: str) -> None:
    """Raises `ValueError` when a sliding window `config` declares is shorter than `max_length` tokens: `what` runs
    with custom masks over every cached slot, exact only while every window holds the whole sequence."""
    short = [window for window in declared_windows(config) if window < max_length]
    if short:
        raise ValueError(
            f"{what} attends over every cached token, and this model's sliding-window layers see only the last "
            f"{short[0]} tokens, fewer than max_length={max_length}: lower max_length (max_new_tokens) to "
            f"{short[0]} or less, or generate one sequence with a chain drafter."
        )


def check_tree_support(cache: Cache, config, max_length: int) -> None:
    """Raises `ValueError` unless every layer of `cache` is a full-attention `DynamicLayer` or `StaticLayer` and
    every sliding window the model declares holds `max_length` tokens.

    A token tree is scored with a 4D mask over the whole cache and compacted by gathering key/value rows: neither
    fits sliding-window layers (which hold only the last window of tokens) nor linear-attention states; and the 4D
    mask replaces the model's own window, so a passed full-attention cache serves a sliding-window model only while
    its windows hold the whole sequence.
    """
    unsupported = sorted({type(layer).__name__ for layer in cache.layers
                          if type(layer) not in (*FULL_ATTENTION_LAYERS, StaticLayer)})
    if unsupported:
        raise ValueError(
            f"Token trees need full-attention cache layers; this model's cache has {unsupported}. Use a drafter "
            "that proposes chains (e.g. DraftModelDrafter, or PromptLookupDrafter with num_candidates=1)."
        )
    _check_windows(config, max_length, "A token tree")


def check_layerwise_support(cache: Cache, config, max_length: int) -> None:
    """Raises `ValueError` unless every layer of `cache` attends to all earlier tokens up to `max_length` tokens.

    Layer skip runs decoder layers itself with a causal mask over the whole cache: right for full-attention layers,
    and for sliding-window layers (in the cache, or declared by the model's `config`) whose window holds the whole
    sequence.
    """
    for layer in cache.layers:
        if type(layer) in FULL_ATTENTION_LAYERS:
            continue
        if type(layer) is DynamicSlidingWindowLayer and layer.sliding_window >= max_length:
            continue
        window = getattr(layer, "sliding_window", None)
        raise ValueError(
            f"Layer skip needs full-attention cache layers; this model's cache has {type(layer).__name__}"
            + (f" with a window of {window} tokens, shorter than max_length={max_length}" if window else "")
            + ". Lower max_length to the window, or use DraftModelDrafter or PromptLookupDrafter."
        )
    _check_windows(config, max_length, "Layer skip")


def check_batch_support(cache: Cache, config, max_length: int) -> None:
    """Raises `ValueError` unless `cache` is empty, every layer is a full-attention `DynamicLayer` and every
    sliding window the model declares holds `max_length` tokens.

    A batch keeps rejected draft slots as masked holes (`RaggedCache`): a sliding-window layer counts its window in
    cache slots, holes included, and a linear-attention state cannot skip a slot. A passed full-attention cache
    serves a sliding-window model with 4D masks over each row's tokens (`RaggedCache(full_masks=True)`), exact
    while its windows hold the whole sequence.
    """
    unsupported = sorted({type(layer).__name__ for layer in cache.layers
                          if type(layer) not in (*FULL_ATTENTION_LAYERS, StaticLayer)})
    if unsupported:
        raise ValueError(
            f"Speculative generate with batch size > 1 needs full-attention cache layers; this model's cache has "
            f"{unsupported}. Call generate once per prompt."
        )
    if seq_length(cache) > 0:
        raise ValueError(
            "Speculative generate with batch size > 1 needs an empty cache: the rows' cached tokens cannot "
            "be told apart. Pass no cache (or a fresh DynamicCache)."
        )
    _check_windows(config, max_length, "Speculative generate with batch size > 1")


def _gather_slots(states: torch.Tensor, order: torch.LongTensor) -> torch.Tensor:
    """`states` `(batch_size, num_heads, num_slots, head_dim)` with slot j of row i taken from slot `order[i, j]`
    (keys and values may differ in `head_dim`: multi-head latent attention)."""
    index = order.to(states.device)[:, None, :, None].expand(-1, states.shape[1], -1, states.shape[-1])
    return states.gather(2, index)


class RaggedCache:
    """A `DynamicCache` whose rows hold different numbers of tokens, for speculative decoding of a batch.

    Rows accept different numbers of draft tokens, but a `DynamicCache` has one sequence axis for the whole batch
    (`crop` is batch-wide). Here every forward appends the same number of slots to every row, and the slots a row
    does not keep (its rejected draft tokens, the padding of a shorter query, the prompt's left padding) become
    *holes*: slots the attention mask hides. Position ids count each row's own tokens, so a row sees exactly the
    attention and positions it would have alone. Slots that are holes in every row at the end are cropped at once;
    when the widest row has `max_holes` more slots than tokens, every row is compacted (its tokens gathered to the
    right end, left-padded), which bounds the memory to `batch_size * (max_tokens + max_holes)` slots per layer.
    This is the masking design of "Batch Speculative Decoding Done Right" (Zhang et al. 2025, arXiv 2510.22876,
    section on ragged tensors) with periodic compaction; `max_holes=0` realigns after every step, as BASS-PAD and
    transformers PR #32189 do.

    Args:
        cache (`DynamicCache`): an empty cache, or one whose slots `valid` describes.
        valid (`torch.BoolTensor` of shape `(batch_size, num_slots)`): which slots of each row hold a token.
        max_holes (`int`, defaults to `DEFAULT_MAX_HOLES`, 32): hole slots the widest row may carry before all rows are compacted.
        rows (`list[int]`, *optional*): each row's index in the generate call's batch (default `0 .. batch_size - 1`);
            `select` and `keep_rows` keep it in step, as `self.rows`.
        full_masks (`bool`, defaults to `False`): give every forward with holes the 4D mask of each row's own tokens
            (`additive_mask`), never a 2D one: a sliding-window model builds its window from a 2D mask over cache
            slots, holes included, which would hide a row's own earlier tokens (see `check_batch_support`).
        fixed_rows (`bool`, defaults to `False`): rows that leave (`select`) keep their place in the cache's tensors,
            as rows every forward fills with a dummy query (`to_batch`), so that a compiled forward keeps one batch
            size per call; the rows this object describes (`valid`, `lengths`, `rows`) are the live rows only.
    """

    def __init__(self, cache: DynamicCache, valid: torch.BoolTensor, max_holes: int = DEFAULT_MAX_HOLES,
                 rows: list[int] | None = None, full_masks: bool = False, fixed_rows: bool = False):
        self.cache, self.valid, self.max_holes, self.full_masks = cache, valid, max_holes, full_masks
        self._places = torch.arange(valid.shape[0]) if fixed_rows else None  # each live row's row in the tensors
        self._num_places = valid.shape[0]
        self.static_width = static_length(cache) if is_static(cache) else None  # every forward's key slots
        self.lengths = valid.sum(dim=1)  # [batch_size] tokens each row holds
        self._holes = bool((~valid).any())
        self.rows = list(range(valid.shape[0])) if rows is None else list(rows)

    @property
    def batch_size(self) -> int:
        return self.valid.shape[0]

    @property
    def num_slots(self) -> int:
        return self.valid.shape[1]

    def to_batch(self, tensor: torch.Tensor, fill) -> torch.Tensor:
        """`tensor` `(batch_size, ...)` of the live rows as the cache's tensors hold them: with `fixed_rows`, of the
        call's first batch size, the rows that left holding `fill` (a value or a tensor of one row's shape)."""
        if self._places is None or len(self._places) == self._num_places:  # no row has left
            return tensor
        batch = tensor.new_empty((self._num_places, *tensor.shape[1:]))
        batch[:] = fill
        batch[self._places.to(tensor.device)] = tensor
        return batch

    def from_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """The live rows `(batch_size, ...)` of `tensor`, a forward's output over the cache's rows (`to_batch`)."""
        if self._places is None or len(self._places) == self._num_places:
            return tensor
        return tensor[self._places.to(tensor.device)]

    def inputs(self, new_valid: torch.BoolTensor) -> tuple[torch.LongTensor, torch.LongTensor]:
        """The `attention_mask` `(batch_size, num_slots + num_query)` and `position_ids` `(batch_size, num_query)` of
        a chain forward whose query slot j of row i holds a token when `new_valid[i, j]` (a hole otherwise)."""
        mask = torch.cat([self.valid, new_valid], dim=1).long()
        position_ids = (self.lengths[:, None] + new_valid.long().cumsum(dim=1) - 1).clamp_min(0)
        return mask, position_ids

    def reserve(self, num_query: int) -> None:
        """Makes a static cache hold this cache's slots and `num_query` more (`static_cache.ensure_room`; a dynamic
        cache grows by itself): a token tree may be wider than the call's first estimate."""
        if self.static_width is not None and ensure_room(self.cache, self.num_slots + num_query):
            self.static_width = static_length(self.cache)

    def query_inputs(self, query, dtype: torch.dtype) -> tuple[torch.Tensor | None, torch.LongTensor]:
        """The `attention_mask` and `position_ids` `(batch_size, num_query)` of a forward over `query`
        (`hf_speculators.query.Query`) after this cache.

        The mask is `None` for one row without holes and a chain query (the model's own causal mask), the 2D
        padding mask `(batch_size, num_slots + num_query)` for other chain queries, and the 4D float additive mask
        `(batch_size, 1, num_query, num_slots + num_query)` (`additive_mask`) for a query with its own visibility
        (token trees, unverified tokens) and, with `full_masks`, for every query that is not one row's chain
        without holes. Over a static cache the masks span its `static_width` slots (the unused ones hidden), and
        a chain always gets the 2D mask: every step of a call then has the same input shapes.
        """
        position_ids = self.lengths[:, None] + query.offsets
        static = self.static_width is not None
        if self.batch_size == 1 and not self._holes and query.visible is None and not static:
            return None, position_ids
        if query.visible is not None or self.full_masks:
            return self.additive_mask(query.valid, dtype, query.visible, query.past_visible), position_ids
        return self._pad_to_static(torch.cat([self.valid, query.valid], dim=1).long(), 0), position_ids

    def _pad_to_static(self, mask: torch.Tensor, value) -> torch.Tensor:
        """`mask` `(..., num_keys)` filled with `value` up to the static cache's slots (unchanged if dynamic)."""
        if self.static_width is None:
            return mask
        return torch.nn.functional.pad(mask, (0, self.static_width - mask.shape[-1]), value=value)

    def additive_mask(self, new_valid: torch.BoolTensor, dtype: torch.dtype, visible: torch.BoolTensor | None = None,
                      past_visible: torch.BoolTensor | None = None) -> torch.FloatTensor:
        """The 4D float additive mask `(batch_size, 1, num_query, num_slots + num_query)` of a forward whose query
        slot j of row i holds a token when `new_valid[i, j]`, for modules that take no 2D mask (a draft head's
        attention, decoder layers run one by one) and for queries with their own visibility.

        Query slot j sees its row's cached tokens (of the last `num_past` slots, those `past_visible[i, j]` marks),
        the new tokens that `visible[i, j]` marks (default: the new tokens up to j, a chain), and itself (so a
        hole's query sees at least one slot).

        Args:
            new_valid (`torch.BoolTensor` of shape `(batch_size, num_query)`): which query slots hold a token.
            dtype (`torch.dtype`): the model's dtype.
            visible (`torch.BoolTensor` of shape `(batch_size, num_query, num_query)`, *optional*): which query
                slots each query slot attends to (a token tree's ancestors).
            past_visible (`torch.BoolTensor` of shape `(batch_size, num_query, num_past)`, *optional*): which of the
                last `num_past` cached slots each query slot attends to (a token tree's ancestors fed by earlier
                forwards), instead of `valid`.
        """
        num_query, num_slots = new_valid.shape[1], self.valid.shape[1]
        if visible is None:
            visible = torch.ones(num_query, num_query, dtype=torch.bool).tril() & new_valid[:, None, :]
        seen = torch.cat([self.valid[:, None, :].expand(-1, num_query, -1), visible], dim=2)
        if past_visible is not None:
            seen[:, :, num_slots - past_visible.shape[2] : num_slots] = past_visible
        seen[:, torch.arange(num_query), num_slots + torch.arange(num_query)] = True
        mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
        return self._pad_to_static(mask, torch.finfo(dtype).min)[:, None]

    def append(self, new_valid: torch.BoolTensor, gather: bool = True) -> None:
        """After a forward of `num_query` slots per row: which of them each row keeps, `(batch_size, num_query)`.

        The others (rejected draft tokens, padding, unverified tokens) become holes. Kept slots that are not the
        first of their row's query (the accepted path of a token tree) are gathered to its front first, so a row
        keeps no hole before its newest token: one row never keeps a hole. `gather=False` says that every row's
        kept slots are the first of its query already (chains), which saves the check."""
        new_valid = new_valid.to(self.valid.device)
        if bool(new_valid.all()):  # every slot kept (a chain): no gather, no new hole, nothing to trim
            self.valid = torch.cat([self.valid, new_valid], dim=1)
            self.lengths = self.lengths + new_valid.shape[1]
            return
        if gather:
            kept_first = torch.sort(new_valid.to(torch.uint8), dim=1, descending=True, stable=True)
            if not torch.equal(kept_first.values.bool(), new_valid):
                self._gather_tail(kept_first.indices)
                new_valid = kept_first.values.bool()
        self.valid = torch.cat([self.valid, new_valid], dim=1)
        self.lengths = self.lengths + new_valid.sum(dim=1)
        self._trim()

    def _gather_tail(self, order: torch.LongTensor) -> None:
        """Reorders the last `order.shape[1]` slots of every row: new slot j of row i is old slot `order[i, j]`."""
        tail = slice(self.num_slots, self.num_slots + order.shape[1])  # the forward's slots, after the kept ones
        order = self.to_batch(order, torch.arange(order.shape[1]))  # rows that left: kept as they are
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys[..., tail, :] = _gather_slots(layer.keys[..., tail, :], order)
                layer.values[..., tail, :] = _gather_slots(layer.values[..., tail, :], order)

    def truncate(self, lengths: torch.LongTensor) -> None:
        """Keeps the first `lengths[i]` tokens of row i (no-op for a row holding that many or fewer)."""
        if not self._holes:  # every row holds every slot: one length for all is a crop
            keep = set(lengths.tolist())
            if len(keep) == 1:
                keep = min(keep.pop(), self.num_slots)
                rollback(self.cache, self.num_slots - keep)
                self.valid, self.lengths = self.valid[:, :keep], self.lengths.clamp_max(keep)
                return
        position = self.valid.long().cumsum(dim=1)  # [batch_size, num_slots] the 1-based index of each token
        self.valid = self.valid & (position <= lengths[:, None])
        self.lengths = self.valid.sum(dim=1)
        self._trim()

    def select(self, rows: torch.LongTensor) -> None:
        """Keeps the batch rows `rows` (indices into the current batch), e.g. to drop finished sequences (with
        `fixed_rows`, the others stay in the cache's tensors)."""
        if self._places is not None:
            self._places = self._places[rows]
        elif self.static_width is None:
            self.cache.batch_select_indices(rows)
        else:
            select_rows(self.cache, rows)
        self.valid, self.lengths = self.valid[rows], self.lengths[rows]
        self.rows = [self.rows[i] for i in rows.tolist()]
        self._trim()

    def keep_rows(self, rows: list[int]) -> list[int]:
        """Keeps the rows whose batch index (`self.rows`) is in `rows`, in that order (rows that finished leave);
        returns the current indices of the rows kept."""
        kept = [self.rows.index(row) for row in rows]
        if kept != list(range(self.batch_size)):
            self.select(torch.tensor(kept, dtype=torch.long))
        return kept

    def _trim(self) -> None:
        """Crops the slots that are holes in every row at the right end; compacts past `max_holes` holes."""
        occupied = self.valid.any(dim=0).nonzero()
        num_slots = int(occupied[-1]) + 1 if len(occupied) else 0
        rollback(self.cache, self.valid.shape[1] - num_slots)
        self.valid = self.valid[:, :num_slots]
        self._holes = num_slots * self.batch_size > int(self.lengths.sum())
        if self.batch_size and num_slots - int(self.lengths.max()) > self.max_holes:
            self.compact()

    def compact(self) -> None:
        """Gathers every row's tokens, in order, to the right end of `max(lengths)` slots (left padding first)."""
        width = int(self.lengths.max())
        # stable sort of 0/1: holes first, then the row's tokens in their order; the last `width` slots are kept
        num_slots = self.num_slots
        order = torch.sort(self.valid.to(torch.uint8), dim=1, stable=True).indices[:, num_slots - width:]
        order = self.to_batch(order, torch.arange(num_slots - width, num_slots))  # rows that left: any slots
        for layer in self.cache.layers:
            if layer.is_initialized:
                store_slots(layer, _gather_slots(layer.keys[..., :num_slots, :], order),
                            _gather_slots(layer.values[..., :num_slots, :], order))
        if self.static_width is not None:
            rollback(self.cache, num_slots - width)
        self.valid = torch.arange(width, device=self.valid.device) >= width - self.lengths[:, None]
        self._holes = bool((~self.valid).any())
