"""Self-speculative drafting with the target's first layers, writing into the target's own KV cache (layer skip)."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..cache import check_layerwise_support, truncate_layers
from ..attention import attention_implementation, takes_custom_masks
from ..decoder_layers import DecoderLayers
from ..draft import Draft
from ..step import Proposal, Resume
from ..vocab import DraftVocabHead, check_draft_vocab
from .base import Drafter, DraftState
from .spec import Baseline, MethodSpec, Setting, Variant


@dataclass
class LayerSkipState(DraftState):
    """A call's `DecoderLayers` view of the target and its draft-vocabulary head (`None`: the whole LM head)."""

    layers: DecoderLayers | None = None
    draft_head: DraftVocabHead | None = None


def _prefixes(input_ids: Sequence[torch.LongTensor], fed: list[torch.LongTensor], rows: list[int]):
    """Lazily, the prefix `(1, length)` of each row of `rows`: its committed tokens, then its draft tokens so far
    (`fed[1:]`, each `(batch_size, 1)`). Built only when logits processors read them."""
    drafted = torch.cat(fed[1:], dim=1) if len(fed) > 1 else None
    for i in rows:
        yield input_ids[i] if drafted is None else torch.cat([input_ids[i], drafted[i : i + 1]], dim=1)


class LayerSkipDrafter(Drafter):
    """Drafts with the target's own first `exit_layer` decoder layers, final norm and LM head, sharing its KV cache.

    Self-speculative decoding with early exit (LayerSkip, Elhoushi et al. 2024; Draft & Verify, Zhang et al.
    2023). With E = `exit_layer`, L the target's layers, x the pending token and d_1..d_k the draft tokens:

    1. Drafting runs layers `[0, E)` over x, d_1, ..., d_k, one token per pass. Each pass writes the keys and
       values of layers < E into the target's own cache; the layer-E hidden states of the first k passes,
       through the final norm and LM head, give d_1..d_k. The last pass only completes the cache and the
       hidden states for d_k.
    2. Verification, the speculative loop's target forward, runs only layers `[E, L)` over x, d_1..d_k, starting
       from the layer-E hidden states of step 1 (`Resume`): nothing below layer E is computed twice.
    3. The loop then keeps each row's accepted tokens in every layer of the cache.

    Every running row of a call drafts at once: each pass feeds one slot per row through the call's
    `hf_speculators.cache.RaggedCache` (`state.cache`: per-row positions, and its additive mask when the cache
    holds holes; one row, or rows without holes, need no mask for a pass's single token). A row whose draft has
    ended (its length budget, or the confidence threshold) feeds a hole in the later passes, so layers < E hold
    exactly the slots of the verification query the loop builds next and every layer then holds the same slots.

    No second model is held in memory. Early exits draft well only from a model trained for them (the LayerSkip
    recipe: layer dropout and an early-exit loss, as the demo target was). Runs only inside
    `hf_speculators.generate`, on the model types of `DecoderLayers` (Llama, Mistral, Qwen2, Qwen3, GPT-NeoX,
    GPT-2), with an attention implementation that takes custom 4D masks (eager, sdpa, flex_attention). With
    sampling, `draft_probs` are the early exit's processed distribution, so rejection sampling stays lossless. If
    drafting raises, layers < E are restored to the cache's slots before the step.

    Args:
        exit_layer (`int`): E, the number of layers that draft, from 1 to the target's layers minus one.
        num_draft_tokens (`int`, defaults to 5): the most draft tokens per step (k).
        confidence_threshold (`float`, defaults to 0.0): adaptive draft length (Draft & Verify's adaptive
            draft-exiting; transformers' `assistant_confidence_threshold`): a row stops drafting after a draft token
            whose processed early-exit probability is below it. 0 always drafts k tokens.
        draft_vocab (`torch.LongTensor` or sequence of `int`, *optional*): a reduced draft vocabulary (FR-Spec,
            Zhao et al. 2025; e.g. `hf_speculators.vocab.frequent_tokens`): the early exit scores only these
            tokens, through a copy of their LM-head rows, so each draft token reads that many rows instead of the
            whole vocabulary. Verification scores every token, so the output is unchanged. Unset: every token.

    Raises:
        `ValueError`: at construction for `exit_layer < 1`, `num_draft_tokens < 1`, a `confidence_threshold`
            outside [0, 1) or a malformed `draft_vocab`; at the start of generation (`start`, before any forward)
            without the target's cache (outside `hf_speculators.generate`), for `exit_layer` at or over the
            target's number of layers, a model `DecoderLayers` cannot run, an attention implementation that takes
            no custom masks (e.g. flash_attention_2: load the target with `attn_implementation="sdpa"`),
            sliding-window cache layers shorter than `max_length`, or a `draft_vocab` the LM head cannot slice
            (a quantized head, an id out of range).
        `RuntimeError`: from `get_candidates`: transformers' own assisted loop cannot share the target's cache.
    """

    name = "layer-skip"
    state_class = LayerSkipState

    def __init__(self, exit_layer: int, num_draft_tokens: int = 5, confidence_threshold: float = 0.0,
                 draft_vocab=None):
        super().__init__(num_draft_tokens)
        if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or exit_layer < 1:
            raise ValueError(f"exit_layer must be an integer >= 1 (the number of layers that draft), got {exit_layer!r}.")
        number = isinstance(confidence_threshold, (int, float)) and not isinstance(confidence_threshold, bool)
        if not number or not 0 <= confidence_threshold < 1:
            raise ValueError(f"confidence_threshold must be a number in [0, 1), got {confidence_threshold!r}.")
        self.exit_layer, self.confidence_threshold = exit_layer, confidence_threshold
        self.draft_vocab = None if draft_vocab is None else check_draft_vocab(draft_vocab)

    def draft_modules(self, target) -> tuple:
        """The target's parts that drafting runs outside its forward: embeddings, position embeddings, decoder
        layers, final norm and LM head."""
        parts = DecoderLayers(target)
        positions = tuple(m for m in (parts.rotary, parts.learned_positions) if m is not None)
        return (parts.embeddings, *positions, *parts.layers, parts.final_norm, parts.head)

    def start(self, state: LayerSkipState) -> None:
        if state.cache is None:
            raise ValueError(
                "LayerSkipDrafter drafts into the target's own KV cache, which hf_speculators.generate hands it; run "
                "it through model.generate(..., custom_generate=hf_speculators.generate)."
            )
        layers = DecoderLayers(state.target)
        if self.exit_layer >= layers.num_layers:
            raise ValueError(
                f"exit_layer={self.exit_layer} leaves no layer to verify with: this model has {layers.num_layers} "
                f"layers; choose an exit layer from 1 to {layers.num_layers - 1}."
            )
        if not takes_custom_masks(state.target):
            raise ValueError(
                f"Layer skip runs the target's layers with custom 4D attention masks, which "
                f"attn_implementation={attention_implementation(state.target)!r} cannot take: load the target with "
                f"attn_implementation=\"sdpa\" (or \"eager\")."
            )
        check_layerwise_support(state.cache.cache, state.target.config, state.generation_config.max_length)
        state.layers = layers
        state.draft_head = None if self.draft_vocab is None else DraftVocabHead(layers.head, self.draft_vocab)

    @torch.no_grad()
    def propose(self, state: LayerSkipState, input_ids: Sequence[torch.LongTensor], max_tokens: Sequence[int],
                rows: Sequence[int]) -> Proposal:
        """Drafts a chain for every row at once: each pass runs layers `[0, E)` over one slot of every row.

        Pass 0 feeds every row's pending token, pass j its j-th draft token; a row whose draft has ended gets a
        hole in the later passes. The proposal's `Resume` holds the layer-E hidden states `(batch_size, passes,
        hidden_size)` of every fed slot, from which the loop's target forward runs layers `[E, L)`. Arguments as
        `Drafter.propose`; the call's cache holds every committed token but the last of each row.
        """
        ragged, layers, exit_layer = state.cache, state.layers, range(self.exit_layer)
        num_slots, device, num_rows = ragged.num_slots, input_ids[0].device, len(input_ids)
        fed = [torch.cat([ids[:, -1:] for ids in input_ids])]  # per pass, the tokens fed: (batch_size, 1)
        positions = ragged.lengths[:, None].to(device)  # [batch_size, 1] each row's position of the pass
        holes = not bool(ragged.valid.all())  # without holes a pass's one token per row sees every cached slot
        counts = [0] * num_rows  # draft tokens per row so far
        drafting = [i for i, budget in enumerate(max_tokens) if budget > 0]  # the rows that draft in this pass
        exit_hidden, pass_probs = [], []
        with_probs = self.confidence_threshold > 0
        try:
            while True:
                mask = None
                if holes:
                    step_valid = torch.arange(len(fed)) <= torch.tensor(counts)[:, None]
                    mask = ragged.additive_mask(step_valid, layers.dtype)[:, :, -1:].to(device)
                hidden_states = layers.embed(fed[-1], positions)
                exit_hidden.append(layers.run(hidden_states, positions, exit_layer, ragged.cache, mask))
                if not drafting:
                    break
                every = len(drafting) == num_rows
                last = exit_hidden[-1][:, -1] if every else exit_hidden[-1][torch.tensor(drafting, device=device), -1]
                tokens, probs = state.draft_tokens(_prefixes(input_ids, fed, drafting),
                                                   layers.logits(last, state.draft_head), with_probs)
                if every:
                    fed.append(tokens[:, None])
                    positions = positions + 1
                else:  # the rows that stopped feed a hole (any token, masked and never kept)
                    fed.append(fed[-1].clone())
                    fed[-1][drafting, 0] = tokens
                    positions = positions.clone()
                    positions[drafting] += 1
                if state.do_sample:
                    pass_probs.append(dict(zip(drafting, probs)))
                unsure = (probs[torch.arange(len(drafting)), tokens] < self.confidence_threshold).tolist() \
                    if with_probs else [False] * len(drafting)
                for i in drafting:
                    counts[i] += 1
                drafting = [i for i, stop in zip(drafting, unsure) if counts[i] < max_tokens[i] and not stop]
        except BaseException:
            truncate_layers(ragged.cache, num_slots)
            raise
        valid = torch.arange(len(fed)) <= torch.tensor(counts)[:, None]  # [batch_size, passes]
        drafted = torch.cat(fed[1:], dim=1)  # [batch_size, passes - 1]: row i's draft tokens first
        drafts = [Draft.chain(drafted[i, :n], torch.stack([p[i] for p in pass_probs[:n]]) if state.do_sample else None)
                  if n else Draft.empty(device) for i, n in enumerate(counts)]
        return Proposal(drafts, Resume(self.exit_layer, torch.cat(exit_hidden, dim=1), valid))

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        raise RuntimeError(
            "LayerSkipDrafter shares the target's KV cache and runs only inside hf_speculators.generate; "
            "transformers' own loop offers early exit without cache sharing as assistant_early_exit=E."
        )

    def __repr__(self) -> str:
        threshold = f", confidence_threshold={self.confidence_threshold}" if self.confidence_threshold else ""
        vocab = "" if self.draft_vocab is None else f", draft_vocab=<{len(self.draft_vocab)} tokens>"
        return (f"LayerSkipDrafter(exit_layer={self.exit_layer}, num_draft_tokens={self.num_draft_tokens}"
                f"{threshold}{vocab})")


LAYER_SKIP_SPEC = MethodSpec(
    "layer-skip", LayerSkipDrafter, required=("exit_layer",), settings=(
        Setting("exit_layer", low=1, help="{methods}: the layers that draft"),
        Setting("confidence_threshold", float, low=0, high=1, high_included=False,
                help="{methods}: stop drafting after a token less likely than this"),
        Setting("draft_vocab", str, metavar="RANKING",
                help="layer-skip: draft from a token ranking (JSON ids, most frequent first; FR-Spec)"),
        Setting("draft_vocab_size", low=1, help="layer-skip: how many of the ranking's first ids draft (default: all)")),
    variants={"layer-skip": Variant()}, baselines={"hf-early-exit": Baseline(  # the target is its own assistant
        ("num_draft_tokens", "exit_layer", "confidence_threshold"),
        lambda config, target, draft, build: {"assistant_early_exit": config.exit_layer}, pinned=True)},
)
