"""Batched speculative generate: every row exactly its own plain greedy output, lossless sampling, ragged cache, errors."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LogitsProcessorList, TopKLogitsWarper

import hf_speculators as hs
import hf_speculators.loop as loop
from hf_speculators.cache import RaggedCache
from hf_speculators.query import Query, forward
from batch_helpers import MAX_NEW_TOKENS, PAD, batched_generate, laid_out, left_padded, two_token_joint
from speculative_helpers import PROMPTS, cache_kwargs, plain_generate, prompt_ids
from test_lossless import AlwaysAcceptVerifier, chi_square, chi_square_critical
from tiny_models import ARCHS, SLIDING_WINDOW, VOCAB_SIZE, make_config

BATCH_PROMPTS = ("random", "one_token", "repetitive")  # 8, 1 and 9 tokens: every row is padded but the last


def prompt_tokens(names) -> list[tuple[int, ...]]:
    return [PROMPTS[name] for name in names]


def expected_batch(zoo, arch: str, names, **kwargs) -> torch.LongTensor:
    """Each row's own unbatched plain greedy output, laid out as plain batched `generate` lays rows out."""
    return laid_out(prompt_tokens(names), [zoo.reference(arch, name, **kwargs)[0].tolist() for name in names])


def batched(model, drafter, names=BATCH_PROMPTS, **kwargs):
    return batched_generate(model, drafter, prompt_tokens(names), **kwargs)


class RowScriptedDrafter(hs.Drafter):
    """Drafts each row's reference continuation with row i's first `i % (k + 1)` tokens right and the rest wrong,
    so rows accept different numbers of draft tokens every step (the ragged case)."""

    name = "row-scripted-test"

    def __init__(self, references: list[list[int]], num_draft_tokens: int):
        super().__init__(num_draft_tokens)
        self.references = references

    def propose(self, state, input_ids, max_tokens, rows):
        drafts = []
        for ids, budget, row in zip(input_ids, max_tokens, rows):
            future = self.references[row][ids.shape[1] : ids.shape[1] + budget]
            num_correct = row % (self.num_draft_tokens + 1)
            tokens = [t if i < num_correct else (t + 1) % (VOCAB_SIZE - 1) for i, t in enumerate(future)]
            drafts.append(hs.Draft.chain(torch.tensor(tokens, dtype=torch.long)))
        return drafts


