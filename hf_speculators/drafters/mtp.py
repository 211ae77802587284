"""Drafting with the multi-token-prediction (MTP) layers a target ships beside its weights (DeepSeek-V3, GLM-4.5)."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from ..cache import RaggedCache, cache_argument
from ..draft import Draft
from ..sampling import process_logits
from .base import DraftState, StepFeedback, TargetNeeds
from .head import HeadDrafter, bounded_depth
from .tree_growth import DynamicTree, StaticTree, position_trees, tree_shape
from .spec import Baseline, MethodSpec, Variant, VllmMapping

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class MTPState(DraftState):
    """An `MTPDrafter`'s call: the MTP layers' cache (one row per running row, every layer the same slots) and each
    row's target features not in that cache yet (the last `num_mtp_layers - 1` slots are fed again each step)."""

    mtp_cache: RaggedCache | None = None
    window: dict = field(default_factory=dict)  # row -> features `(w, hidden_size)` of the slots not cached


def check_has_mtp_layers(target) -> None:
    """Raises `ValueError` for a target whose config declares no MTP layers (`num_mtp_layers`)."""
    if not getattr(target.config.get_text_config(), "num_mtp_layers", None):
        raise ValueError(
            f"This {type(target).__name__} declares no multi-token-prediction layers (its config has no "
            "num_mtp_layers): use another method, e.g. eagle3 or draft-model."
        )


def check_mtp_fits(mtp_model: nn.Module, target, max_length: int | None) -> None:
    """Raises `ValueError` unless `mtp_model` (an `MtpModel`) can draft for `target`.

    Raises:
        `ValueError`: a target whose config declares no MTP layers (`num_mtp_layers`); MTP layers tied to another
            model's LM head; MTP layers of a kind this drafter cannot run (linear attention, or a sliding window
            shorter than `max_length`).
    """
    check_has_mtp_layers(target)
    if mtp_model.shared_head is not target.get_output_embeddings():
        raise ValueError(
            "These MTP layers are tied to another model's embeddings and LM head: build them for this target, "
            "MTPDrafter.from_target(target) or MTPDrafter(MtpModel(target, num_mtp_layers))."
        )
    config = mtp_model.config
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * len(mtp_model.layers)
    unsupported = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
    if unsupported:
        raise ValueError(f"MTP layers of types {unsupported} cannot draft here (attention layers only).")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types and window is not None and max_length is not None and window < max_length:
        raise ValueError(
            f"The MTP layers attend to a {window}-token window, shorter than max_length={max_length}: lower "
            "max_length to the window."
        )


