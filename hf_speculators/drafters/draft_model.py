"""Drafting with a smaller causal LM of the same vocabulary, keeping its KV cache across steps."""

from dataclasses import dataclass, field

import torch

from ..cache import RaggedCache, check_batch_support, prepare_cache
from ..draft import Draft
from ..quantization import quantized_copy
from ..query import Query, forward
from .base import Drafter, DraftState


def vocabulary_size(model) -> int:
    """The width of `model`'s logits (its output embedding rows), which may exceed the tokenizer's length."""
    return model.get_output_embeddings().weight.shape[0]


def check_same_vocabulary(target, draft_model, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Raises `ValueError` unless the draft model can propose tokens in the target's vocabulary.

    Logits widths may differ only by padding rows (as in Qwen2.5 0.5B and 7B), and only when both tokenizers
    are given and equal, so that the extra rows are known to be unused.
    """
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ValueError(
                "The draft model's tokenizer differs from the target's: draft tokens would mean other text. "
                "Use a draft model of the same family that shares the target's tokenizer."
            )
        if len(target_tokenizer) <= min(vocabulary_size(target), vocabulary_size(draft_model)):
            return
    if vocabulary_size(target) != vocabulary_size(draft_model):
        raise ValueError(
            f"The draft model has a vocabulary of {vocabulary_size(draft_model)} tokens and the target of "
            f"{vocabulary_size(target)}: it was built for another vocabulary. Use a draft model that shares the "
            "target's tokenizer; if the sizes differ only by padding, pass both tokenizers "
            "(DraftModelDrafter(..., draft_tokenizer=...) and tokenizer= to generate) so they can be compared."
        )


def common_prefix_length(a: torch.LongTensor, b: torch.LongTensor) -> int:
    """Number of leading positions where 1D tensors `a` and `b` agree."""
    n = min(len(a), len(b))
    mismatches = (a[:n] != b[:n]).nonzero()
    return int(mismatches[0]) if len(mismatches) else n


def reusable_length(cached_ids: torch.LongTensor, committed: torch.LongTensor) -> int:
    """How many of the draft cache's tokens `cached_ids` `(n,)` a call keeps: those it shares with the `committed`
    tokens `(length,)`, but never the last committed token, whose logits the call needs."""
    return min(common_prefix_length(cached_ids, committed), len(committed) - 1)


def right_aligned(sequences: list[torch.LongTensor]) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Stacks 1D `sequences` into `(len(sequences), longest)` input ids, each at the right end (padding first, id
    0), and which slots hold a token `(len(sequences), longest)` (on the CPU, as `RaggedCache` keeps its masks)."""
    lengths = [len(sequence) for sequence in sequences]
    width = max(lengths)
    if min(lengths) == width:  # no padding (always for one sequence)
        return torch.stack(sequences), torch.ones(len(sequences), width, dtype=torch.bool)
    input_ids = torch.stack([torch.nn.functional.pad(sequence, (width - length, 0))
                             for sequence, length in zip(sequences, lengths)])
    return input_ids, torch.arange(width) >= width - torch.tensor(lengths)[:, None]


@dataclass
class DraftModelState(DraftState):
    """A call's draft-model state: its KV cache, one row per running row of the call (rows that finished leave it
    by their batch index, `RaggedCache.keep_rows`), the tokens each row of it holds, and the target's logits width.

    Args:
        draft_cache (`RaggedCache`): the draft model's cache.
        cached_ids (`list[torch.LongTensor]`): per cache row, the tokens `(length_i,)` whose keys and values it holds.
        vocab_size (`int`): the width of the target's logits, which draft logits are given.
        draft_device (`torch.device`): the draft model's device (read once: `model.device` walks the parameters).
    """

    draft_cache: RaggedCache | None = None
    cached_ids: list = field(default_factory=list)
    vocab_size: int = 0
    draft_device: torch.device | None = None


class DraftModelDrafter(Drafter):
    """Drafts with a smaller causal LM that shares the target's tokenizer (Leviathan et al. 2023; Chen et al. 2023).

    The draft model keeps its own KV cache across the steps of a call (`DraftModelState.draft_cache`, a
    `RaggedCache` with one row per running row): each call rolls every row back to the longest prefix it shares
    with that row's committed tokens and feeds only the tokens it has not seen, then drafts `max_tokens` tokens,
    one batched forward per draft token for all rows. There is no re-prefill and no nested `generate()` per step;
    a single sequence is a batch of one (no mask, the model's own causal attention).

    Draft scores go through the same logits processors and warpers as the target's, so with sampling the
    returned `draft_probs` are the distribution each draft token was drawn from and rejection sampling is
    lossless; with greedy decoding the draft is the argmax and `draft_probs` is `None`.

    Args:
        draft_model (`PreTrainedModel`): a causal LM with the target's vocabulary, on the target's device.
        num_draft_tokens (`int`, defaults to 5): draft tokens per step (transformers: `num_assistant_tokens`).
        draft_tokenizer (`PreTrainedTokenizerBase`, *optional*): the draft's tokenizer; with the target's
            tokenizer passed to generate it allows logits widths that differ only by padding.

    Raises:
        `ValueError`: at construction for `num_draft_tokens < 1`; at the start of generation if the draft model
            was built for another vocabulary, or for a batch if its cache has sliding-window or linear-attention
            layers (they cannot keep a batch's holes).

    Example, a quantized copy of the target as its own draft (`from_target`):

    ```python
    drafter = hs.DraftModelDrafter.from_target(model, quantization="int8", num_draft_tokens=5)
    out = model.generate(**inputs, custom_generate=hs.generate, candidate_generator=drafter)
    ```
    """

    name = "draft-model"
    state_class = DraftModelState

    def __init__(self, draft_model, num_draft_tokens: int = 5, draft_tokenizer=None):
        super().__init__(num_draft_tokens)
        self.draft_model = draft_model
        self.draft_tokenizer = draft_tokenizer

    @classmethod
    def from_target(cls, model, quantization: str, **kwargs) -> "DraftModelDrafter":
        """A drafter whose draft model is a quantized copy of the target `model` (self-speculative decoding with a
        quantized draft, as gpt-fast's int8/int4 drafts of the same model).

        The copy is made in memory (`hf_speculators.quantization.quantized_copy`): no Hub round trip, no file, and
        the tensors left unquantized (embeddings, norms, LM head) are shared with `model`, so the draft adds only
        its quantized layers to memory. `model` itself is not changed; generate with it as the target.

        Args:
            model (`PreTrainedModel`): the target, in full precision (float32, bfloat16 or float16).
            quantization (`str`): `"int8"` (torchao), `"nf4"` (bitsandbytes), `"int4"` (torchao) or `"fp8"`
                (torchao, CUDA GPUs of compute capability >= 8.9 only); see `hf_speculators.quantization`.
            **kwargs (`Any`): the drafter's other arguments, e.g. `num_draft_tokens=5` (for `TreeDrafter`: `tree=`).

        Raises:
            `ValueError`: before any work, for a bad drafter argument, an unknown quantization, `"fp8"` without such
                a GPU, a `model` that is quantized already or whose layers the mode's library cannot convert.
            `ImportError`: the quantization library is not installed (`pip install "hf_speculators[quantization]"`).
        """
        drafter = cls(model, **kwargs)  # checks the drafter's arguments before the copy is made
        drafter.draft_model = quantized_copy(model, quantization)  # same config and vocabulary as `model`
        return drafter

    def start(self, state: DraftModelState) -> None:
        """Checks the draft model against the target (none in transformers' `get_candidates`) and starts an empty
        draft cache of `state.batch_size` rows.

        Raises:
            `ValueError`: a draft model of another vocabulary; for a batch, a draft cache with sliding-window or
                linear-attention layers.
        """
        if state.target is not None:
            check_same_vocabulary(state.target, self.draft_model, state.tokenizer, self.draft_tokenizer)
        state.vocab_size = vocabulary_size(self.draft_model if state.target is None else state.target)
        cache = prepare_cache(None, self.draft_model.config)
        if state.batch_size > 1:
            try:
                check_batch_support(cache)
            except ValueError as error:
                raise ValueError(f"The draft model cannot draft for a batch: {error}") from error
        state.draft_cache = RaggedCache(cache, torch.zeros(state.batch_size, 0, dtype=torch.bool))
        state.draft_device = self.draft_model.device
        state.cached_ids = [torch.empty(0, dtype=torch.long, device=state.draft_device)] * state.batch_size

    def _logits(self, state: DraftModelState, query: Query, num_logits: int | None,
                device) -> torch.FloatTensor:
        """Runs the draft model over `query` after its cache, which then keeps the query's tokens; returns the
        logits `(num_rows, num_logits or num_query, target_vocab)` on `device`, at the target's width: extra
        columns dropped, missing ones at -inf."""
        logits = forward(self.draft_model, state.draft_cache, query, num_logits)
        state.draft_cache.append(query.valid)
        missing = state.vocab_size - logits.shape[-1]
        if missing < 0:
            logits = logits[..., : state.vocab_size]
        elif missing > 0:
            logits = torch.nn.functional.pad(logits, (0, missing), value=float("-inf"))
        return logits.to(device)

    def _feed(self, state: DraftModelState, input_ids, rows) -> torch.FloatTensor:
        """Syncs the draft cache with each row's committed tokens `input_ids[i]` `(1, length_i)`: drops the rows
        that left, rolls each row back to what it shares with its tokens and feeds the rest, at least the last
        token, in one forward. Returns the logits `(len(rows), target_vocab)` after each row's last token."""
        cache, device = state.draft_cache, state.draft_device
        kept = cache.keep_rows(list(rows))  # rows that finished leave
        committed = [ids[0].to(device) for ids in input_ids]
        reused = [reusable_length(state.cached_ids[i], ids) for i, ids in zip(kept, committed)]
        cache.truncate(torch.tensor(reused))
        new_ids, new_valid = right_aligned([ids[n:] for ids, n in zip(committed, reused)])
        state.cached_ids = committed
        return self._logits(state, Query.chain(new_ids, new_valid), 1, input_ids[0].device)[:, -1]

    @torch.no_grad()
    def propose(self, state: DraftModelState, input_ids, max_tokens, rows) -> list[Draft]:
        """Each row's chain of `max_tokens[i]` draft tokens: one batched draft forward per draft token for the rows
        whose budget asks for another (see `Drafter.propose` for the arguments)."""
        # 1. each row's cache rolled back to what it shares with its committed tokens; the rest fed in one forward
        logits = self._feed(state, input_ids, rows)  # [rows, vocab]
        prefixes = list(input_ids)
        tokens, probs = [[] for _ in prefixes], [[] for _ in prefixes]
        every_row = torch.ones(len(prefixes), 1, dtype=torch.bool)
        one_slot = Query.chain(every_row, every_row).offsets  # the offsets of a query of one slot per row
        # 2. one forward per draft token for the rows whose budget asks for another
        for step in range(max(max_tokens)):
            drafting = [i for i, budget in enumerate(max_tokens) if step < budget]
            every = len(drafting) == len(prefixes)
            new, new_probs = state.draft_tokens([prefixes[i] for i in drafting], logits if every else logits[drafting])
            for j, i in enumerate(drafting):
                tokens[i].append(new[j])
                probs[i].append(None if new_probs is None else new_probs[j])
                prefixes[i] = torch.cat([prefixes[i], new[j].view(1, 1)], dim=-1)
            feeding = [step + 1 < budget for budget in max_tokens]
            if any(feeding):
                last = new[:, None] if every else torch.stack([prefix[0, -1] for prefix in prefixes])[:, None]
                valid = every_row if all(feeding) else torch.tensor(feeding)[:, None]
                query = Query(last.to(state.draft_device), valid, one_slot, None, [int(fed) for fed in feeding])
                logits = self._logits(state, query, 1, input_ids[0].device)[:, -1]
        # 3. remember what each row of the cache holds: its committed tokens and the draft tokens fed
        state.cached_ids = [prefix[0, :length].to(state.draft_device)
                            for prefix, length in zip(prefixes, state.draft_cache.lengths.tolist())]
        return [Draft.chain(torch.stack(row_tokens), torch.stack(row_probs) if state.do_sample else None)
                if row_tokens else Draft.empty(ids.device)
                for ids, row_tokens, row_probs in zip(input_ids, tokens, probs)]

    def __repr__(self) -> str:
        return f"DraftModelDrafter({type(self.draft_model).__name__}, num_draft_tokens={self.num_draft_tokens})"
