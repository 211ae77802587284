"""The drafter interface, also usable as a transformers `CandidateGenerator`."""

import torch
from transformers import Cache, GenerationConfig, LogitsProcessorList
from transformers.generation.candidate_generator import CandidateGenerator

from ..cache import RaggedCache
from ..forward import forward_batch_logits, forward_logits
from ..sampling import process_logits, sample
from ..tree import TokenTree
from ..types import Draft


class Drafter(CandidateGenerator):
    """Proposes draft tokens from the committed tokens.

    The speculative loop calls `prepare(...)` once at the start of each generate call, then `propose(input_ids,
    max_tokens)` once per step. A drafter that keeps state (a draft model's KV cache) reconciles it with the
    committed tokens on each call, so it needs no notice of what the verifier accepted.

    As a `CandidateGenerator`, `get_candidates(input_ids)` returns `(candidate_ids, candidate_logits)` with
    `candidate_ids` of shape `(1, sequence_length + k)` and `candidate_logits` of shape `(1, k, vocab_size)`
    (log-probabilities) or `None` for a deterministic drafter. transformers checks chains only: a tree draft gives
    its leftmost path (the first child at every node, the drafter's best guess).

    Args:
        num_draft_tokens (`int`): draft tokens proposed per step (k), at least 1: for a tree, its depth (the most
            tokens on one path, which is what the length budget of `propose(input_ids, max_tokens)` limits).

    Raises:
        `ValueError`: if `num_draft_tokens` is not an integer >= 1.
    """

    name: str = ""

    def __init__(self, num_draft_tokens: int):
        if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}.")
        self.num_draft_tokens = num_draft_tokens
        self.do_sample = False
        self.logits_processor = LogitsProcessorList()
        self.generator: torch.Generator | None = None

    def prepare(
        self,
        target,
        generation_config: GenerationConfig,
        logits_processor: LogitsProcessorList,
        generator: torch.Generator | None,
        tokenizer=None,
        cache=None,
    ) -> None:
        """Starts a generate call: checks that this drafter fits `target` and resets per-call state.

        Args:
            target (`PreTrainedModel`): the target model.
            generation_config (`GenerationConfig`): the call's config; `do_sample` decides greedy or sampled drafts.
            logits_processor (`LogitsProcessorList`): the call's processors and warpers, applied to draft logits too.
            generator (`torch.Generator`, *optional*): the only source of randomness for sampled drafts.
            tokenizer (`PreTrainedTokenizerBase`, *optional*): the target's tokenizer, for vocabulary checks.
            cache (`DynamicCache`, *optional*): the target's KV cache of this call, for drafters that write into it
                (layer skip); the others ignore it.
        """
        self.do_sample = bool(generation_config.do_sample)
        self.logits_processor = logits_processor
        self.generator = generator

    def propose(self, input_ids: torch.LongTensor, max_tokens: int) -> Draft:
        """Returns a draft continuing `input_ids` of shape `(1, sequence_length)`, no path longer than `max_tokens`."""
        raise NotImplementedError(f"{type(self).__name__} must implement propose(input_ids, max_tokens)")

    def check_batch_support(self) -> None:
        """Raises `ValueError` unless this drafter can draft for a batch of several sequences (`propose_batch`)."""
        raise ValueError(
            f"{type(self).__name__} cannot draft for a batch of several sequences yet: use PromptLookupDrafter or "
            "DraftModelDrafter for batches, or call generate once per prompt."
        )

    def propose_batch(self, input_ids: list[torch.LongTensor], max_tokens: list[int], rows: list[int]) -> list[Draft]:
        """Drafts for several sequences at once: one chain `Draft` per entry of `input_ids`.

        Args:
            input_ids (`list[torch.LongTensor]`): each sequence's committed tokens, shape `(1, sequence_length_i)`,
                without padding.
            max_tokens (`list[int]`): each sequence's length budget.
            rows (`list[int]`): each sequence's row in the generate call's batch (increasing). A row that is absent
                finished, and will not come back: a drafter with state per row may drop it.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement propose_batch(input_ids, max_tokens, rows)")

    def target_forward_batch(self, model, cache: RaggedCache, input_ids: torch.LongTensor,
                             new_valid: torch.BoolTensor, num_logits: int | None = None) -> torch.FloatTensor:
        """The verification (or prefill) forward of a batch: `forward_batch_logits`, same arguments and result.

        A drafter that reads or reuses the target's forward (learned heads, layer skip) overrides it, as it does
        `target_forward` for one sequence."""
        return forward_batch_logits(model, cache, input_ids, new_valid, num_logits)

    def target_forward(self, model, cache: Cache, input_ids: torch.LongTensor, tree: TokenTree, num_prefix: int,
                       num_logits: int) -> torch.FloatTensor:
        """The verification forward: the target's logits over the pending tokens and the draft's nodes.

        By default one forward of the whole target (`forward_logits`, same arguments and result). A drafter that
        already ran part of the target over these tokens while drafting (layer skip) finishes that forward here.
        """
        return forward_logits(model, cache, input_ids, tree, num_prefix, num_logits)

    def _draft_token(self, prefix: torch.LongTensor, logits: torch.FloatTensor, with_probs: bool = False):
        """Picks the next draft token from raw logits `(1, vocab_size)` continuing `prefix` `(1, length)`.

        The logits go through the call's processors as the target's do. Returns the token `()` and the processed
        distribution `(vocab_size,)` when sampling (the one it was drawn from: its `draft_probs` row) or when
        `with_probs` asks for it under greedy decoding, else `None` (greedy drafting needs only the argmax).
        """
        tokens, probs = self._draft_tokens([prefix], logits, with_probs)
        return tokens[0], None if probs is None else probs[0]

    def _draft_tokens(self, prefixes: list[torch.LongTensor], logits: torch.FloatTensor, with_probs: bool = False):
        """`_draft_token` for several sequences: row i of `logits` `(n, vocab_size)` continues `prefixes[i]`.
        Returns the tokens `(n,)` and distributions `(n, vocab_size)` or `None`; sampled rows are drawn in order."""
        scores = process_logits(self.logits_processor, prefixes, logits)
        if not (self.do_sample or with_probs):
            return scores.argmax(dim=-1), None
        probs = torch.softmax(scores, dim=-1)
        if not self.do_sample:
            return probs.argmax(dim=-1), probs
        return torch.stack([sample(row_probs, self.generator) for row_probs in probs]), probs

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        draft = self.propose(input_ids, self.num_draft_tokens)
        path = draft.tree.leftmost_path()
        candidate_ids = torch.cat([input_ids, draft.token_ids[path][None].to(input_ids.device)], dim=-1)
        candidate_logits = None if draft.draft_probs is None else draft.draft_probs[path].log()[None]
        return candidate_ids, candidate_logits

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_draft_tokens={self.num_draft_tokens})"
