"""Drafting with a Gemma 4 assistant: a small model that attends to the target's own keys and values."""

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..cache import layer_states
from ..draft import Draft
from .base import DraftState, StepFeedback, TargetNeeds
from .head import HeadDrafter
from .spec import Baseline, MethodSpec, Setting, Variant

# the layer types whose keys and values a Gemma 4 assistant reads from its target (`shared_kv_states`)
SHARED_LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_NUM_DRAFT_TOKENS = 4  # when the assistant's generation config sets no `num_assistant_tokens`


@functools.cache
def gemma4_assistant_unsupported() -> str | None:
    """Why this transformers cannot run Gemma 4 assistants, or `None` when it can.

    Found by trying what `Gemma4AssistantForCausalLM` needs, not by version: a Gemma 4 text config whose every layer
    reuses another model's keys and values (transformers 5.23 refuses it: "The set of layer types producing a cache is
    different than the set of layer types using them"; 5.24 builds it).
    """
    import transformers

    try:
        from transformers import Gemma4AssistantForCausalLM, Gemma4TextConfig  # noqa: F401

        Gemma4TextConfig(num_hidden_layers=1, num_kv_shared_layers=1, layer_types=["full_attention"]).kv_sharing_modes
    except (ImportError, ValueError) as error:
        return (f"Gemma 4 assistants need transformers >= 5.24: transformers {transformers.__version__} cannot build "
                f"Gemma4AssistantForCausalLM ({error}). Upgrade transformers.")
    return None


def check_gemma4_assistant_support() -> None:
    """Raises `ValueError` naming the transformers version needed when this one cannot run Gemma 4 assistants."""
    reason = gemma4_assistant_unsupported()
    if reason is not None:
        raise ValueError(reason)


