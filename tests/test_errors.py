"""Every unsupported input fails before decoding with a ValueError that says what to change."""

import pytest
import torch

import hf_speculators as hs
from speculative_helpers import PROMPTS, prompt_ids, speculative_generate
from tiny_models import build_draft, build_target, build_tokenizer

PROMPT_LENGTH = len(PROMPTS["random"])


def speculative_call(zoo, drafter=None, input_ids=None, **kwargs):
    drafter = hs.PromptLookupDrafter(3) if drafter is None else drafter
    input_ids = prompt_ids("random") if input_ids is None else input_ids
    return speculative_generate(zoo.target("llama"), input_ids, drafter, max_new_tokens=5, **kwargs)


def padding_mask(first: int = 1, last: int = 1) -> torch.Tensor:
    return torch.tensor([[first] + [1] * (PROMPT_LENGTH - 2) + [last]])


GENERATE_ERRORS = {
    "beams": (dict(num_beams=2), r"Beam search \(num_beams=2\) is not supported"),
    "num_return_sequences": (dict(num_return_sequences=2, do_sample=True), r"num_return_sequences=2 is not supported"),
    # rejected by transformers' GenerationConfig validation before our code runs; its message is clear
    "num_return_sequences_greedy": (dict(num_return_sequences=2), r"do not support `num_return_sequences`"),
    "empty_prompt": (dict(input_ids=torch.empty(1, 0, dtype=torch.long)), r"The prompt is empty"),
    "float_input_ids": (dict(input_ids=torch.tensor([[1.0, 2.0, 3.0]])),
                        r"input_ids must hold integer token ids \(torch.long\); got dtype torch.float32"),
    "exact_with_sampling": (dict(verifier="exact", do_sample=True), r"verifier='exact' .* cannot sample"),
    "unknown_verifier": (dict(verifier="typo"),
                         r"Unknown verifier 'typo'. Choose one of \['exact', 'rejection', 'top_k', 'typical'\]"),
    "verifier_not_a_verifier": (dict(verifier=42), r"verifier= must be a name from .* or a Verifier, got int"),
    "padded_left": (dict(attention_mask=padding_mask(first=0)), r"attention mask has padding"),
    "padded_right": (dict(attention_mask=padding_mask(last=0)), r"attention mask has padding"),
}


@pytest.mark.parametrize("case", GENERATE_ERRORS)
def test_generate_rejects(zoo, case):
    kwargs, message = GENERATE_ERRORS[case]
    with pytest.raises(ValueError, match=message):
        speculative_call(zoo, **kwargs)


@pytest.mark.parametrize("candidate_generator", [None, "prompt-lookup", object()], ids=["none", "name", "object"])
def test_generate_needs_a_drafter(zoo, candidate_generator):
    with pytest.raises(ValueError, match=r"needs candidate_generator= set to a drafter"):
        zoo.target("llama").generate(prompt_ids("random"), custom_generate=hs.generate,
                                     candidate_generator=candidate_generator, max_new_tokens=5)


def test_errors_come_before_any_forward(zoo):
    forwards = []
    handle = zoo.target("llama").register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        with pytest.raises(ValueError):
            speculative_call(zoo, verifier="typo")
    finally:
        handle.remove()
    assert forwards == []


@pytest.mark.parametrize("num_draft_tokens", [0, -1, 1.5, True, "3"])
@pytest.mark.parametrize("drafter", ["prompt_lookup", "draft_model"])
def test_num_draft_tokens_must_be_a_positive_int(zoo, drafter, num_draft_tokens):
    with pytest.raises(ValueError, match=r"num_draft_tokens must be an integer >= 1, got"):
        if drafter == "prompt_lookup":
            hs.PromptLookupDrafter(num_draft_tokens=num_draft_tokens)
        else:
            hs.DraftModelDrafter(zoo.draft("llama"), num_draft_tokens=num_draft_tokens)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(min_ngram_size=3, max_ngram_size=2), r"Need 1 <= min_ngram_size <= max_ngram_size"),
        (dict(min_ngram_size=0), r"Need 1 <= min_ngram_size <= max_ngram_size"),
        (dict(prefer="newest"), r"prefer must be one of \('latest', 'earliest'\)"),
    ],
)
def test_prompt_lookup_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hs.PromptLookupDrafter(**kwargs)


def test_draft_model_with_another_vocabulary_size(zoo):
    drafter = hs.DraftModelDrafter(build_draft("llama", vocab_size=128), num_draft_tokens=3)
    with pytest.raises(ValueError, match=r"draft model has a vocabulary of 128 tokens and the target of 96"):
        speculative_call(zoo, drafter)


def test_draft_model_with_another_tokenizer_is_translated(zoo, tokenizer):
    """A draft tokenizer whose vocabulary differs (here: the same characters in another order) is no error: the
    drafter translates through text (tests/test_tokenizers.py), and the output stays plain greedy."""
    shuffled = build_tokenizer(characters=list(reversed(build_tokenizer().convert_ids_to_tokens(list(range(94))))))
    drafter = hs.DraftModelDrafter(zoo.draft("llama"), num_draft_tokens=3, draft_tokenizer=shuffled)
    model = hs.enable(build_target("llama"))
    out = model.generate(prompt_ids("random"), candidate_generator=drafter, tokenizer=tokenizer, max_new_tokens=5)
    assert torch.equal(out, model.generate(prompt_ids("random"), do_sample=False, max_new_tokens=5))


def test_padded_draft_vocabulary_is_allowed_with_equal_tokenizers(zoo, tokenizer):
    """Logits widths may differ by unused padding rows (Qwen2.5 0.5B vs 7B) when both tokenizers are equal."""
    padded_draft = build_draft("llama", vocab_size=128)
    drafter = hs.DraftModelDrafter(padded_draft, num_draft_tokens=3, draft_tokenizer=build_tokenizer())
    out = speculative_call(zoo, drafter, target_tokenizer=tokenizer, return_dict_in_generate=True)
    assert out.sequences.shape[1] == PROMPT_LENGTH + 5
    assert out.speculative_stats.num_drafted_tokens > 0
    # without the tokenizers the sizes cannot be reconciled
    with pytest.raises(ValueError, match=r"vocabulary of 128 tokens"):
        speculative_call(zoo, hs.DraftModelDrafter(padded_draft, num_draft_tokens=3))


NEEDS_A_DRAFTER = r"verifier=, generator= and num_draft_tokens_schedule= need candidate_generator="


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stop_strings=["ab"]), r"stop_strings= needs tokenizer="),
        (dict(verifier="exact"), NEEDS_A_DRAFTER),
        (dict(generator=torch.Generator()), NEEDS_A_DRAFTER),
        (dict(num_draft_tokens_schedule="goodput"), NEEDS_A_DRAFTER),
    ],
)
def test_enable_wrapper_errors(kwargs, message):
    model = hs.enable(build_target("llama"))
    if "stop_strings" in kwargs:
        kwargs["candidate_generator"] = hs.PromptLookupDrafter(3)
    with pytest.raises(ValueError, match=message):
        model.generate(prompt_ids("random"), max_new_tokens=5, **kwargs)
