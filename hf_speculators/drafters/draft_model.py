"""Drafting with a smaller causal LM of the same vocabulary, keeping its KV cache across steps."""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..cache import RaggedCache, check_batch_support, prepare_cache
from ..compiled import DraftCompiler, run_draft_model, run_draft_model_chain, run_draft_model_step
from ..draft import Draft
from ..entry import tokenizer_argument
from ..quantization import quantized_copy
from ..query import Query, forward, greedy_chain
from ..static_cache import allocated
from ..translation import DRAFT_ANCHOR, LOOKBEHIND, TokenizerBridge, same_vocabulary
from .base import Drafter, DraftState
from ..quantization import QUANTIZATIONS
from .spec import DRAFT_MODEL, Baseline, MethodSpec, Variant, VllmMapping


def vocabulary_size(model) -> int:
    """The width of `model`'s logits (its output embedding rows), which may exceed the tokenizer's length."""
    return model.get_output_embeddings().weight.shape[0]


def vocabulary_bridge(target, draft_model, target_tokenizer=None, draft_tokenizer=None) -> TokenizerBridge | None:
    """`None` when the draft model proposes tokens in the target's vocabulary, else the `TokenizerBridge` that
    translates between the two tokenizers.

    Vocabularies are compared, not sizes: logits widths may differ by padding rows (as in Qwen2.5 0.5B and 7B) when
    both tokenizers are given and equal. Without both tokenizers, equal logits widths are taken as one vocabulary.

    Raises:
        `ValueError`: logits widths that differ without both tokenizers, naming the missing argument.
    """
    if target_tokenizer is not None and draft_tokenizer is not None:
        if not same_vocabulary(target_tokenizer, draft_tokenizer):
            return TokenizerBridge(target_tokenizer, draft_tokenizer, vocabulary_size(target),
                                   vocabulary_size(draft_model))
        if len(target_tokenizer) <= min(vocabulary_size(target), vocabulary_size(draft_model)):
            return None
    if vocabulary_size(target) != vocabulary_size(draft_model):
        missing = " and ".join(name for name, tokenizer in (
            ("DraftModelDrafter(..., draft_tokenizer=...)", draft_tokenizer),
            (tokenizer_argument(target), target_tokenizer)) if tokenizer is None) or "tokenizers of the two models"
        raise ValueError(
            f"The draft model has a vocabulary of {vocabulary_size(draft_model)} tokens and the target of "
            f"{vocabulary_size(target)}: a draft of another vocabulary (or a padded one) needs both tokenizers "
            f"to translate (or compare) them; pass {missing}."
        )
    return None


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
        cached_ids (`list[torch.LongTensor]`): per cache row, the draft tokens `(length_i,)` whose keys and values
            it holds.
        vocab_size (`int`): the width of the target's logits, which draft logits are given.
        draft_device (`torch.device`): the draft model's device (read once: `model.device` walks the parameters).
        bridge (`TokenizerBridge`, *optional*): for a draft of another tokenizer, the translation between the two;
            `None` when the draft shares the target's vocabulary.
        draft_per_target (`float`): draft tokens per target token of the same text (a bridge's; measured on the
            first committed tokens), which sets how many draft tokens make a greedy draft of a given length.
        compiled_call (`Callable`, *optional*): when the call compiles, the draft model's compiled catch-up forward
            (`compiled.run_draft_model`; the draft forwards after the prefill run over a static draft cache);
            `None`: eager forwards.
        compiled_step (`Callable`, *optional*): with `compiled_call`, the compiled forward of a chain step, one token
            per row (`compiled.run_draft_model_step`: a frame of its own).
        compiled_chain (`Callable`, *optional*): with `compiled_call`, a whole greedy chain compiled as one graph
            (`compiled.run_draft_model_chain`), for steps whose every row drafts `num_draft_tokens` tokens.
        catch_up_width (`int`): with `compiled_call`, the query width of the compiled catch-up forward over each
            row's last committed tokens (`num_draft_tokens + 1`, the most a step commits).
    """

    draft_cache: RaggedCache | None = None
    cached_ids: list = field(default_factory=list)
    vocab_size: int = 0
    draft_device: torch.device | None = None
    bridge: TokenizerBridge | None = None
    draft_per_target: float = 0.0
    compiled_call: Callable | None = None
    compiled_step: Callable | None = None
    compiled_chain: Callable | None = None
    catch_up_width: int = 0

    @property
    def translates_text(self) -> bool:
        """Whether the draft runs in its own vocabulary and its text is translated after drafting (string-level
        exact matching, greedy); else it drafts target tokens (token-level intersection when sampling)."""
        return self.bridge is not None and not self.do_sample


class DraftModelDrafter(Drafter):
    """Drafts with a smaller causal LM (Leviathan et al. 2023; Chen et al. 2023), of the target's tokenizer or
    of another one (Timor et al. 2025, heterogeneous vocabularies).

    The draft model keeps its own KV cache across the steps of a call (`DraftModelState.draft_cache`, a
    `RaggedCache` with one row per running row): each call rolls every row back to the longest prefix it shares
    with that row's committed tokens and feeds only the tokens it has not seen, then drafts, one batched forward
    per draft token for all rows. There is no re-prefill and no nested `generate()` per step; a single sequence is
    a batch of one (no mask, the model's own causal attention).

    When the call compiles (transformers' switch, as for the target: a static cache and `compile_config`,
    `compiled.compiles`) and the draft shares the target's vocabulary, the draft cache is a `StaticCache` of a length
    bucket and every draft forward after the prefill runs the draft model's compiled call at a fixed shape: the
    one-token draft forwards, and the catch-up over each row's last `num_draft_tokens + 1` committed tokens (the
    cache rolled back far enough to refeed some: `_sync`, `_catch_up_query`), so no step recompiles after warm-up.
    A greedy step whose rows all draft `num_draft_tokens` tokens runs the catch-up and the chain's forwards as one
    compiled graph (`compiled.run_draft_model_chain`: no host work between the forwards, one guard check).

    Draft scores go through the same logits processors and warpers as the target's, so with sampling the
    returned `draft_probs` are the distribution each draft token was drawn from and rejection sampling is
    lossless; with greedy decoding the draft is the argmax and `draft_probs` is `None`.

    A draft model of another tokenizer (its `draft_tokenizer` and the target's `tokenizer=` differ as
    vocabularies) is detected at the start of generation and drafts through `hf_speculators.translation`: its
    cache holds its own tokens of the committed text (decoded, then encoded with its tokenizer; the cache is kept
    up to the longest common prefix); with greedy decoding it drafts in its own vocabulary and its text is encoded
    with the target's tokenizer (string-level exact matching: output identical to plain greedy); with sampling it
    samples only tokens whose text both vocabularies hold, from its processed distribution over them laid out in
    the target's vocabulary (token-level intersection: lossless rejection sampling).

    Args:
        draft_model (`PreTrainedModel`): a causal LM on the target's device.
        num_draft_tokens (`int`, defaults to 5): draft tokens per step (transformers: `num_assistant_tokens`), in
            target tokens.
        draft_tokenizer (`PreTrainedTokenizerBase`, *optional*): the draft's tokenizer; with the target's
            tokenizer passed to generate (`tokenizer=`) it allows another tokenizer, or logits widths that differ
            only by padding.

    Raises:
        `ValueError`: at construction for `num_draft_tokens < 1`; at the start of generation, before any forward,
            if the logits widths differ and a tokenizer is missing (naming `draft_tokenizer=` or `tokenizer=`), if
            two different tokenizers share no token, or for a batch if the draft cache has sliding-window or
            linear-attention layers (they cannot keep a batch's holes).

    Example, a draft of another tokenizer:

    ```python
    drafter = hs.DraftModelDrafter(draft, draft_tokenizer=draft_tokenizer)
    out = model.generate(**inputs, candidate_generator=drafter, tokenizer=tokenizer)  # after hs.enable(model)
    ```

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
        self._bridges = {}  # target tokenizer id -> (tokenizer, its TokenizerBridge): the vocabulary map is built once
        # compiled per compile_config, kept
        self._compiler = DraftCompiler(run_draft_model, run_draft_model_step, run_draft_model_chain)

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

    def _bridge(self, target, target_tokenizer) -> TokenizerBridge | None:
        """The call's translation (`vocabulary_bridge`), kept per target tokenizer (compared by identity)."""
        kept = self._bridges.get(id(target_tokenizer))
        if kept is not None and kept[0] is target_tokenizer and kept[1].target_width == vocabulary_size(target):
            return kept[1]
        bridge = vocabulary_bridge(target, self.draft_model, target_tokenizer, self.draft_tokenizer)
        if bridge is not None:
            self._bridges = {id(target_tokenizer): (target_tokenizer, bridge)}
        return bridge

    def draft_modules(self, target) -> tuple:
        return (self.draft_model,)

    def start(self, state: DraftModelState) -> None:
        """Checks the draft model against the target (none in transformers' `get_candidates`), finds whether its
        tokens need translating and starts an empty draft cache of `state.batch_size` rows.

        Raises:
            `ValueError`: logits widths that differ without both tokenizers; tokenizers that share no token (with
                sampling); for a batch, a draft cache with sliding-window or linear-attention layers.
        """
        if state.target is not None:
            state.bridge = self._bridge(state.target, state.tokenizer)
            if state.bridge is not None and state.do_sample:
                state.bridge.vocabulary  # built (and checked) before any forward
        state.vocab_size = vocabulary_size(self.draft_model if state.target is None else state.target)
        max_length = state.generation_config.max_length  # None in transformers' own loop (`as_candidate_generator`)
        cache = self._compiled_cache(state) or prepare_cache(
            None, self.draft_model.config, max_length and max_length + self.num_draft_tokens)
        if state.batch_size > 1:
            try:
                check_batch_support(cache, self.draft_model.config, state.generation_config.max_length)
            except ValueError as error:
                raise ValueError(f"The draft model cannot draft for a batch: {error}") from error
        state.draft_cache = RaggedCache(cache, torch.zeros(state.batch_size, 0, dtype=torch.bool),
                                        fixed_rows=state.compiled_call is not None)
        state.draft_device = self.draft_model.device
        state.cached_ids = [torch.empty(0, dtype=torch.long, device=state.draft_device)] * state.batch_size

    def _compiled_cache(self, state: DraftModelState):
        """When the call compiles (the target's static cache and `compile_config`: `compiled.compiles`, the target's
        own switch) and the draft shares the target's vocabulary, an empty static draft cache of a length bucket
        (`compiled.DraftCompiler`), with `state.compiled_call`, `state.compiled_step` and `state.compiled_chain` set;
        else `None` (eager drafting on a dynamic cache)."""
        compiled = state.bridge is None and self._compiler.static_cache(
            state, self.draft_model.config, self.num_draft_tokens, self.draft_model)
        if not compiled:
            return None
        cache, state.compiled_call, state.compiled_step, state.compiled_chain = compiled
        state.catch_up_width = self.num_draft_tokens + 1
        return cache

    def _logits(self, state: DraftModelState, query: Query, num_logits: int | None, device,
                call: Callable | None = None) -> torch.FloatTensor:
        """Runs the draft model (`call`: compiled; default: eager) over `query` after its cache, which then keeps the
        query's tokens; returns the logits `(num_rows, num_logits or num_query, width)` on `device`: in the draft's
        own vocabulary when its text is translated, else at the target's width (translated through the vocabulary
        intersection; or for one vocabulary, extra columns dropped, missing ones at -inf)."""
        logits = forward(self.draft_model, state.draft_cache, query, num_logits, call).to(device)
        state.draft_cache.append(query.valid)
        if state.bridge is not None:
            return logits if state.translates_text else state.bridge.vocabulary.widen(logits)
        missing = state.vocab_size - logits.shape[-1]
        if missing < 0:
            logits = logits[..., : state.vocab_size]
        elif missing > 0:
            logits = torch.nn.functional.pad(logits, (0, missing), value=float("-inf"))
        return logits

    def _sync(self, state: DraftModelState, draft_ids, rows) -> list[torch.LongTensor]:
        """Syncs the draft cache with each row's committed tokens in the draft's vocabulary `draft_ids[i]`
        `(length_i,)`: drops the rows that left and rolls each row back to what it shares with its tokens, compiled
        to at most `length_i - catch_up_width` tokens (the catch-up forward then holds a token in every slot: no
        hole, its last slot each row's newest token). Returns each row's tokens to feed, at least the last one."""
        cache = state.draft_cache
        kept = cache.keep_rows(list(rows))  # rows that finished leave
        reused = [reusable_length(state.cached_ids[i], ids) for i, ids in zip(kept, draft_ids)]
        if self._catches_up(state):
            reused = [max(min(n, len(ids) - state.catch_up_width), 0) for ids, n in zip(draft_ids, reused)]
        cache.truncate(torch.tensor(reused))
        state.cached_ids = draft_ids
        return [ids[n:] for ids, n in zip(draft_ids, reused)]

    @staticmethod
    def _catches_up(state: DraftModelState) -> bool:
        """Whether the draft cache catches up compiled (`_catch_up_query`): a compiled call after its prefill."""
        return state.compiled_call is not None and allocated(state.draft_cache.cache)

    def _feed(self, state: DraftModelState, new_ids, device) -> torch.FloatTensor:
        """Feeds each row's new tokens `new_ids[i]` `(n_i,)` (`_sync`) in one forward, eager or compiled. Returns
        the logits `(len(new_ids), width)` after each row's last token (see `_logits`)."""
        if not self._catches_up(state):  # eager, or the prefill
            return self._logits(state, Query.chain(*right_aligned(new_ids)), 1, device)[:, -1]
        query = self._catch_up_query(state, new_ids, device)
        logits = self._logits(state, query, None, device, state.compiled_call)  # [rows, width, vocab]
        last = query.valid.sum(dim=1) - 1
        return logits[torch.arange(len(new_ids), device=logits.device), last.to(logits.device)]

    def _catch_up_query(self, state: DraftModelState, new_ids: list[torch.LongTensor], device) -> Query:
        """The compiled catch-up's query, of a fixed width: each row's last `catch_up_width` new tokens (holes after
        a shorter row's, only while a row holds fewer tokens than that), any tokens before them fed first in one eager
        forward (after steps the model-free drafter of a hybrid drafted)."""
        width = state.catch_up_width
        early = [ids[:-width] for ids in new_ids]
        if max(map(len, early)):
            self._logits(state, Query.chain(*right_aligned(early)), 1, device)
        late = [ids[-width:] for ids in new_ids]
        lengths = torch.tensor([len(ids) for ids in late])
        input_ids = torch.stack([torch.nn.functional.pad(ids, (0, width - len(ids))) for ids in late])
        return Query.chain(input_ids, torch.arange(width) < lengths[:, None])

    def _in_draft_vocabulary(self, state: DraftModelState, input_ids) -> list[torch.LongTensor]:
        """Each row's committed tokens `(1, length_i)` in the draft's vocabulary `(length'_i,)`, on its device."""
        if state.bridge is None:
            return [ids[0].to(state.draft_device) for ids in input_ids]
        draft_ids = [state.bridge.to_draft(ids[0].tolist()) for ids in input_ids]
        if not state.draft_per_target:  # measured once, on the first committed tokens (the prompts)
            state.draft_per_target = sum(map(len, draft_ids)) / sum(ids.shape[1] for ids in input_ids)
        return [torch.tensor(ids, dtype=torch.long, device=state.draft_device) for ids in draft_ids]

    def _pick(self, state: DraftModelState, prefixes, logits) -> tuple[torch.LongTensor, torch.FloatTensor | None]:
        """The next draft token of each row and, when sampling, its distribution (`DraftState.draft_tokens`); in
        the draft's own vocabulary (a translated greedy draft), the argmax of the raw logits."""
        if state.translates_text:  # the call's processors are built for the target's vocabulary
            return logits.argmax(dim=-1), None
        return state.draft_tokens(prefixes, logits)

    @torch.no_grad()
    def propose(self, state: DraftModelState, input_ids, max_tokens, rows) -> list[Draft]:
        """Each row's chain of `max_tokens[i]` draft tokens: one batched draft forward per draft token for the rows
        whose budget asks for another (see `Drafter.propose` for the arguments)."""
        # 1. each row's cache rolled back to what it shares with its committed tokens; the rest fed in one forward
        committed = self._in_draft_vocabulary(state, input_ids)
        new_ids = self._sync(state, committed, rows)
        if self._chains(state, max_tokens, new_ids):
            return self._greedy_chain(state, committed, new_ids, input_ids[0].device)
        logits = self._feed(state, new_ids, input_ids[0].device)  # [rows, width]
        budgets = ([state.bridge.draft_length(budget, state.draft_per_target) if budget else 0
                    for budget in max_tokens] if state.translates_text else max_tokens)
        prefixes = list(input_ids)  # what the logits processors see: target tokens, the drafted ones appended
        fed = [[] for _ in committed]  # the draft tokens fed to the draft cache after each row's committed ones
        last = [ids[-1:] for ids in committed]  # each row's newest token in the draft's vocabulary, `(1,)`
        tokens, probs = [[] for _ in prefixes], [[] for _ in prefixes]
        # 2. one forward per draft token for the rows whose budget asks for another
        for step in range(max(budgets)):
            drafting = [i for i, budget in enumerate(budgets) if step < budget]
            every = len(drafting) == len(prefixes)
            new, new_probs = self._pick(state, [prefixes[i] for i in drafting], logits if every else logits[drafting])
            new_fed = new if state.bridge is None or state.translates_text else state.bridge.vocabulary.to_draft(new)
            for j, i in enumerate(drafting):
                tokens[i].append(new[j])
                probs[i].append(None if new_probs is None else new_probs[j])
                prefixes[i] = torch.cat([prefixes[i], new[j].view(1, 1)], dim=-1)
                fed[i].append(new_fed[j].view(1).to(state.draft_device))
                last[i] = fed[i][-1]
            feeding = [step + 1 < budget for budget in budgets]
            if any(feeding):
                query = Query.chain(torch.stack(last), torch.tensor(feeding)[:, None])
                logits = self._logits(state, query, 1, input_ids[0].device, state.compiled_step)[:, -1]
        # 3. remember what each row of the cache holds: its committed tokens and the draft tokens fed
        state.cached_ids = [torch.cat([ids, *row_fed])[:length]
                            for ids, row_fed, length in zip(committed, fed, state.draft_cache.lengths.tolist())]
        if state.translates_text:
            return [self._translated(state, ids, context, row_tokens, budget)
                    for ids, context, row_tokens, budget in zip(input_ids, committed, tokens, max_tokens)]
        return [Draft.chain(torch.stack(row_tokens), torch.stack(row_probs) if state.do_sample else None)
                if row_tokens else Draft.empty(ids.device)
                for ids, row_tokens, row_probs in zip(input_ids, tokens, probs)]

    def _chains(self, state: DraftModelState, max_tokens, new_ids) -> bool:
        """Whether a step drafts as one compiled greedy chain (`_greedy_chain`): a compiled catch-up (so the target's
        vocabulary: `_compiled_cache`), greedy drafting without logits processors, every row `num_draft_tokens`
        tokens, and every row's catch-up a full query (a row holds at least `catch_up_width` tokens)."""
        return (self._catches_up(state) and not state.do_sample and not state.logits_processor
                and all(budget == self.num_draft_tokens for budget in max_tokens)
                and min(map(len, new_ids)) >= state.catch_up_width)

    def _greedy_chain(self, state: DraftModelState, committed, new_ids, device) -> list[Draft]:
        """Each row's chain of `num_draft_tokens` greedy draft tokens from one compiled call
        (`query.greedy_chain`): the catch-up forward and the chain's forwards in one graph."""
        query = self._catch_up_query(state, new_ids, device)
        tokens = greedy_chain(self.draft_model, state.draft_cache, query, self.num_draft_tokens - 1,
                              state.compiled_chain, state.vocab_size).to(device)  # [rows, num_draft_tokens]
        state.cached_ids = [torch.cat([ids, row[:-1].to(ids.device)]) for ids, row in zip(committed, tokens)]
        return [Draft.chain(row) for row in tokens]

    @staticmethod
    def _translated(state: DraftModelState, input_ids, draft_context, draft_tokens, budget: int) -> Draft:
        """A greedy chain of at most `budget` target tokens: the text of a row's draft tokens, translated by string-
        level exact matching after its committed tokens `input_ids` `(1, length)`."""
        if not draft_tokens:
            return Draft.empty(input_ids.device)
        committed, context = input_ids[0, -LOOKBEHIND:].tolist(), draft_context[-DRAFT_ANCHOR:].tolist()  # all it reads
        target_ids = state.bridge.to_target(committed, context, torch.stack(draft_tokens).tolist())[:budget]
        return Draft.chain(torch.tensor(target_ids, dtype=torch.long, device=input_ids.device))

    def __repr__(self) -> str:
        return f"DraftModelDrafter({type(self.draft_model).__name__}, num_draft_tokens={self.num_draft_tokens})"


DRAFT_MODEL_SPEC = MethodSpec(
    "draft-model", DraftModelDrafter, required=("draft_model",), shared=("draft_revision", "draft_quantization"),
    loads="draft-model", checkpoint=DRAFT_MODEL,
    variants={"draft-model": Variant(), **{f"self-draft-{quantization}": Variant(
        settings={"draft_quantization": quantization}, checkpoint=False) for quantization in QUANTIZATIONS}},
    vllm=VllmMapping("draft_model"), baselines={
        name: Baseline(("num_draft_tokens", "draft_model"),
                       lambda config, target, draft, build: {"assistant_model": draft}, pinned=True, universal=universal)
        for name, universal in (("hf-assisted", False), ("hf-universal-assisted", True))},
)
