"""Drafting with an EAGLE head (EAGLE-3, EAGLE-1/2) from the target's own hidden states, as chains or trees."""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from ..cache import RaggedCache, rollback
from ..compiled import DraftCompiler, run_draft_head, run_draft_head_step
from ..draft import Draft
from ..heads.eagle import check_head_fits
from ..heads.eagle_formats import load_eagle_head
from ..heads.files import head_folder
from ..static_cache import allocated
from ..vocab import widen_logits
from .base import DraftState, StepFeedback, TargetNeeds
from .head import HeadDrafter, keep_features, take_features, tree_depth
from .tree_growth import DynamicTree, StaticTree, grow_trees, tree_shape
from .spec import MethodSpec, Setting, Variant, VllmMapping


@dataclass
class EagleState(DraftState):
    """An `EagleDrafter`'s call: the head on the target's device and dtype, the head's cache of committed pairs
    (one row per running row of the call), each row's features observed but not fed to the head yet and, when the
    call compiles, the head's compiled forwards, of the catch-up (`head_call`) and of a chain step (`head_step`), one
    frame each (`compiled.DraftCompiler`; the head's cache is then static)."""

    head: nn.Module = None
    embeddings: nn.Module = None  # the head's own token embeddings, else the target's
    target_head: nn.Module = None  # the target's LM head (EAGLE-1/2 heads score through it)
    draft_to_target: torch.LongTensor | None = None  # draft id -> target id, for a reduced draft vocabulary
    head_cache: RaggedCache | None = None
    pending: dict = field(default_factory=dict)  # row -> list of features `(n, width)` not fed yet
    head_call: Callable | None = None
    head_step: Callable | None = None


def _causal_mask(num_cached: int, width: int, dtype: torch.dtype) -> torch.FloatTensor:
    """The additive mask `(1, 1, width, num_cached + width)` of `width` new tokens after `num_cached` cached ones of
    one row without holes: each sees the cached tokens, the new ones before it and itself."""
    mask = torch.full((width, num_cached + width), torch.finfo(dtype).min, dtype=dtype)
    return mask.triu_(num_cached + 1)[None, None]


class _DraftSlots:
    """The draft nodes fed to the head during one `propose`, after the committed pairs of its `RaggedCache`.

    They stay out of the ragged cache's bookkeeping (a tree node is seen by its own descendants only, not by every
    later slot) and are dropped from the head's cache when drafting ends (`drop`).

    Args:
        cache (`RaggedCache`): the head's cache, holding each row's committed pairs.
        one_row (`bool`): whether the cache is dynamic with one row and no holes: a chain's nodes then need no mask
            (a static cache's forwards always take one over its every slot).
    """

    def __init__(self, cache: RaggedCache, one_row: bool):
        self.cache, self.one_row = cache, one_row
        self.num_fed = 0
        self._positions = cache.lengths[:, None]  # [batch, 1] the position of a child of the last committed token
        self._valid: list[torch.BoolTensor] = []  # per forward: which of its slots hold a node
        self._visible: torch.BoolTensor | None = None  # which fed slots each fed slot sees (trees)

    def inputs(self, valid: torch.BoolTensor, depth: int, dtype: torch.dtype,
               sees: torch.BoolTensor | None = None) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """The `position_ids` `(batch_size, width)` and attention mask of a head forward over `width` new nodes per
        row, all at tree depth `depth`; afterwards they count as fed.

        Args:
            valid (`torch.BoolTensor` of shape `(batch_size, width)`, or nested lists of bools): which new slots
                hold a node.
            depth (`int`): the new nodes' depth (0: children of the last committed token).
            dtype (`torch.dtype`): the head's dtype.
            sees (`torch.BoolTensor` of shape `(batch_size, width, num_fed)`, *optional*): which fed slots each new
                node attends to (its ancestors); `None` for chains: every fed slot of its row.

        Returns:
            `(position_ids, mask)`: the mask is `(batch_size, 1, width, num_slots + num_fed + width)` additive, or
            `None` when a single query slot sees every slot (one row of chains).
        """
        num_fed, width = self.num_fed, len(valid[0])
        self.num_fed += width
        self._valid.append(valid)
        position_ids = (self._positions + depth).expand(-1, width)
        if sees is None and width == 1 and self.one_row:
            return position_ids, None
        if sees is not None:
            visible = torch.zeros(valid.shape[0], num_fed + width, num_fed + width, dtype=torch.bool)
            if self._visible is not None:
                visible[:, :num_fed, :num_fed] = self._visible
            visible[:, num_fed:, :num_fed] = sees
            self._visible = visible
        # the fed slots as one query: each sees what `visible` says
        fed_valid = torch.cat([torch.as_tensor(part, dtype=torch.bool) for part in self._valid], dim=1)
        mask = self.cache.additive_mask(fed_valid, dtype, self._visible)[:, :, num_fed:]
        # compiled graphs are guarded on strides, which this slice's change with `num_fed`: a copy keeps them fixed
        if self.cache.static_width is not None:
            mask = mask.clone(memory_format=torch.contiguous_format)
        return position_ids, mask

    def drop(self) -> None:
        """Drops every fed node from the head's cache: it holds the committed pairs again."""
        rollback(self.cache.cache, self.num_fed)