class MTPDrafter(HeadDrafter):
    """Drafts with the target's own multi-token-prediction layers (DeepSeek-V3, Liu et al. 2024, section 2.2; the
    MTP modules of GLM-4.5, Step 3, Bailing, Mellum), run through transformers' `MtpModel`.

    MTP layer k reads, at base position t, the pair (h^k_t, x_{t+1+k}): h^0 is the target's last hidden state
    (transformers' `hidden_states[-1]`, the final norm's output, which the loop captures in its own forwards) and
    h^k the output of layer k - 1; its output at the newest position t = n - 2 drafts x_{n+k}. So L layers draft L
    tokens, one forward per layer, layer k fed the draft tokens of layers < k. Each layer keeps a KV cache; after a
    step only the slots whose every layer saw committed tokens stay (the last L - 1 are fed again next step, as
    transformers' `MTPCandidateGenerator` does after a rejection), so the cache never holds a draft token.

    Every row of a batch drafts at once: the MTP cache keeps one row per running row (`RaggedCache`), and each layer
    forward serves every row. Chains are sampled from the processed distributions under sampling (`draft_probs`
    set: rejection sampling is lossless). With `tree`, each depth's children are the top tokens of that layer's
    distribution along the most likely path (`position_trees`), deterministic nodes, also lossless.

    Args:
        mtp_model (`MtpModel`): transformers' MTP layers, tied to the target (`MtpModel.from_pretrained(target)`
            or `MtpModel(target, num_mtp_layers)`), on the target's device and dtype.
        num_draft_tokens (`int`, *optional*): draft tokens per step, at most (and by default) `num_mtp_layers`
            (every layer still runs, so that the MTP cache stays whole).
        tree (`StaticTree`, `DynamicTree`, a list of paths or a mapping, *optional*): draft a token tree of this
            shape (see `tree_shape`), at most `num_mtp_layers` deep, instead of a chain.

    Raises:
        `ValueError`: at construction for `num_draft_tokens` outside `1 .. num_mtp_layers` or a malformed tree; at the start of generation (before any forward), see
            `check_mtp_fits`.
        `RuntimeError`: from `get_candidates` (transformers' own loop does not pass hidden states).

    Example:

    ```python
    drafter = hs.MTPDrafter.from_target(model)      # the MTP weights beside the target's checkpoint
    out = model.generate(**inputs, custom_generate=hs.generate, candidate_generator=drafter)
    ```
    """

    name = "mtp"
    state_class = MTPState
    converts_per_call = False  # the MTP layers run where they were put (tied to the target)

    def __init__(self, mtp_model: nn.Module, num_draft_tokens: int | None = None,
                 tree: "StaticTree | DynamicTree | Sequence | Mapping | None" = None):
        self.num_layers = len(mtp_model.layers)
        self.tree = None if tree is None else tree_shape(tree)
        super().__init__(mtp_model, bounded_depth(num_draft_tokens, self.tree, self.num_layers, "one per MTP layer"))

    @property
    def mtp_model(self) -> nn.Module:
        """The MTP layers as given (or loaded)."""
        return self.module

    @classmethod
    def from_target(cls, target, num_draft_tokens: int | None = None, tree=None) -> "MTPDrafter":
        """The drafter of the MTP layers stored beside `target`'s checkpoint (`target.config.name_or_path`), loaded
        by transformers' `MtpModel.from_pretrained` as `generate(use_mtp=True)` loads them.

        Raises:
            `ValueError`: a target whose config declares no MTP layers, before anything is read.
        """
        from transformers.modeling_layers import MtpModel

        check_has_mtp_layers(target)
        device = next(target.get_decoder().layers[-1].parameters()).device
        return cls(MtpModel.from_pretrained(target, device_map={"": device}).eval(), num_draft_tokens, tree)

    def target_needs(self, target) -> TargetNeeds:
        return TargetNeeds(final_norm=True)

    def draft_modules(self, target) -> tuple:
        """The MTP layers' parts that drafting calls one by one (`MtpModel`'s own forward never runs), and the
        target's LM head (the MTP layers' shared head)."""
        mtp = self.mtp_model
        parts = (mtp.embed_tokens, mtp.rotary_emb, *mtp.layers, mtp.shared_post_norm if mtp.use_shared_post_norm
                 else None, target.get_output_embeddings())
        return tuple(part for part in parts if part is not None)

    def start(self, state: MTPState) -> None:
        check_mtp_fits(self.mtp_model, state.target, state.generation_config.max_length)
        state.mtp_cache = RaggedCache(DynamicCache(), torch.zeros(state.batch_size, 0, dtype=torch.bool))

    def observe(self, state: MTPState, feedback: StepFeedback) -> None:
        """Appends each row's features of its newly kept tokens to its window of uncached slots."""
        for row, features in zip(feedback.rows, feedback.features):
            held = state.window.get(row)
            state.window[row] = features if held is None else torch.cat([held, features])

    def _layer(self, k: int, token_ids, hidden_states, position_ids, mask, cache):
        """MTP layer k over pairs `(batch_size, width)` after its cached slots; returns its output states."""
        mtp = self.mtp_model
        embeds = mtp.embed_tokens(token_ids).to(hidden_states.device)
        rope = {"layer_type": mtp.config.layer_types[k]} if mtp.has_per_layer_rope else {}
        position_embeddings = None if mtp.rotary_emb is None else mtp.rotary_emb(embeds, position_ids=position_ids,
                                                                                   **rope)
        hidden_states = mtp.layers[k](embeds, hidden_states, position_embeddings=position_embeddings,
                                      attention_mask=mask, position_ids=position_ids,
                                      **{cache_argument(mtp.layers[k]): cache})
        return mtp.shared_post_norm(hidden_states) if mtp.use_shared_post_norm else hidden_states

    def _windows(self, state: MTPState, rows: Sequence[int]):
        """Each row's window of uncached slots t = c .. n - 2 (rows that finished leave the MTP cache): the
        windows as given (`None`: no feature yet), their widths, and the padded features `(num_rows, width,
        hidden_size)`."""
        state.mtp_cache.keep_rows(list(rows))
        windows = [state.window.get(row) for row in rows]
        state.window = {row: window for row, window in zip(rows, windows) if window is not None}
        widths = [0 if window is None else len(window) for window in windows]
        if not any(widths):
            return windows, widths, None
        some = next(window for window in windows if window is not None)
        return windows, widths, torch.nn.utils.rnn.pad_sequence([some[:0] if w is None else w for w in windows],
                                                                batch_first=True)

    @torch.no_grad()
    def propose(self, state: MTPState, input_ids: Sequence[torch.LongTensor], max_tokens: Sequence[int],
                rows: Sequence[int]) -> list[Draft]:
        # 1. each row's window of uncached slots; a row with no feature yet (a one-token prompt) drafts nothing
        windows, widths, hidden = self._windows(state, rows)
        if hidden is None:
            return [Draft.empty(ids.device) for ids in input_ids]
        cache, device, width, num_rows = state.mtp_cache, input_ids[0].device, max(widths), len(rows)
        budgets = [min(budget, self.num_draft_tokens) if w else 0 for budget, w in zip(max_tokens, widths)]
        valid = torch.arange(width)[None] < torch.tensor(widths)[:, None]  # [rows, width]
        mask = None if num_rows == 1 and width == 1 else cache.additive_mask(valid, hidden.dtype).to(device)
        base = cache.lengths[:, None] + torch.arange(width) + 1  # [rows, width] position of layer 0's tokens
        last = torch.tensor(widths).clamp_min(1) - 1
        # each row's committed tokens from x_{c+1} on, then its draft tokens: layer k reads entries k .. k + width
        tails = [ids[0, ids.shape[1] - w:] for ids, w in zip(input_ids, widths)]
        drafted, probs, logits_per_layer = [[] for _ in rows], [[] for _ in rows], []
        # 2. layer by layer over every row's window; layer k's last slot drafts the row's token k
        for k in range(self.num_layers):
            token_ids = torch.nn.utils.rnn.pad_sequence(
                [torch.cat([tail, *drafted[i]])[k : k + widths[i]] if widths[i] else tail for i, tail in
                 enumerate(tails)], batch_first=True)
            token_ids = torch.nn.functional.pad(token_ids, (0, width - token_ids.shape[1]))
            hidden = self._layer(k, token_ids, hidden, (base + k).to(device), mask, cache.cache)
            logits = self.mtp_model._project_to_logits(hidden[torch.arange(num_rows), last.to(hidden.device)])
            logits_per_layer.append(logits)
            tokens, layer_probs = self._pick(state, input_ids, drafted, logits, budgets, k)
            for i in range(num_rows):
                drafted[i].append(tokens[i : i + 1])
                probs[i].append(None if layer_probs is None else layer_probs[i])
        # 3. keep the slots every layer saw with committed tokens; the last L - 1 of each window come again
        kept = [max(0, w - (self.num_layers - 1)) for w in widths]
        cache.append(torch.arange(width)[None] < torch.tensor(kept)[:, None])
        for row, window, count in zip(rows, windows, kept):
            if window is not None:
                state.window[row] = window[count:]
        if self.tree is not None:
            position_logits = [torch.stack([layer[i] for layer in logits_per_layer]) for i in range(num_rows)]
            return position_trees(self.tree, input_ids, state.logits_processor, position_logits, budgets)
        return [Draft.chain(torch.cat(drafted[i][:budget]),
                            torch.stack(probs[i][:budget]) if state.do_sample else None)
                if budget else Draft.empty(device) for i, budget in enumerate(budgets)]

    def _pick(self, state: MTPState, input_ids, drafted, logits, budgets, k: int):
        """Token k of every row `(num_rows,)` and, when sampling chains, the distributions it was drawn from: the
        call's processors over each row's committed tokens and drafts so far; a row past its budget (or a tree's
        path) takes the processed argmax and draws nothing from the generator."""
        prefixes = [torch.cat([ids, *(token[None] for token in drafted[i])], dim=-1) if drafted[i] else ids
                    for i, ids in enumerate(input_ids)]
        sampling = [i for i, budget in enumerate(budgets) if budget > k] if self.tree is None else []
        if len(sampling) == len(input_ids):
            return state.draft_tokens(prefixes, logits)
        tokens = process_logits(state.logits_processor, prefixes, logits).argmax(dim=-1)
        layer_probs = None
        if sampling:
            picked, picked_probs = state.draft_tokens([prefixes[i] for i in sampling], logits[sampling])
            tokens[sampling] = picked
            if picked_probs is not None:
                layer_probs = logits.new_zeros(logits.shape)
                layer_probs[sampling] = picked_probs
        return tokens, layer_probs

    def __repr__(self) -> str:
        return f"MTPDrafter({self.num_layers} MTP layers, {self.shape_repr()})"


# the target's own MTP layers, beside its checkpoint (draft_model: a speculators-format MTP checkpoint, for vLLM)
MTP_SPEC = MethodSpec(
    "mtp", MTPDrafter, shared=("tree", "draft_model", "draft_revision"), loads="target",
    variants={"mtp": Variant(length="own"), "mtp-tree": Variant(length="tree")}, vllm=VllmMapping("mtp", needs=(
        "vLLM drafts with the MTP layers of a target whose architecture it has an MTP model for (vLLM 0.32, among "
        "the targets whose MTP layers transformers loads: GLM-4.5 MoE, DeepSeek-V3, Inkling, Bailing, Step 3.7; "
        "not Mellum, which it serves through its transformers backend, without MTP)")),
    baselines={"hf-mtp": Baseline((), lambda config, target, draft, build: {"use_mtp": True})},  # its MTP layers
)