def scripted(zoo, arch: str, names, num_draft_tokens: int, **kwargs) -> RowScriptedDrafter:
    references = [zoo.reference(arch, name, **kwargs)[0].tolist() for name in names]
    return RowScriptedDrafter(references, num_draft_tokens)


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
@pytest.mark.parametrize("kind", ["prompt_lookup", "scripted"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_row_is_its_own_plain_greedy_output(zoo, arch, kind, num_draft_tokens):
    names = BATCH_PROMPTS + ("random",)  # a repeated prompt too
    drafter = (hs.PromptLookupDrafter(num_draft_tokens) if kind == "prompt_lookup"
               else scripted(zoo, arch, names, num_draft_tokens, max_new_tokens=MAX_NEW_TOKENS))
    out = batched(zoo.target(arch), drafter, names)
    assert torch.equal(out.sequences, expected_batch(zoo, arch, names, max_new_tokens=MAX_NEW_TOKENS))
    if kind == "scripted":  # rows accepted 0, 1, ... draft tokens per step: the cache really was ragged
        accepted = [row.num_accepted_tokens for row in out.speculative_stats.row_stats]
        assert accepted[0] == 0 and len(set(accepted)) >= min(3, num_draft_tokens + 1), accepted


def eos_in_reference(zoo, arch: str, name: str, position: int) -> int:
    """The token that `name`'s plain greedy output generates at `position` (new tokens counted from 0)."""
    return int(zoo.reference(arch, name, max_new_tokens=MAX_NEW_TOKENS)[0, len(PROMPTS[name]) + position])


@pytest.mark.parametrize("kind", ["prompt_lookup", "scripted"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_rows_stop_at_their_own_eos(zoo, arch, kind):
    eos = eos_in_reference(zoo, arch, "random", 4)  # the first row stops early; others may never meet it
    drafter = (hs.PromptLookupDrafter(4) if kind == "prompt_lookup"
               else scripted(zoo, arch, BATCH_PROMPTS, 4, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos))
    out = batched(zoo.target(arch), drafter, eos_token_id=eos)
    expected = expected_batch(zoo, arch, BATCH_PROMPTS, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    lengths = [row.num_generated_tokens for row in out.speculative_stats.row_stats]
    assert lengths[0] <= 5 and len(set(lengths)) > 1  # rows did stop at different steps


def test_stop_strings_stop_each_row(zoo, fresh_target, tokenizer):
    hs.enable(fresh_target)
    no_stop = zoo.reference("llama", "repetitive", max_new_tokens=MAX_NEW_TOKENS)[0]
    start = len(PROMPTS["repetitive"]) + 3
    stop_string = "".join(tokenizer.convert_ids_to_tokens(no_stop[start : start + 2].tolist()))
    input_ids, attention_mask = left_padded(prompt_tokens(BATCH_PROMPTS))
    settings = dict(attention_mask=attention_mask, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, pad_token_id=PAD,
                    stop_strings=[stop_string], tokenizer=tokenizer)
    out = fresh_target.generate(input_ids, candidate_generator=hs.PromptLookupDrafter(3), **settings)
    expected = [plain_generate(zoo.target("llama"), prompt_ids(name), stop_strings=[stop_string], tokenizer=tokenizer,
                               max_new_tokens=MAX_NEW_TOKENS)[0] for name in BATCH_PROMPTS]
    assert len(expected[2]) <= start + 2  # the repetitive row did stop at the string
    for row, (name, reference) in enumerate(zip(BATCH_PROMPTS, expected)):
        pad = input_ids.shape[1] - len(PROMPTS[name])
        assert out[row, pad : pad + len(reference)].tolist() == reference.tolist()
        assert set(out[row, pad + len(reference):].tolist()) <= {PAD}


def test_rows_of_equal_length_need_no_mask(zoo):
    names = ("random", "random")
    input_ids = torch.tensor([PROMPTS["random"]] * 2)
    out = zoo.target("llama").generate(input_ids, custom_generate=hs.generate, max_new_tokens=MAX_NEW_TOKENS,
                                       candidate_generator=hs.PromptLookupDrafter(3), do_sample=False, pad_token_id=PAD)
    assert torch.equal(out, expected_batch(zoo, "llama", names, max_new_tokens=MAX_NEW_TOKENS))


def test_compacting_every_step_changes_nothing(zoo, monkeypatch):
    """`max_holes=0` realigns the rows after every step (the gather path); the output must not change."""
    monkeypatch.setattr(loop, "RaggedCache", lambda cache, valid, max_holes, **kwargs: RaggedCache(cache, valid, 0, **kwargs))
    drafter = scripted(zoo, "llama", BATCH_PROMPTS, 4, max_new_tokens=MAX_NEW_TOKENS)
    out = batched(zoo.target("llama"), drafter)
    assert torch.equal(out.sequences, expected_batch(zoo, "llama", BATCH_PROMPTS, max_new_tokens=MAX_NEW_TOKENS))


def test_finished_rows_leave_the_batch(zoo):
    """After a row stops, the target's forwards carry only the running rows."""
    eos = eos_in_reference(zoo, "llama", "random", 2)
    batch_sizes = []
    model = zoo.target("llama")
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: batch_sizes.append(
        kwargs["input_ids"].shape[0]), with_kwargs=True)
    try:
        out = batched(model, hs.PromptLookupDrafter(3), eos_token_id=eos)
    finally:
        handle.remove()
    assert batch_sizes[0] == 3 and batch_sizes[-1] < 3, batch_sizes
    assert out.speculative_stats.num_target_forwards == len(batch_sizes)


def test_stats_per_row_add_up(zoo):
    out = batched(zoo.target("llama"), scripted(zoo, "llama", BATCH_PROMPTS, 3, max_new_tokens=MAX_NEW_TOKENS))
    stats, rows = out.speculative_stats, out.speculative_stats.row_stats
    assert len(rows) == 3 and all(row.num_generated_tokens == MAX_NEW_TOKENS for row in rows)
    for name in ("num_steps", "num_drafts", "num_drafted_tokens", "num_accepted_tokens", "num_generated_tokens"):
        assert getattr(stats, name) == sum(getattr(row, name) for row in rows), name
    assert stats.to_dict()["row_stats"][1]["num_accepted_tokens"] == rows[1].num_accepted_tokens


# ---------------------------------------------------------------- the ragged cache itself


def test_compaction_keeps_every_rows_next_logits(zoo):
    """Rows with holes in the middle and at the end: compacting must not change what the next token sees."""
    model = zoo.target("llama")
    ids = torch.arange(5, 20).view(3, 5)
    ragged = RaggedCache(DynamicCache(config=model.config), torch.zeros(3, 0, dtype=torch.bool), max_holes=10**6)
    forward(model, ragged, Query.chain(ids, torch.ones(3, 5, dtype=torch.bool)))
    ragged.append(torch.arange(5) < torch.tensor([[2], [4], [5]]))  # rows keep 2, 4 and 5 of 5 slots
    forward(model, ragged, Query.chain(ids[:, :3], torch.ones(3, 3, dtype=torch.bool)))
    ragged.append(torch.arange(3) < torch.tensor([[1], [3], [2]]))
    assert ragged.lengths.tolist() == [3, 7, 7] and ragged.valid.shape[1] == 8  # holes inside every row but one
    next_ids, one = torch.tensor([[20], [21], [22]]), torch.ones(3, 1, dtype=torch.bool)
    before = forward(model, ragged, Query.chain(next_ids, one))
    ragged.append(torch.zeros(3, 1, dtype=torch.bool))  # forget that forward
    ragged.compact()
    assert ragged.valid.shape[1] == 7 and ragged.valid.sum().item() == 17
    after = forward(model, ragged, Query.chain(next_ids, one))
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    # and both equal the rows decoded alone
    alone = [model(torch.tensor([seq])).logits[0, -1]
             for seq in ([5, 6, 5, 20], [10, 11, 12, 13, 10, 11, 12, 21], [15, 16, 17, 18, 19, 15, 16, 22])]
    torch.testing.assert_close(after[:, -1], torch.stack(alone), rtol=1e-5, atol=1e-5)


def test_truncate_and_select_rows(zoo):
    model = zoo.target("llama")
    ragged = RaggedCache(DynamicCache(config=model.config), torch.zeros(3, 0, dtype=torch.bool))
    forward(model, ragged, Query.chain(torch.arange(12).view(3, 4), torch.ones(3, 4, dtype=torch.bool)))
    ragged.append(torch.ones(3, 4, dtype=torch.bool))
    ragged.truncate(torch.tensor([4, 2, 3]))
    assert ragged.lengths.tolist() == [4, 2, 3]
    ragged.select(torch.tensor([1, 2]))
    assert ragged.lengths.tolist() == [2, 3] and ragged.valid.shape[1] == 3  # the all-hole slot was cropped
    assert ragged.cache.get_seq_length() == 3 and ragged.cache.layers[0].keys.shape[0] == 2
    assert ragged.rows == [1, 2] and ragged.keep_rows([1, 2]) == [0, 1]  # rows keep their batch index
    logits = forward(model, ragged, Query.chain(torch.tensor([[50], [51]]), torch.ones(2, 1, dtype=torch.bool)))
    alone = [model(torch.tensor([seq])).logits[0, -1] for seq in ([4, 5, 50], [8, 9, 10, 51])]
    torch.testing.assert_close(logits[:, -1], torch.stack(alone), rtol=1e-5, atol=1e-5)
    assert ragged.keep_rows([2]) == [1] and ragged.rows == [2] and ragged.lengths.tolist() == [3]


# ---------------------------------------------------------------- lossless sampling

TOP_K = 3
SAMPLING_PROMPTS = ("repetitive", "random")  # two prompts: rows mixed up would show


def exact_two_token_distribution(model, name: str) -> torch.Tensor:
    """`(vocab, vocab)` P(x1, x2) of plain top-3 sampling after prompt `name`."""
    return two_token_joint(model, prompt_ids(name), LogitsProcessorList([TopKLogitsWarper(TOP_K)]))


def chi_square_ratio(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over the cells of nonzero probability over its upper 0.1% quantile (pass below 1)."""
    return chi_square(counts, probs) / chi_square_critical(int((probs > 0).sum()) - 1)


class TargetGreedyDrafter(hs.Drafter):
    """Drafts each row's greedy continuation by the target itself: often accepted under top-3 sampling, not always."""

    name = "target-greedy-test"

    def __init__(self, model, num_draft_tokens: int):
        super().__init__(num_draft_tokens)
        self.model = model

    def propose(self, state, input_ids, max_tokens, rows):
        return [hs.Draft.chain(plain_generate(self.model, ids, max_new_tokens=budget)[0, ids.shape[1]:])
                for ids, budget in zip(input_ids, max_tokens)]


def sampled_counts(model, names, verifier=None, drafter=None) -> tuple[dict, int]:
    """Counts of each prompt's first two sampled tokens over 40 batched calls, and the draft tokens accepted
    (`drafter`: one drafter for every call; default a `TargetGreedyDrafter` drafting 3 tokens)."""
    counts = {name: torch.zeros(VOCAB_SIZE, VOCAB_SIZE) for name in set(names)}
    generator = torch.Generator().manual_seed(0)
    input_ids, attention_mask = left_padded(prompt_tokens(names))
    accepted = 0
    for _ in range(40):
        out = model.generate(input_ids, attention_mask=attention_mask, custom_generate=hs.generate,
                             candidate_generator=drafter or TargetGreedyDrafter(model, 3), do_sample=True,
                             top_k=TOP_K, max_new_tokens=2, pad_token_id=PAD, generator=generator,
                             verifier=verifier, return_dict_in_generate=True)
        accepted += out.speculative_stats.num_accepted_tokens
        for row, name in enumerate(names):
            counts[name][tuple(out.sequences[row, -2:].tolist())] += 1
    return counts, accepted


def test_batched_rejection_sampling_is_lossless(zoo):
    """Rows alternate two prompts; each row's first two tokens must follow its own prompt's distribution."""
    model, names = zoo.target("llama"), SAMPLING_PROMPTS * 16
    counts, accepted = sampled_counts(model, names)
    assert 100 < accepted < 40 * len(names)  # drafts were accepted and rejected: both paths ran
    for name in SAMPLING_PROMPTS:
        assert chi_square_ratio(counts[name], exact_two_token_distribution(model, name)) < 1, name


def test_the_sampling_test_catches_a_lossy_verifier(zoo):
    """The same statistic fails by far for a verifier that keeps every draft token (not lossless)."""
    model, names = zoo.target("llama"), SAMPLING_PROMPTS * 16
    counts, _ = sampled_counts(model, names, verifier=AlwaysAcceptVerifier())
    assert all(chi_square_ratio(counts[name], exact_two_token_distribution(model, name)) > 5
               for name in SAMPLING_PROMPTS)


# ---------------------------------------------------------------- errors, all before any forward


BATCH_ERRORS = {
    "right_padding": (dict(attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]])), r"needs left-padded prompts"),
    "holes": (dict(attention_mask=torch.tensor([[1, 0, 1], [1, 1, 1]])), r"needs left-padded prompts"),
    "empty_row": (dict(attention_mask=torch.tensor([[0, 0, 0], [1, 1, 1]])), r"each with at least one token"),
    "streamer": (dict(speculative_streamer=object()), r"A streamer takes one sequence"),
    "scores": (dict(output_scores=True, return_dict_in_generate=True), r"output_scores and output_logits"),
    "no_pad": (dict(pad_token_id=None), r"needs pad_token_id"),
    "num_return_sequences": (dict(num_return_sequences=2, do_sample=True),
                             r"num_return_sequences=2 is not supported: .* repeat the prompt in the batch"),
}


@pytest.mark.parametrize("case", BATCH_ERRORS)
def test_batch_errors_come_before_any_forward(zoo, case):
    kwargs, message = BATCH_ERRORS[case]
    kwargs = {"candidate_generator": hs.PromptLookupDrafter(3), "pad_token_id": PAD, "max_new_tokens": 4, **kwargs}
    model = zoo.target("llama")
    forwards = []
    handle = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            model.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), custom_generate=hs.generate, **kwargs)
    finally:
        handle.remove()
    assert forwards == []


