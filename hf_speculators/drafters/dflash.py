"""Drafting a whole block in one forward with a DFlash block drafter on the target's hidden states."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DynamicCache

from ..cache import RaggedCache, cache_argument
from ..draft import Draft
from .base import DraftState, StepFeedback, TargetNeeds
from .head import HeadDrafter, bounded_depth, keep_features, take_features
from .tree_growth import DynamicTree, StaticTree, position_trees, tree_shape
from .spec import Baseline, MethodSpec, Setting, Variant, VllmMapping


@dataclass
class DFlashState(DraftState):
    """A `DFlashDrafter`'s call: the drafter's cache of context keys and values (one row per running row) and each
    row's target features observed but not fed yet."""

    context_cache: RaggedCache | None = None
    pending: dict = field(default_factory=dict)  # row -> list of features `(n, width)` not fed yet


def check_dflash_fits(model: nn.Module, target, max_length: int | None) -> None:
    """Raises `ValueError` unless the DFlash drafter `model` (transformers' `MuseGlimmerAssistantModel`) can draft
    for `target`: made for another target (layer ids beyond its layers, another hidden size, a mask token outside
    its vocabulary), or a sliding window shorter than `max_length`."""
    config, text_config = model.config, target.config.get_text_config()
    num_layers = text_config.num_hidden_layers
    if any(not 0 <= i < num_layers for i in config.target_layer_ids):
        raise ValueError(
            f"This DFlash drafter reads target layers {list(config.target_layer_ids)}, but the target has "
            f"{num_layers} decoder layers: it was made for another target."
        )
    if config.hidden_size != text_config.hidden_size:
        raise ValueError(
            f"This DFlash drafter has hidden_size={config.hidden_size}, the target {text_config.hidden_size}: it was "
            "made for another target."
        )
    vocab_size = target.get_input_embeddings().weight.shape[0]
    if not 0 <= config.mask_token_id < vocab_size:
        raise ValueError(
            f"This DFlash drafter's mask_token_id={config.mask_token_id} is outside the target's {vocab_size}-token "
            "vocabulary: it was made for another tokenizer."
        )
    if getattr(target.get_input_embeddings(), "embed_norm", None) is not None:
        raise ValueError("Targets whose embeddings carry their own norm (embed_norm) are not supported by DFlash here.")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in config.layer_types and window and max_length is not None and window < max_length:
        raise ValueError(
            f"This DFlash drafter attends to a {window}-token window, shorter than max_length={max_length}: lower "
            "max_length to the window."
        )