class EagleDrafter(HeadDrafter):
    """Drafts with an EAGLE head on the target's hidden states (EAGLE-1/2, Li et al. 2024; EAGLE-3, Li et al. 2025).

    At a step whose committed length is n, the target's cache holds n - 1 tokens and its newest feature is f_{n-2}
    (the loop captures the features of every token its cache keeps, `target_needs`, and hands them over through
    `observe`). The head's own KV cache holds the pairs (f_t, x_{t+1}) at position t for committed t: each step
    feeds the new pairs, whose last output drafts x_n. A chain then feeds each draft token back with the head's
    output (pre-norm, or post-norm with `norm_output`), one head forward per token. A tree (`StaticTree` or
    `DynamicTree`, as `TreeDrafter` takes it) feeds each depth's frontier in one forward, each node attending to
    the committed pairs and its own ancestors. Draft nodes are dropped from the head's cache after each step.

    Every row of a batch drafts at once: the head's cache keeps one row per running row (`RaggedCache`), and each
    head forward (the new pairs, each chain position, each tree depth) serves every row; rows may draft trees of
    different shapes.

    When the call compiles (a static cache and `compile_config`, `compiled.compiles`), chains compile too
    (`compiled.DraftCompiler`): the head's cache is a `StaticCache` of a length bucket, each step's new pairs run in
    one compiled forward of `num_draft_tokens + 1` slots (holes after a row's pairs; pairs before the last
    `num_draft_tokens + 1` fed eagerly first) and each chain node in one of one slot, the two kinds of forward in
    frames of their own (dynamo's graph limit counts per frame). Trees run eagerly.

    A reduced draft vocabulary maps back with `target_id = draft_id + d2t[draft_id]`; the draft's scores are
    laid out in the target's vocabulary with the lowest score elsewhere, then go through the call's logits
    processors and warpers, so the draft distribution is zero outside the draft vocabulary and rejection sampling
    stays lossless. Chains are sampled from that distribution under sampling (`draft_probs` set); trees take each
    node's most likely children (`draft_probs=None`, one-hot under rejection sampling, also lossless).

    Runs only inside `hf_speculators.generate` (it reads the target's hidden states), on the target types
    `DecoderLayers` takes (Llama, Mistral, Qwen2, Qwen3, GPT-NeoX, GPT-2).

    Args:
        head (`Eagle3Head` or `EagleHead`): the draft head (see `hf_speculators.heads.eagle`). It runs on the
            target's device in its dtype: a head elsewhere is never changed; the drafter keeps a converted copy
            per (device, dtype) (see `HeadDrafter`). A head loaded by `from_pretrained` is moved in place.
        num_draft_tokens (`int`, defaults to 5): draft tokens per step of a chain (k); ignored with `tree`.
        tree (`StaticTree`, `DynamicTree`, a list of paths or a mapping, *optional*): draft a token tree of this
            shape (see `tree_shape`) instead of a chain; its depth is the number of draft tokens.

    Raises:
        `ValueError`: at construction for `num_draft_tokens < 1` or a malformed tree; at the start of generation,
            naming the field, for a head that does not fit the target (see `check_head_fits`), or a static tree
            asking for a child rank beyond the draft vocabulary.
        `RuntimeError`: from `get_candidates` (transformers' own loop does not pass hidden states).

    Example:

    ```python
    drafter = hs.EagleDrafter.from_pretrained("RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", num_draft_tokens=3)
    out = model.generate(**inputs, custom_generate=hs.generate, candidate_generator=drafter)
    ```
    """

    name = "eagle"
    state_class = EagleState

    def __init__(self, head, num_draft_tokens: int = 5,
                 tree: "StaticTree | DynamicTree | Sequence | Mapping | None" = None):
        self.tree = None if tree is None else tree_shape(tree)
        super().__init__(head, num_draft_tokens if self.tree is None else self.tree.depth)
        self._compiler = DraftCompiler(run_draft_head, run_draft_head_step)  # chains of a compiled call; kept

    @property
    def head(self) -> nn.Module:
        """The head module as given (or loaded)."""
        return self.module

    @classmethod
    def from_pretrained(cls, repo_id_or_path: str, *, revision: str | None = None, token: str | None = None,
                        num_draft_tokens: int = 5, tree=None) -> "EagleDrafter":
        """An `EagleDrafter` with the head of a checkpoint in any format `detect_eagle_format` knows; the drafter
        owns the head (moved in place to each call's target device and dtype).

        Args:
            repo_id_or_path (`str`): a local folder or a Hub id (its JSON and weight files are downloaded).
            revision (`str`, *optional*): a Hub branch, tag or commit.
            token (`str`, *optional*): a Hub token.
            num_draft_tokens (`int`, *optional*, defaults to 5): as for the constructor.
            tree (`StaticTree`, `DynamicTree` or `str`, *optional*): as for the constructor.

        Raises:
            `FileNotFoundError`: a local path that is not a folder, or a folder without weights.
            `ValueError`: files of no known EAGLE format, or a malformed checkpoint (naming the field or tensor).
        """
        drafter = cls(load_eagle_head(head_folder(repo_id_or_path, revision, token)), num_draft_tokens, tree)
        drafter.owns_module = True
        return drafter

    def target_needs(self, target) -> TargetNeeds:
        layer_ids, final_norm = self.head.feature_points(target.config.get_text_config().num_hidden_layers)
        return TargetNeeds(tuple(layer_ids), final_norm)

    def start(self, state: EagleState) -> None:
        target = state.target
        check_head_fits(self.head, target)
        if isinstance(self.tree, StaticTree) and max(self.tree.ranks) >= self.head.draft_vocab_size:
            raise ValueError(
                f"The tree asks for child rank {max(self.tree.ranks)} of a {self.head.draft_vocab_size}-token draft "
                "vocabulary."
            )
        state.head = head = self.module_for(target.device, target.dtype)
        state.embeddings = head.embed_tokens if head.embed_tokens is not None else target.get_input_embeddings()
        state.target_head = target.get_output_embeddings()
        d2t = head.d2t
        state.draft_to_target = None if d2t is None else torch.arange(len(d2t), device=d2t.device) + d2t
        compiled = self.tree is None and self._compiler.static_cache(state, head.config, self.num_draft_tokens, head)
        cache, state.head_call, state.head_step = compiled or (DynamicCache(), None, None)
        state.head_cache = RaggedCache(cache, torch.zeros(state.batch_size, 0, dtype=torch.bool),
                                       fixed_rows=state.head_call is not None)

    def observe(self, state: EagleState, feedback: StepFeedback) -> None:
        """Keeps each row's features of its newly kept tokens until the next `propose` feeds them to the head."""
        keep_features(state.pending, feedback)

    def _run(self, state: EagleState, token_ids, hidden_states, position_ids, mask, call: Callable | None = None):
        """One head forward over pairs (hidden state, token) `(batch_size, q)` after the head's cache (`call`: a
        compiled forward, `state.head_call` or `state.head_step`; default: the head, eager); returns the states to
        feed back `(batch_size, q, H)` and the logits in the target's vocabulary `(batch_size, q, vocab_size)`. Over
        a static head cache, the rows that left the call get dummy inputs (`RaggedCache.to_batch`)."""
        device, cache = token_ids.device, state.head_cache
        embeds, position_ids = state.embeddings(token_ids), position_ids.to(device)
        mask = None if mask is None else mask.to(device)
        if cache.static_width is not None:
            embeds, hidden_states, position_ids, mask = (cache.to_batch(tensor, 0)
                                                         for tensor in (embeds, hidden_states, position_ids, mask))
        feedback, logits = (call or state.head)(embeds, hidden_states, position_ids, cache.cache, mask,
                                                state.target_head)
        feedback, logits = cache.from_batch(feedback), cache.from_batch(logits)
        if state.draft_to_target is not None:
            logits = widen_logits(logits, state.draft_to_target, self.head.vocab_size)
        return feedback, logits

    def _feed_pairs(self, state: EagleState, features: list, token_ids: list, width: int | None = None,
                    call: Callable | None = None) -> tuple[torch.FloatTensor, torch.FloatTensor]:
        """Feeds each row's new pairs, features `features[i]` `(n_i, F)` (`None`: none) and tokens `token_ids[i]`
        `(n_i,)`, in one head forward (`width` slots per row, default the most pairs of a row; the rest holes);
        they join the committed pairs of the head's cache. Returns the state to feed back `(batch_size, H)` and the
        logits `(batch_size, vocab_size)` after each row's last pair (any slot's for a row with none)."""
        cache, dtype = state.head_cache, state.head.fc.weight.dtype
        num_new = [0 if row_features is None else len(row_features) for row_features in features]
        some = next(row_features for row_features in features if row_features is not None)
        width = width or max(num_new)
        features = torch.stack([torch.nn.functional.pad(some[:0] if row is None else row, (0, 0, 0, width - count))
                                for row, count in zip(features, num_new)])  # [batch, width, F]
        token_ids = torch.stack([torch.nn.functional.pad(some.new_zeros(0, dtype=torch.long) if ids is None else ids,
                                                         (0, width - count)) for ids, count in zip(token_ids, num_new)])
        valid = torch.arange(width)[None] < torch.tensor(num_new)[:, None]  # each row's new pairs first, then holes
        # one row over a dynamic cache never leaves a hole in it: a causal mask (none for one query) serves
        if state.batch_size == 1 and cache.static_width is None:
            mask = None if width == 1 else _causal_mask(cache.num_slots, width, dtype)
        else:
            mask = cache.additive_mask(valid, dtype)
        position_ids = cache.lengths[:, None] + torch.arange(width)
        feedback, logits = self._run(state, token_ids, state.head.combine(features.to(dtype)), position_ids, mask,
                                     call=call)
        cache.append(valid, gather=False)  # each row's new pairs are the first of its query
        last = torch.tensor(num_new, device=logits.device).clamp_min(1) - 1
        batch = torch.arange(len(num_new), device=logits.device)
        return feedback[batch, last], logits[batch, last]

    def _catch_up(self, state: EagleState, features: list, token_ids: list):
        """`_feed_pairs` of each row's new pairs: at once, eagerly; or, when the call compiles, each row's last
        `num_draft_tokens + 1` pairs (the most a step commits) in one compiled forward of that width, any pairs
        before them (the prompt's; or after steps another drafter or the loop's floor ran) first, eagerly."""
        if state.head_call is None:
            return self._feed_pairs(state, features, token_ids)
        width = self.num_draft_tokens + 1
        early = [None if row is None or len(row) <= width else row[:-width] for row in features]
        if any(row is not None for row in early):
            early_ids = [None if row is None else ids[: len(row)] for row, ids in zip(early, token_ids)]
            self._feed_pairs(state, early, early_ids)
        late = [None if row is None else row[-width:] for row in features]
        return self._feed_pairs(state, late, [None if ids is None else ids[-width:] for ids in token_ids], width,
                                call=state.head_call if allocated(state.head_cache.cache) else None)

    @torch.no_grad()
    def propose(self, state: EagleState, input_ids: Sequence[torch.LongTensor], max_tokens: Sequence[int],
                rows: Sequence[int]) -> list[Draft]:
        # 1. each row's features since its last draft: the pairs (f_t, x_{t+1}) up to t = n - 2 (rows that finished
        # leave the head's cache); a row with none yet (a one-token prompt's first step) drafts nothing
        cache = state.head_cache
        cache.keep_rows(list(rows))
        features = take_features(state.pending, rows)
        num_new = [0 if rows_features is None else len(rows_features) for rows_features in features]
        if not any(num_new):
            return [Draft.empty(ids.device) for ids in input_ids]
        budgets = [budget if count else 0 for budget, count in zip(max_tokens, num_new)]
        cache.reserve(max(num_new) + self.num_draft_tokens + 1)  # a static cache: the new pairs, holes or draft nodes
        # 2. feed every row's new pairs; they join the committed pairs of the head's cache
        token_ids = [None if count == 0 else ids[0, ids.shape[1] - count :] for ids, count in zip(input_ids, num_new)]
        feedback, logits = self._catch_up(state, features, token_ids)  # [batch, H], [batch, vocab]
        # 3. draft from each row's last pair; the draft nodes leave the head's cache afterwards
        slots = _DraftSlots(cache, state.batch_size == 1 and cache.static_width is None)
        if self.tree is None:
            drafts = self._chains(state, slots, input_ids, feedback, logits, budgets)
        else:
            drafts = self._trees(state, slots, input_ids, feedback, logits, budgets)
        slots.drop()
        return drafts

    def _chains(self, state: EagleState, slots: _DraftSlots, input_ids, feedback, logits, budgets) -> list[Draft]:
        """Each row's chain of `budgets[i]` tokens, each fed back with the head's output state for the next one."""
        fed_back = feedback[:, None]  # [batch, 1, H]

        def next_logits(step: int, tokens: torch.LongTensor, feeding: list[bool]) -> torch.FloatTensor:
            nonlocal fed_back
            position_ids, mask = slots.inputs([[row] for row in feeding], step, fed_back.dtype)
            fed_back, step_logits = self._run(state, tokens[:, None], fed_back, position_ids, mask,
                                              call=state.head_step)
            return step_logits[:, 0]

        return self.draft_chains(state, input_ids, logits, budgets, next_logits)

    def _trees(self, state: EagleState, slots: _DraftSlots, input_ids, feedback, logits, budgets) -> list[Draft]:
        """Each row's token tree of `self.tree`'s shape, one head forward per depth for every row; each node is fed
        with its parent's output state."""
        device, num_rows = logits.device, len(budgets)
        fed_back = [{-1: row_feedback} for row_feedback in feedback]  # per row: node -> output state after it, (H,)
        fed_slots = [[] for _ in range(num_rows)]  # per row: the fed slot of each fed node, in the order fed
        depth = 0  # of the nodes fed next

        def forward(feeds: list) -> list:
            nonlocal depth
            width, num_fed = max(len(feed[1]) for feed in feeds if feed is not None), slots.num_fed
            token_ids = torch.zeros(num_rows, width, dtype=torch.long, device=device)
            hidden = feedback.new_zeros(num_rows, width, feedback.shape[-1])
            valid = torch.zeros(num_rows, width, dtype=torch.bool)
            sees = torch.zeros(num_rows, width, num_fed, dtype=torch.bool)
            for i, feed in enumerate(feeds):
                if feed is None:
                    continue
                nodes, frontier, fed_tree = feed
                count = len(frontier)
                token_ids[i, :count] = torch.tensor([nodes.token_ids[node] for node in frontier])
                hidden[i, :count] = torch.stack([fed_back[i][nodes.parent_ids[node]] for node in frontier])
                valid[i, :count] = True
                if fed_slots[i]:  # the frontier is the fed tree's last nodes; its ancestors were fed before
                    sees[i, :count, fed_slots[i]] = fed_tree.ancestors[-count:, :-count].cpu()
                fed_slots[i] += range(num_fed, num_fed + count)
            position_ids, mask = slots.inputs(valid, depth, hidden.dtype, sees)
            depth += 1
            outputs, node_logits = self._run(state, token_ids, hidden, position_ids, mask)
            for i, feed in enumerate(feeds):
                if feed is not None:
                    fed_back[i].update({node: outputs[i, j] for j, node in enumerate(feed[1])})
            return [None if feed is None else node_logits[i, : len(feed[1])] for i, feed in enumerate(feeds)]

        return grow_trees(self.tree, input_ids, state.logits_processor, logits, budgets, forward)

    def __repr__(self) -> str:
        return f"EagleDrafter({type(self.head).__name__}, {self.shape_repr()})"


EAGLE_HEAD = Setting("eagle_head", str,
                     help="eagle3 and eagle3-tree: the EAGLE draft head checkpoint (default: the demo target's)")
# the checkpoint's files say which EAGLE format; the method name is vLLM's
EAGLE3_SPEC, EAGLE_SPEC = (MethodSpec(
    name, EagleDrafter, required=("draft_model",), shared=("draft_revision", "tree"), loads="head",
    checkpoint=EAGLE_HEAD, variants=variants, vllm=VllmMapping(name), draft_length=tree_depth,
) for name, variants in (("eagle3", {"eagle3": Variant(), "eagle3-tree": Variant(length="depth")}), ("eagle", {})))