@pytest.mark.parametrize("case", ["sliding_window", "prefilled_cache"])
def test_batch_cache_errors(zoo, case):
    if case == "sliding_window":
        model, kwargs, message = zoo.target("qwen2_sliding"), {}, r"needs full-attention cache layers"
    else:
        model = zoo.target("llama")
        cache = DynamicCache(config=model.config)
        model(torch.tensor([[1, 2], [3, 4]]), **cache_kwargs(model, cache))
        kwargs, message = cache_kwargs(model, cache), r"needs an empty cache"
    with pytest.raises(ValueError, match=message):
        model.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), custom_generate=hs.generate, pad_token_id=PAD,
                       candidate_generator=hs.PromptLookupDrafter(3), max_new_tokens=4, **kwargs)


def allow_by_row(batch_id: int, input_ids: torch.LongTensor) -> list[int]:
    """prefix_allowed_tokens_fn: each row its own set of tokens (only right when a row is seen at its place)."""
    return list(range(batch_id * 20, batch_id * 20 + 40))


@pytest.mark.parametrize("processor", ["repetition_penalty", "prefix_allowed_tokens_fn"])
@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model"])
def test_processors_with_state_per_row_match_plain_batched_generate(zoo, processor, kind):
    """transformers builds these two for the whole batch (per-row padding lengths, batch_id); each row must get
    its own, as in plain batched generate."""
    model = zoo.target("llama")
    settings = {"repetition_penalty": 1.5} if processor == "repetition_penalty" else {
        "prefix_allowed_tokens_fn": allow_by_row}
    input_ids, attention_mask = left_padded(prompt_tokens(BATCH_PROMPTS))
    expected = model.generate(input_ids, attention_mask=attention_mask, do_sample=False, pad_token_id=PAD,
                              max_new_tokens=MAX_NEW_TOKENS, **settings)
    drafter = (hs.PromptLookupDrafter(3) if kind == "prompt_lookup"
               else hs.DraftModelDrafter(zoo.noisy_draft("llama"), num_draft_tokens=3))
    out = batched(model, drafter, **settings)
    assert torch.equal(out.sequences, expected)
    if kind == "draft_model":  # drafts were accepted: the draft side's processors ran too
        assert out.speculative_stats.num_accepted_tokens > 0