def shared_layers(target) -> dict[str, int]:
    """Layer type -> the index of the target's decoder layer whose keys and values a Gemma 4 assistant reads: the last
    layer of that type that computes its own (`kv_sharing_modes` marks it `"store"`).

    Raises:
        `ValueError`: a target that is not a Gemma 4 text model (no `kv_sharing_modes`), or that stores no keys and
            values of a type in `SHARED_LAYER_TYPES`.
    """
    config = target.config.get_text_config()
    modes = getattr(config, "kv_sharing_modes", None)
    if modes is None:
        raise ValueError(
            f"A Gemma 4 assistant drafts for a Gemma 4 target; this target is a {type(target).__name__} "
            f"(model_type={config.model_type!r}), whose config has no kv_sharing_modes."
        )
    layers = {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
    missing = [layer_type for layer_type in SHARED_LAYER_TYPES if layer_type not in layers]
    if missing:
        raise ValueError(
            f"This target computes no keys and values of its own in {missing} layers (layer types "
            f"{sorted(set(config.layer_types))}): a Gemma 4 assistant reads both {list(SHARED_LAYER_TYPES)}."
        )
    return layers


def check_assistant_fits(assistant: nn.Module, target) -> None:
    """Raises `ValueError` unless the Gemma 4 assistant `assistant` can draft for `target`: a Gemma 4 target
    (`shared_layers`) of the hidden size and vocabulary the assistant was made for."""
    shared_layers(target)
    text_config = target.config.get_text_config()
    if assistant.config.backbone_hidden_size != text_config.hidden_size:
        raise ValueError(
            f"This Gemma 4 assistant was made for a target of hidden size {assistant.config.backbone_hidden_size}; "
            f"the target's is {text_config.hidden_size}: load the assistant made for this target."
        )
    if assistant.vocab_size != text_config.vocab_size:
        raise ValueError(
            f"This Gemma 4 assistant drafts over {assistant.vocab_size} tokens; the target's vocabulary has "
            f"{text_config.vocab_size}: load the assistant made for this target."
        )


@dataclass
class Gemma4AssistantState(DraftState):
    """A `Gemma4AssistantDrafter`'s call: the assistant on the target's device and dtype, the target layers whose keys
    and values it reads, and each row's newest target hidden state."""

    assistant: nn.Module | None = None
    layers: dict = field(default_factory=dict)  # layer type -> target layer index (`shared_layers`)
    hidden: dict = field(default_factory=dict)  # row -> the target's last hidden state `(hidden_size,)` of the
    # newest token in its cache (the one before the pending token)


@dataclass
class AssistantContext:
    """What every forward of one step's drafting shares, for the `n` rows that draft.

    Args:
        shared_kv_states (`dict[str, tuple[torch.Tensor, torch.Tensor]]`): per layer type, the target's keys and
            values `(n, num_key_value_heads, num_slots, head_dim)` of the rows' cached tokens.
        attention_mask (`torch.LongTensor` of shape `(n, num_slots)`, *optional*): which cache slots hold a token of
            the row; `None` when all do.
        position_ids (`torch.LongTensor` of shape `(n, 1)`): each row's pending token's position.
    """

    shared_kv_states: dict
    attention_mask: torch.LongTensor | None
    position_ids: torch.LongTensor


class Gemma4AssistantDrafter(HeadDrafter):
    """Drafts with a Gemma 4 assistant (`Gemma4AssistantForCausalLM`, e.g. google/gemma-4-E2B-it-assistant), run
    through transformers' modeling class, as transformers' `SinglePositionMultiTokenCandidateGenerator` runs it.

    The assistant has no cache of its own: every layer attends to the target's keys and values (of the target's last
    full-attention and last sliding-attention layers that compute their own, `shared_layers`). Drafting for the
    pending token x_p at position p, it reads the pair (target input embedding of x_p, target last hidden state
    h_{p-1}) at the constant position p and outputs the logits of x_{p+1} and a state that replaces h for the next
    draft token, fed with that token at the same position. Each row's keys and values are those the target's cache
    holds for its committed tokens before p, read from the loop's own target cache (no extra target forward, no
    draft token ever among them); the sliding layers see the last `sliding_window - 1` of them. The hidden state is
    the final norm's output, which the loop captures in its own forwards.

    Every row of a batch drafts in the same assistant forwards, each seeing only its own cache slots (a padding
    mask). Chains are sampled from the processed distributions under sampling (`draft_probs` set: rejection sampling
    is lossless; transformers' generator drafts the argmax but hands over the raw logits, transformers #47932).

    Args:
        assistant (`Gemma4AssistantForCausalLM`): the assistant, made for the target (its `backbone_hidden_size`
            the target's hidden size).
        num_draft_tokens (`int`, *optional*): draft tokens per step; defaults to the assistant's
            `generation_config.num_assistant_tokens` (what transformers drafts), else 4.

    Raises:
        `ValueError`: at construction on a transformers that cannot run Gemma 4 assistants (naming the version
            needed), or for `num_draft_tokens` < 1; at the start of generation (before any forward), see
            `check_assistant_fits`.
        `RuntimeError`: from `get_candidates` (transformers' own loop does not pass hidden states).

    Example:

    ```python
    drafter = hs.Gemma4AssistantDrafter.from_pretrained("google/gemma-4-E2B-it-assistant")
    out = model.generate(**inputs, custom_generate=hs.generate, candidate_generator=drafter)
    ```
    """

    name = "gemma4-assistant"
    state_class = Gemma4AssistantState

    def __init__(self, assistant: nn.Module, num_draft_tokens: int | None = None):
        check_gemma4_assistant_support()
        if num_draft_tokens is None:
            num_draft_tokens = assistant.generation_config.num_assistant_tokens or DEFAULT_NUM_DRAFT_TOKENS
        super().__init__(assistant, num_draft_tokens)

    @property
    def assistant(self) -> nn.Module:
        """The assistant as given (or loaded)."""
        return self.module

    @classmethod
    def from_pretrained(cls, repo_id_or_path: str, *, revision: str | None = None, token: str | None = None,
                        num_draft_tokens: int | None = None) -> "Gemma4AssistantDrafter":
        """The drafter of a Gemma 4 assistant checkpoint, loaded by transformers' `Gemma4AssistantForCausalLM`; the
        drafter owns it (moved in place to each call's target device and dtype).

        Raises:
            `ValueError`: on a transformers that cannot run Gemma 4 assistants, before anything is read.
        """
        check_gemma4_assistant_support()
        from transformers import Gemma4AssistantForCausalLM

        assistant = Gemma4AssistantForCausalLM.from_pretrained(repo_id_or_path, revision=revision, token=token)
        drafter = cls(assistant.eval(), num_draft_tokens)
        drafter.owns_module = True
        return drafter

    def target_needs(self, target) -> TargetNeeds:
        return TargetNeeds(final_norm=True)

    def start(self, state: Gemma4AssistantState) -> None:
        check_assistant_fits(self.assistant, state.target)
        state.layers = shared_layers(state.target)
        state.assistant = self.module_for(state.target.device, state.target.dtype)

    def observe(self, state: Gemma4AssistantState, feedback: StepFeedback) -> None:
        """Keeps each row's newest kept feature: the target's last hidden state of the token before its pending one."""
        for row, features in zip(feedback.rows, feedback.features):
            if len(features):
                state.hidden[row] = features[-1]

    def _context(self, state: Gemma4AssistantState, input_ids, selected: list[int]) -> AssistantContext:
        """The keys, values, padding mask and positions of the running rows `selected` (indices into this step's
        rows, which are the target cache's rows)."""
        cache, text_config = state.cache, state.target.config.get_text_config()
        every_row = len(selected) == cache.batch_size
        shared = {}
        for layer_type, layer_idx in state.layers.items():
            window = text_config.sliding_window - 1 if layer_type == "sliding_attention" else None
            states = layer_states(cache.cache, layer_idx, window)
            shared[layer_type] = states if every_row else tuple(tensor[selected] for tensor in states)
        valid = cache.valid[selected]
        device = input_ids[0].device
        positions = torch.tensor([[input_ids[i].shape[1] - 1] for i in selected], device=device)
        return AssistantContext(shared, None if bool(valid.all()) else valid.long().to(device), positions)

    def _forward(self, state: Gemma4AssistantState, context: AssistantContext, token_ids: torch.LongTensor,
                 hidden_states: torch.FloatTensor) -> tuple[torch.FloatTensor, torch.FloatTensor]:
        """One assistant forward for every drafting row: from its last token `(n,)` and the state before it `(n,
        hidden_size)`, the logits of the next token `(n, vocab_size)` and the state that follows `(n, hidden_size)`."""
        embeds = state.target.get_input_embeddings()(token_ids[:, None])
        outputs = state.assistant(inputs_embeds=torch.cat([embeds, hidden_states[:, None]], dim=-1),
                                  position_ids=context.position_ids, attention_mask=context.attention_mask,
                                  shared_kv_states=context.shared_kv_states, use_cache=False)
        return outputs.logits[:, 0], outputs.last_hidden_state[:, 0]

    @torch.no_grad()
    def propose(self, state: Gemma4AssistantState, input_ids: Sequence[torch.LongTensor], max_tokens: Sequence[int],
                rows: Sequence[int]) -> list[Draft]:
        # 1. the rows that draft: a row with no target feature yet (a one-token prompt) drafts nothing
        state.hidden = {row: state.hidden[row] for row in rows if row in state.hidden}
        selected = [i for i, row in enumerate(rows) if row in state.hidden and max_tokens[i] > 0]
        drafts = [Draft.empty(ids.device) for ids in input_ids]
        if not selected:
            return drafts
        # 2. one assistant forward per draft token for every drafting row, at the pending token's position
        context = self._context(state, input_ids, selected)
        hidden = torch.stack([state.hidden[rows[i]] for i in selected])
        last_tokens = torch.stack([input_ids[i][0, -1] for i in selected])
        logits, hidden = self._forward(state, context, last_tokens, hidden)

        def next_logits(step, tokens, feeding):
            nonlocal hidden
            step_logits, hidden = self._forward(state, context, tokens, hidden)
            return step_logits

        budgets = [min(max_tokens[i], self.num_draft_tokens) for i in selected]
        chains = HeadDrafter.draft_chains(state, [input_ids[i] for i in selected], logits, budgets, next_logits)
        for i, chain in zip(selected, chains):
            drafts[i] = chain
        return drafts

    def __repr__(self) -> str:
        return f"Gemma4AssistantDrafter(num_draft_tokens={self.num_draft_tokens})"


GEMMA4_ASSISTANT_SPEC = MethodSpec(
    "gemma4-assistant", Gemma4AssistantDrafter, required=("draft_model",), shared=("draft_revision",),
    loads="checkpoint", checkpoint=Setting("gemma4_assistant", str, help=(
        "gemma4-assistant: the Gemma 4 assistant's checkpoint, made for the target (transformers >= 5.24)")),
    variants={"gemma4-assistant": Variant()}, baselines={
        "hf-gemma4-assistant": Baseline(("num_draft_tokens", "draft_model"), lambda config, target, draft, build: {
            "assistant_model": build().module_for(target.device, target.dtype)}, pinned=True)},
)
