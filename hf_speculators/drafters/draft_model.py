"""Drafting with a smaller causal LM of the same vocabulary, keeping its KV cache across steps."""

import torch

from ..cache import RaggedCache, check_batch_support, prepare_cache, truncate
from ..forward import forward_batch_logits, forward_logits
from ..quantization import quantized_copy
from ..tree import TokenTree
from ..types import Draft
from .base import Drafter


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


def right_aligned(sequences: list[torch.LongTensor], device) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Stacks 1D `sequences` into `(len(sequences), longest)` input ids, each at the right end (padding first, id
    0), and which slots hold a token `(len(sequences), longest)` (on the CPU, as `RaggedCache` keeps its masks)."""
    lengths = torch.tensor([len(sequence) for sequence in sequences])
    width = int(lengths.max())
    valid = torch.arange(width) >= width - lengths[:, None]
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    input_ids[valid] = torch.cat([sequence.cpu() for sequence in sequences])
    return input_ids.to(device), valid


class DraftModelDrafter(Drafter):
    """Drafts with a smaller causal LM that shares the target's tokenizer (Leviathan et al. 2023; Chen et al. 2023).

    The draft model keeps its own `DynamicCache` across steps: each call rolls it back to the longest prefix it
    shares with the committed tokens and feeds only the tokens it has not seen, then drafts `max_tokens` tokens
    one forward each. There is no re-prefill and no nested `generate()` per step. For a batch (`propose_batch`) the
    draft cache is a `RaggedCache` with one row per running sequence, and each forward serves every row.

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
            was built for another vocabulary.

    Example, a quantized copy of the target as its own draft (`from_target`):

    ```python
    drafter = hs.DraftModelDrafter.from_target(model, quantization="int8", num_draft_tokens=5)
    out = model.generate(**inputs, custom_generate=hs.generate, candidate_generator=drafter)
    ```
    """

    name = "draft-model"

    def __init__(self, draft_model, num_draft_tokens: int = 5, draft_tokenizer=None):
        super().__init__(num_draft_tokens)
        self.draft_model = draft_model
        self.draft_tokenizer = draft_tokenizer
        self.vocab_size = vocabulary_size(draft_model)
        self._reset_cache()

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
            **kwargs: the drafter's other arguments, e.g. `num_draft_tokens=5` (for `TreeDrafter`: `tree=`).

        Raises:
            `ValueError`: before any work, for a bad drafter argument, an unknown quantization, `"fp8"` without such
                a GPU, a `model` that is quantized already or whose layers the mode's library cannot convert.
            `ImportError`: the quantization library is not installed (`pip install "hf_speculators[quantization]"`).
        """
        drafter = cls(model, **kwargs)  # checks the drafter's arguments before the copy is made
        drafter.draft_model = quantized_copy(model, quantization)  # same config and vocabulary as `model`
        return drafter

    def prepare(self, target, generation_config, logits_processor, generator, tokenizer=None, cache=None) -> None:
        check_same_vocabulary(target, self.draft_model, tokenizer, self.draft_tokenizer)
        super().prepare(target, generation_config, logits_processor, generator, tokenizer, cache)
        self.vocab_size = vocabulary_size(target)
        self._reset_cache()

    def check_batch_support(self) -> None:
        """Raises `ValueError` if the draft model's cache cannot hold a batch: sliding-window or linear-attention
        layers (see `hf_speculators.cache.check_batch_support`)."""
        try:
            check_batch_support(prepare_cache(None, self.draft_model.config))
        except ValueError as error:
            raise ValueError(f"The draft model cannot draft for a batch: {error}") from error

    def _reset_cache(self) -> None:
        self._cache = prepare_cache(None, self.draft_model.config)
        self._cached_ids = torch.empty(0, dtype=torch.long)  # the tokens whose KV is in self._cache
        self._batch_cache: RaggedCache | None = None  # for propose_batch: one row per running sequence
        self._batch_cached_ids: list[torch.LongTensor] = []  # per row, the tokens whose KV it holds

    def _fit_vocabulary(self, logits: torch.FloatTensor) -> torch.FloatTensor:
        """Gives `logits` `(n, draft_vocab)` the target's width: extra rows dropped, missing ones at -inf."""
        missing = self.vocab_size - logits.shape[-1]
        if missing <= 0:
            return logits[..., : self.vocab_size]
        return torch.nn.functional.pad(logits, (0, missing), value=float("-inf"))

    def _new_tokens(self, input_ids: torch.LongTensor) -> torch.LongTensor:
        """Rolls the draft cache back to what it shares with the committed `input_ids` `(1, length)`; returns the
        committed tokens `(n,)` it lacks, at least the last one (its logits give the first draft token)."""
        device = self.draft_model.device
        committed = input_ids[0].to(device)
        reused = reusable_length(self._cached_ids.to(device), committed)
        truncate(self._cache, reused)
        return committed[reused:]

    def _logits(self, input_ids: torch.LongTensor, tree: TokenTree, num_prefix: int, num_logits: int, device):
        """Draft-model logits `(num_logits, target_vocab)` on `device` (see `forward_logits` for the arguments)."""
        logits = forward_logits(self.draft_model, self._cache, input_ids, tree, num_prefix, num_logits)
        return self._fit_vocabulary(logits).to(device)

    @torch.no_grad()
    def propose(self, input_ids: torch.LongTensor, max_tokens: int) -> Draft:
        # 1. roll the draft cache back to what it shares with the committed tokens; feed the rest
        new_ids, prefix = self._new_tokens(input_ids), input_ids
        no_nodes = TokenTree.chain(0, input_ids.device)
        tokens, probs = [], []
        # 2. draft one token per forward
        for _ in range(max_tokens):
            logits = self._logits(new_ids[None], no_nodes, prefix.shape[1], 1, input_ids.device)
            prefix = self._extend(prefix, logits, tokens, probs)
            new_ids = prefix[0, -1:].to(self.draft_model.device)
        # 3. remember what the cache holds: the committed tokens and all draft tokens but the last
        self._cached_ids = prefix[0, : self._cache.get_seq_length()]
        return self._chain(tokens, probs, input_ids)

    def _extend(self, prefix: torch.LongTensor, logits: torch.FloatTensor, tokens: list, probs: list):
        """Drafts the token after `prefix` `(1, length)` from raw logits `(1, vocab)` (`_draft_token`), appends it to
        `tokens` and its distribution to `probs`, and returns `prefix` with it `(1, length + 1)`."""
        token, token_probs = self._draft_token(prefix, logits)
        tokens.append(token)
        probs.append(token_probs)
        return torch.cat([prefix, token.view(1, 1)], dim=-1)

    def _chain(self, tokens: list, probs: list, input_ids: torch.LongTensor) -> Draft:
        """The chain `Draft` of the `tokens` drafted after `input_ids`, with `draft_probs` when sampling."""
        draft_probs = torch.stack(probs) if self.do_sample and probs else None
        return Draft.chain(torch.stack(tokens) if tokens else input_ids.new_empty(0), draft_probs)

    @torch.no_grad()
    def propose_batch(self, input_ids: list[torch.LongTensor], max_tokens: list[int], rows: list[int]) -> list[Draft]:
        """One batched draft forward per draft token for all rows; each row's chain is what `propose` would draft
        for it alone (same logits processors, same `draft_probs`), cut to the row's own budget."""
        # 1. each row's cache rolled back to what it shares with its committed tokens; the rest fed in one forward
        logits = self._feed_batch([ids[0] for ids in input_ids], rows, input_ids[0].device)
        prefixes = list(input_ids)
        tokens, probs = [[] for _ in rows], [[] for _ in rows]
        # 2. one forward per draft token for the rows whose budget asks for another
        for step in range(max(max_tokens)):
            for i in (i for i, budget in enumerate(max_tokens) if step < budget):
                prefixes[i] = self._extend(prefixes[i], logits[i : i + 1], tokens[i], probs[i])
            feeding = torch.tensor([step + 1 < budget for budget in max_tokens])[:, None]
            if feeding.any():
                last = torch.stack([prefix[0, -1] for prefix in prefixes])[:, None].to(self.draft_model.device)
                logits = self._batch_logits(last, feeding, input_ids[0].device)
        # 3. remember what each row of the cache holds: its committed tokens and the draft tokens fed
        self._batch_cached_ids = [prefix[0, :length] for prefix, length in zip(prefixes, self._batch_cache.lengths)]
        return [self._chain(row_tokens, row_probs, ids) for ids, row_tokens, row_probs in zip(input_ids, tokens, probs)]

    def _feed_batch(self, committed: list[torch.LongTensor], rows: list[int], device) -> torch.FloatTensor:
        """Syncs the batch draft cache with each row's `committed` tokens `(length_i,)`: drops the rows that left,
        rolls each row back to what it shares with its tokens and feeds the rest, at least the last token, in one
        forward. Returns the logits `(len(rows), target_vocab)` after each row's last committed token."""
        if self._batch_cache is None:
            empty = torch.zeros(len(rows), 0, dtype=torch.bool)
            self._batch_cache = RaggedCache(prepare_cache(None, self.draft_model.config), empty, rows=rows)
            self._batch_cached_ids = [committed[0].new_empty(0) for _ in rows]
        kept = self._batch_cache.keep_rows(rows)  # finished rows leave
        self._batch_cached_ids = [self._batch_cached_ids[i] for i in kept]
        reused = [reusable_length(cached, ids) for cached, ids in zip(self._batch_cached_ids, committed)]
        self._batch_cache.truncate(torch.tensor(reused))
        new_ids, new_valid = right_aligned([ids[n:] for ids, n in zip(committed, reused)], self.draft_model.device)
        return self._batch_logits(new_ids, new_valid, device)

    def _batch_logits(self, input_ids: torch.LongTensor, new_valid: torch.BoolTensor, device) -> torch.FloatTensor:
        """Draft-model logits `(batch_size, target_vocab)` on `device` at the last slot of `input_ids`
        `(batch_size, num_query)` after the batch draft cache, which keeps the slots `new_valid` marks."""
        logits = forward_batch_logits(self.draft_model, self._batch_cache, input_ids, new_valid, num_logits=1)
        self._batch_cache.append(new_valid)
        return self._fit_vocabulary(logits[:, -1]).to(device)

    def __repr__(self) -> str:
        return f"DraftModelDrafter({type(self.draft_model).__name__}, num_draft_tokens={self.num_draft_tokens})"