# ---------------------------------------------------------------- sliding windows with a passed full-attention cache


def sliding_model(window: int):
    """A tiny Qwen2 whose layer 1 attends to the last `window` tokens (seed of the zoo's targets)."""
    config = make_config("qwen2_sliding", 48, 2)
    config.sliding_window = window
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.bos_token_id = model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("full_masks", [True, False], ids=["4d_masks", "control_2d_masks"])
def test_a_passed_full_attention_cache_serves_a_sliding_window_model_exactly(monkeypatch, full_masks):
    """`cache=DynamicCache()` holds full-attention layers for a sliding-window model. Its window covers max_length, but
    the rows' slots (holes included) outgrow it: the model's own window over a 2D mask counts holes and hides a
    row's earlier tokens (the control diverges), so the loop gives 4D masks of each row's tokens."""
    prompts = prompt_tokens(BATCH_PROMPTS)
    model = sliding_model(max(map(len, prompts)) + MAX_NEW_TOKENS)  # = max_length
    references = [plain_generate(model, torch.tensor([p]), max_new_tokens=MAX_NEW_TOKENS)[0].tolist() for p in prompts]
    if not full_masks:
        monkeypatch.setattr(loop, "RaggedCache", lambda *args, full_masks, **kwargs: RaggedCache(*args, **kwargs))
    out = batched_generate(model, RowScriptedDrafter(references, 4), prompts, **cache_kwargs(model, DynamicCache()))
    assert torch.equal(out.sequences, laid_out(prompts, references)) == full_masks


@pytest.mark.parametrize("case", ["batch", "tree", "layer_skip"])
def test_a_sliding_window_shorter_than_max_length_is_refused_with_a_full_attention_cache(zoo, case):
    model, ids = zoo.target("qwen2_sliding"), prompt_ids("random")
    drafter = {"batch": hs.PromptLookupDrafter(3), "tree": hs.PromptLookupDrafter(3, num_candidates=2),
               "layer_skip": hs.LayerSkipDrafter(exit_layer=1)}[case]
    what = {"batch": "Speculative generate with batch size > 1", "tree": "A token tree", "layer_skip": "Layer skip"}
    ids = ids.expand(2, -1) if case == "batch" else ids
    with pytest.raises(ValueError, match=rf"{what[case]} attends over every cached token, and this model's "
                                         rf"sliding-window layers see only the last {SLIDING_WINDOW} tokens"):
        model.generate(ids, custom_generate=hs.generate, candidate_generator=drafter, max_new_tokens=8,
                       pad_token_id=PAD, **cache_kwargs(model, DynamicCache()))
