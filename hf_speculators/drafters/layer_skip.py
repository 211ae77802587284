"""Self-speculative drafting with the target's first layers, writing into the target's own KV cache (layer skip)."""

import torch

from ..cache import RaggedCache, check_layerwise_support, truncate_layers
from ..layers import DecoderLayers
from ..tree import TokenTree
from ..types import Draft
from ..vocab import DraftVocabHead, check_draft_vocab
from .base import Drafter


class LayerSkipDrafter(Drafter):
    """Drafts with the target's own first `exit_layer` decoder layers, final norm and LM head, sharing its KV cache.

    Self-speculative decoding with early exit (LayerSkip, Elhoushi et al. 2024; Draft & Verify, Zhang et al.
    2023). With E = `exit_layer`, L the target's layers, x the pending token and d_1..d_k the draft tokens:

    1. Drafting runs layers `[0, E)` over x, d_1, ..., d_k, one token per pass. Each pass writes the keys and
       values of layers < E into the target's own cache; the layer-E hidden states of the first k passes,
       through the final norm and LM head, give d_1..d_k. The last pass only completes the cache and the
       hidden states for d_k.
    2. Verification (`target_forward`) runs only layers `[E, L)` over x, d_1..d_k in one forward, starting from
       the layer-E hidden states of step 1: nothing below layer E is computed twice.
    3. The speculative loop then drops the rejected tokens from every layer of the cache.

    No second model is held in memory. Early exits draft well only from a model trained for them (the LayerSkip
    recipe: layer dropout and an early-exit loss, as the demo target was). Runs only inside
    `hf_speculators.generate`, on the model types of `DecoderLayers` (Llama, Mistral, Qwen2, Qwen3, GPT-NeoX,
    GPT-2). With sampling, `draft_probs` are the early exit's processed distribution, so rejection sampling stays
    lossless. If drafting or verification of one sequence raises, the cache is restored to its state before the
    step.

    A batch (`propose_batch`) drafts every row at once, one slot per row and pass, through the batch's
    `hf_speculators.cache.RaggedCache` (its attention mask and per-row positions); a row whose draft has ended
    feeds a hole. Layers < E then hold exactly the slots of the verification query, and `target_forward_batch`
    appends the same slots to layers >= E, so every layer holds the same slots and the KV reuse is as above. A
    batched step that raises is not undone: a batch's cache is of no use outside its call.

    Args:
        exit_layer (`int`): E, the number of layers that draft, from 1 to the target's layers minus one.
        num_draft_tokens (`int`, defaults to 5): the most draft tokens per step (k).
        confidence_threshold (`float`, defaults to 0.0): adaptive draft length (Draft & Verify's adaptive
            draft-exiting; transformers' `assistant_confidence_threshold`): drafting stops after a draft token
            whose processed early-exit probability is below it. 0 always drafts k tokens.
        draft_vocab (`torch.LongTensor` or sequence of `int`, *optional*): a reduced draft vocabulary (FR-Spec,
            Zhao et al. 2025; e.g. `hf_speculators.vocab.frequent_tokens`): the early exit scores only these
            tokens, through a copy of their LM-head rows, so each draft token reads that many rows instead of the
            whole vocabulary. Verification scores every token, so the output is unchanged. Unset: every token.

    Raises:
        `ValueError`: at construction for `exit_layer < 1`, `num_draft_tokens < 1`, a `confidence_threshold`
            outside [0, 1) or a malformed `draft_vocab`; at the start of generation
            for `exit_layer` at or over the target's number of layers, a model `DecoderLayers` cannot run,
            sliding-window cache layers shorter than `max_length`, or a `draft_vocab` the LM head cannot slice
            (a quantized head, an id out of range).
        `RuntimeError`: from `get_candidates`: transformers' own assisted loop cannot share the target's cache.
    """

    name = "layer-skip"

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
        self._layers = self._cache = self._exit_hidden = self._no_draft = self._draft_head = None
        self._ragged = self._drafted_valid = None  # a batch's RaggedCache and the slots of its last draft

    def prepare(self, target, generation_config, logits_processor, generator, tokenizer=None, cache=None) -> None:
        super().prepare(target, generation_config, logits_processor, generator, tokenizer, cache)
        if cache is None:
            raise ValueError(
                "LayerSkipDrafter drafts into the target's own KV cache, which hf_speculators.generate passes to "
                "prepare(); run it through model.generate(..., custom_generate=hf_speculators.generate)."
            )
        layers = DecoderLayers(target)
        if self.exit_layer >= layers.num_layers:
            raise ValueError(
                f"exit_layer={self.exit_layer} leaves no layer to verify with: this model has {layers.num_layers} "
                f"layers; choose an exit layer from 1 to {layers.num_layers - 1}."
            )
        check_layerwise_support(cache, generation_config.max_length)
        self._layers, self._cache, self._exit_hidden, self._ragged = layers, cache, None, None
        self._draft_head = None if self.draft_vocab is None else DraftVocabHead(layers.head, self.draft_vocab)
        self._no_draft = TokenTree.chain(0, target.device)  # the positions of committed tokens

    def _early_layers(self, input_ids: torch.LongTensor, num_prefix: int) -> torch.FloatTensor:
        """Layer-E hidden states `(1, n, hidden_size)` of `input_ids` `(1, n)`, the last n of `num_prefix` tokens."""
        position_ids = self._no_draft.position_ids(num_prefix, input_ids.shape[1])
        hidden_states = self._layers.embed(input_ids, position_ids)
        mask = self._layers.chain_mask(num_prefix, input_ids.shape[1], input_ids.device)
        return self._layers.run(hidden_states, position_ids, range(self.exit_layer), self._cache, mask)

    @torch.no_grad()
    def propose(self, input_ids: torch.LongTensor, max_tokens: int) -> Draft:
        num_cached = self._cache.get_seq_length()
        fed, prefix = input_ids[:, num_cached:], input_ids  # the pending tokens, then one draft token per pass
        tokens, probs, exit_hidden = [], [], []
        try:
            for _ in range(max_tokens):
                exit_hidden.append(self._early_layers(fed, prefix.shape[1]))
                logits = self._layers.logits(exit_hidden[-1][:, -1], self._draft_head)
                token, token_probs = self._draft_token(prefix, logits, with_probs=self.confidence_threshold > 0)
                tokens.append(token)
                probs.append(token_probs)
                fed = token.view(1, 1)
                prefix = torch.cat([prefix, fed], dim=-1)
                if self.confidence_threshold and token_probs[token] < self.confidence_threshold:
                    break
            exit_hidden.append(self._early_layers(fed, prefix.shape[1]))  # the last draft token's cache entries
        except BaseException:
            truncate_layers(self._cache, num_cached)
            raise
        self._exit_hidden = torch.cat(exit_hidden, dim=1)  # [1, pending + k, hidden_size]
        return Draft.chain(torch.stack(tokens), torch.stack(probs) if self.do_sample else None)

    def target_forward(self, model, cache, input_ids, tree, num_prefix, num_logits) -> torch.FloatTensor:
        """Runs layers `[E, L)` over the pending and draft tokens from their drafted layer-E hidden states.

        Without a draft this step (the length budget left none), the whole target runs as usual.
        """
        exit_hidden, self._exit_hidden = self._exit_hidden, None
        if exit_hidden is None:
            return super().target_forward(model, cache, input_ids, tree, num_prefix, num_logits)
        num_total, num_tokens = num_prefix + tree.num_nodes, input_ids.shape[1]
        if exit_hidden.shape[1] != num_tokens or not tree.is_chain:
            raise RuntimeError("LayerSkipDrafter.target_forward must score the chain its last propose() drafted.")
        try:
            position_ids = tree.position_ids(num_prefix, num_tokens).to(input_ids.device)
            mask = self._layers.chain_mask(num_total, num_tokens, input_ids.device)
            late = range(self.exit_layer, self._layers.num_layers)
            hidden_states = self._layers.run(exit_hidden, position_ids, late, cache, mask)
        except BaseException:
            truncate_layers(cache, num_total - num_tokens)
            raise
        return self._layers.logits(hidden_states[0, -num_logits:])

    def check_batch_support(self) -> None:
        """Passes: layer skip drafts a chain per row of a batch (`propose_batch`)."""

    def _early_layers_batch(self, ragged: RaggedCache, input_ids: torch.LongTensor,
                            step_valid: torch.BoolTensor) -> torch.FloatTensor:
        """Layer-E hidden states `(batch_size, 1, hidden_size)` of `input_ids` `(batch_size, 1)`, fed into the last of
        this step's slots `step_valid` `(batch_size, num_fed)` (a hole in the rows whose draft has ended)."""
        position_ids = ragged.inputs(step_valid)[1][:, -1:].to(input_ids.device)
        mask = ragged.additive_mask(step_valid, self._layers.dtype)[:, :, -1:].to(input_ids.device)
        hidden_states = self._layers.embed(input_ids, position_ids)
        return self._layers.run(hidden_states, position_ids, range(self.exit_layer), ragged.cache, mask)

    @torch.no_grad()
    def propose_batch(self, input_ids: list[torch.LongTensor], max_tokens: list[int], rows: list[int]) -> list[Draft]:
        """Drafts a chain for every row at once: each pass runs layers `[0, E)` over one slot of every row.

        Pass 0 feeds every row's pending token, pass j its j-th draft token; a row whose draft has ended (its
        length budget, or the confidence threshold) gets a hole in the later passes. The early layers thus hold,
        after the cache's slots, exactly the slots of the verification query the loop builds next (pending token,
        draft tokens, padding), and `target_forward_batch` appends the same slots to layers `[E, L)`: afterwards
        every layer holds the same slots, which `RaggedCache.append` describes. Arguments as
        `Drafter.propose_batch`; the batch's cache holds every committed token but the last of each row.
        """
        ragged = self._ragged
        if ragged is None:  # no prefill forward ran (every prompt is one token): the cache is still empty
            ragged = RaggedCache(self._cache, torch.zeros(len(input_ids), 0, dtype=torch.bool))
        fed = torch.stack([ids[0, -1] for ids in input_ids])[:, None]  # [batch_size, 1] the pending tokens
        step_valid = torch.ones(len(input_ids), 1, dtype=torch.bool)  # [batch_size, passes] the slots fed
        drafting = torch.tensor(max_tokens) > 0  # [batch_size] the rows that draft in the next pass
        prefixes, tokens, probs, exit_hidden = list(input_ids), [[] for _ in input_ids], [[] for _ in input_ids], []
        while True:
            exit_hidden.append(self._early_layers_batch(ragged, fed, step_valid))
            if not drafting.any():
                break
            drafted, fed = drafting.clone(), fed.clone()  # a row without a token feeds a hole (masked, unused)
            logits = self._layers.logits(exit_hidden[-1][drafted.to(fed.device), -1], self._draft_head)
            for row_logits, i in zip(logits, drafted.nonzero()[:, 0].tolist()):
                token, token_probs = self._draft_token(prefixes[i], row_logits[None],
                                                       with_probs=self.confidence_threshold > 0)
                tokens[i].append(token)
                probs[i].append(token_probs)
                prefixes[i], fed[i, 0] = torch.cat([prefixes[i], token.view(1, 1)], dim=-1), token
                unsure = self.confidence_threshold and token_probs[token] < self.confidence_threshold
                drafting[i] = len(tokens[i]) < max_tokens[i] and not unsure
            step_valid = torch.cat([step_valid, drafted[:, None]], dim=1)
        self._exit_hidden, self._drafted_valid = torch.cat(exit_hidden, dim=1), step_valid  # [batch_size, passes, ..]
        return [Draft.chain(torch.stack(row), torch.stack(row_probs) if self.do_sample else None) if row
                else Draft.empty(fed.device) for row, row_probs in zip(tokens, probs)]

    def target_forward_batch(self, model, cache: RaggedCache, input_ids: torch.LongTensor,
                             new_valid: torch.BoolTensor, num_logits: int | None = None) -> torch.FloatTensor:
        """Runs layers `[E, L)` over every row's pending and draft tokens from their drafted layer-E hidden states.

        Without a draft this step (the prefill, or no row had a length budget left), the whole target runs as
        usual. Keeps `cache` for the next `propose_batch`, which writes into it. Arguments and result as
        `Drafter.target_forward_batch`.

        Raises:
            `RuntimeError`: if the query's slots are not those the last `propose_batch` drafted.
        """
        self._ragged = cache
        exit_hidden, self._exit_hidden = self._exit_hidden, None
        if exit_hidden is None:
            return super().target_forward_batch(model, cache, input_ids, new_valid, num_logits)
        if not torch.equal(new_valid.cpu(), self._drafted_valid):
            raise RuntimeError("LayerSkipDrafter.target_forward_batch must score the chains its last propose_batch() "
                               "drafted.")
        position_ids = cache.inputs(new_valid)[1]
        mask = cache.additive_mask(new_valid, self._layers.dtype).to(input_ids.device)
        late = range(self.exit_layer, self._layers.num_layers)
        hidden_states = self._layers.run(exit_hidden, position_ids.to(input_ids.device), late, cache.cache, mask)
        return self._layers.logits(hidden_states[:, -(num_logits or input_ids.shape[1]):])

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