class DFlashDrafter(HeadDrafter):
    """Drafts a block of tokens in ONE forward with a DFlash block drafter (block diffusion drafting; transformers'
    `DFlashTokenCandidateGenerator`, `speculation_type="dflash"`), run through transformers' own model class.

    The drafter keeps, per layer, the keys and values of the target's context: the hidden states of the target
    layers `config.target_layer_ids` (the outputs of those layers, transformers' `hidden_states[i + 1]`, which the
    loop captures in its own forwards) of every committed token the target's cache holds, projected by the
    drafter's encoder. Each step feeds the new context and a block of `block_size` query tokens: the last
    committed token then `block_size - 1` mask tokens (embedded by the target's embeddings), which attend to the
    whole context and to each other; the block's outputs 1 .. block_size - 1, through the target's LM head, are the
    draft logits of the next `block_size - 1` positions. The block leaves the cache after each step.

    Every row of a batch drafts in the same forward (`RaggedCache`: each row its own context). Chains take each
    position's token from its processed distribution (sampled under sampling, `draft_probs` set: rejection sampling
    is lossless); with `tree`, each depth's children are that position's top tokens (`position_trees`), with no
    further forward.

    Args:
        model (`MuseGlimmerAssistantModel`): the DFlash drafter, on the target's device and dtype.
        num_draft_tokens (`int`, *optional*): draft tokens per step, at most (and by default) `block_size - 1`.
        tree (`StaticTree`, `DynamicTree`, a list of paths or a mapping, *optional*): draft a token tree of this
            shape (see `tree_shape`), at most `block_size - 1` deep, instead of a chain.

    Raises:
        `ValueError`: at construction for `num_draft_tokens` outside `1 .. block_size - 1` or a malformed tree; at the
            start of generation (before any forward), see `check_dflash_fits`.
        `RuntimeError`: from `get_candidates` (transformers' own loop does not pass hidden states).

    Example:

    ```python
    drafter = hs.DFlashDrafter.from_pretrained("path/to/dflash-drafter")
    out = model.generate(**inputs, custom_generate=hs.generate, candidate_generator=drafter)
    ```
    """

    name = "dflash"
    state_class = DFlashState
    converts_per_call = False  # the drafter runs where it was put (the target's device and dtype)

    def __init__(self, model: nn.Module, num_draft_tokens: int | None = None,
                 tree: "StaticTree | DynamicTree | Sequence | Mapping | None" = None):
        self.block_size = model.config.block_size
        self.tree = None if tree is None else tree_shape(tree)
        depth = bounded_depth(num_draft_tokens, self.tree, self.block_size - 1, "block_size - 1")
        super().__init__(model, depth)

    @property
    def model(self) -> nn.Module:
        """The DFlash drafter module as given (or loaded)."""
        return self.module

    @classmethod
    def from_pretrained(cls, repo_id_or_path: str, *, revision: str | None = None, token: str | None = None,
                        num_draft_tokens: int | None = None, tree=None) -> "DFlashDrafter":
        """The drafter of a DFlash checkpoint (safetensors), loaded by transformers' `MuseGlimmerAssistantModel`.

        Raises:
            `ValueError`: a checkpoint in the vllm-project/speculators format (vLLM runs those).
        """
        from transformers import MuseGlimmerAssistantModel, PretrainedConfig

        config_json, _ = PretrainedConfig.get_config_dict(repo_id_or_path, revision=revision, token=token)
        if "speculators_model_type" in config_json:
            raise ValueError(
                f"{repo_id_or_path} is a vllm-project/speculators checkpoint ({config_json['speculators_model_type']}): "
                "vLLM runs it (SpeculativeConfig.to_vllm()); DFlashDrafter loads transformers' DFlash checkpoints."
            )

        model = MuseGlimmerAssistantModel.from_pretrained(repo_id_or_path, revision=revision, token=token,
                                                          use_safetensors=True)
        return cls(model.eval(), num_draft_tokens, tree)

    def target_needs(self, target) -> TargetNeeds:
        """The outputs of `target_layer_ids`: the input of the next layer, or the final norm's output for the last."""
        num_layers = target.config.get_text_config().num_hidden_layers
        ids = [i + 1 for i in self.model.config.target_layer_ids]
        return TargetNeeds(tuple(i for i in ids if i < num_layers), final_norm=num_layers in ids)

    def start(self, state: DFlashState) -> None:
        check_dflash_fits(self.model, state.target, state.generation_config.max_length)
        num_layers = state.target.config.get_text_config().num_hidden_layers
        if num_layers - 1 in self.model.config.target_layer_ids[:-1]:
            raise ValueError("The last target layer must come last in target_layer_ids (its output is the final "
                             "norm's, captured after the others).")
        state.context_cache = RaggedCache(DynamicCache(), torch.zeros(state.batch_size, 0, dtype=torch.bool))

    def observe(self, state: DFlashState, feedback: StepFeedback) -> None:
        """Keeps each row's features of its newly kept tokens until the next `propose` feeds them."""
        keep_features(state.pending, feedback)

    def _block_logits(self, state: DFlashState, input_ids, rows) -> torch.FloatTensor:
        """One drafter forward over every row's new context and block; the draft logits `(num_rows, block_size - 1,
        vocab_size)` of the positions after each row's committed tokens."""
        cache, device = state.context_cache, input_ids[0].device
        cache.keep_rows(list(rows))
        empty = torch.zeros(0, self.model.encoder.fc.in_features, device=device, dtype=self.model.dtype)
        context = [empty if features is None else features for features in take_features(state.pending, rows)]
        counts = torch.tensor([len(part) for part in context])
        context = torch.nn.utils.rnn.pad_sequence(context, batch_first=True)  # [rows, most new, width]
        num_rows, num_new, block = len(rows), context.shape[1], self.block_size
        mask_ids = torch.full((num_rows, block), self.model.config.mask_token_id, dtype=torch.long, device=device)
        mask_ids[:, 0] = torch.stack([ids[0, -1] for ids in input_ids])  # the anchor: the last committed token
        embeds = state.target.get_input_embeddings()(mask_ids)
        new_valid = torch.cat([torch.arange(num_new)[None] < counts[:, None],
                               torch.ones(num_rows, block, dtype=torch.bool)], dim=1)
        # the block sees every valid slot of its row, cached or new (bidirectional: the context precedes it)
        seen = new_valid[:, None, :].expand(-1, num_new + block, -1)
        mask = cache.additive_mask(new_valid, embeds.dtype, seen)[:, :, num_new:].to(device)
        position_ids = torch.cat([cache.lengths[:, None] + torch.arange(num_new),
                                  (cache.lengths + counts)[:, None] + torch.arange(block)], dim=1).to(device)
        outputs = self.model(noise_embeds=embeds, context_hidden_states=context.to(embeds.dtype),
                             attention_mask={"full_attention": mask, "sliding_attention": mask},
                             position_ids=position_ids, **{cache_argument(self.model): cache.cache})
        cache.append(torch.cat([new_valid[:, :num_new], torch.zeros(num_rows, block, dtype=torch.bool)], dim=1))
        return state.target.get_output_embeddings()(outputs.last_hidden_state[:, 1:])

    @torch.no_grad()
    def propose(self, state: DFlashState, input_ids: Sequence[torch.LongTensor], max_tokens: Sequence[int],
                rows: Sequence[int]) -> list[Draft]:
        logits = self._block_logits(state, input_ids, rows)  # [rows, block_size - 1, vocab]
        budgets = [min(budget, self.num_draft_tokens) for budget in max_tokens]
        if self.tree is not None:
            return position_trees(self.tree, input_ids, state.logits_processor, list(logits), budgets)
        return HeadDrafter.draft_chains(state, input_ids, logits[:, 0], budgets,
                                        lambda step, tokens, feeding: logits[:, step + 1])

    def __repr__(self) -> str:
        return f"DFlashDrafter(block_size={self.block_size}, {self.shape_repr()})"


DFLASH_SPEC = MethodSpec(
    "dflash", DFlashDrafter, required=("draft_model",), shared=("draft_revision", "tree"), loads="checkpoint",
    checkpoint=Setting("dflash_model", str,
                       help="dflash and dflash-tree: the DFlash block drafter's checkpoint, made for the target"),
    variants={"dflash": Variant(length="own"), "dflash-tree": Variant(length="tree")}, vllm=VllmMapping("dflash"),
    vllm_refusal=(
        "vLLM reads a DFlash drafter's target layers and vocabulary size from config keys that transformers' "
        "checkpoint lacks (dflash_config, vocab_size): `hf-speculators export NAME --to vllm` (or "
        "`convert_dflash_drafter`) writes a copy with them, then pass speculative_config={'method': 'dflash', "
        "'model': FOLDER}."),
    baselines={"hf-dflash": Baseline(("draft_model",), lambda config, target, draft, build: {
        "speculation_type": "dflash", "assistant_model": build().model})},
)
