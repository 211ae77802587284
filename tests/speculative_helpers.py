"""Small helpers shared by the tests: prompts, generate wrappers, drafter factory, assertions."""

import contextlib
import logging

import torch
from transformers.utils import logging as transformers_logging

import hf_speculators as hs
from drafters_for_tests import AdversaryDrafter, OracleDrafter, ScriptedDrafter
from hf_speculators.cache import cache_argument
from hf_speculators.outputs import CACHE_FIELD

PROMPTS = {
    "random": (17, 83, 4, 52, 91, 30, 66, 8),
    "repetitive": (12, 40, 7, 12, 40, 7, 25, 12, 40),
    "one_token": (33,),
}
DRAFTER_KINDS = ("prompt_lookup", "draft_model", "noisy_draft_model", "oracle", "adversary", "scripted")
NUM_DRAFT_TOKENS = (1, 2, 5, 8)
MAX_NEW_TOKENS = 24


def prompt_ids(name: str) -> torch.LongTensor:
    return torch.tensor([PROMPTS[name]], dtype=torch.long)


def plain_generate(model, input_ids, **kwargs):
    """transformers' own decoding (greedy unless `do_sample=True` is given)."""
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("max_new_tokens", MAX_NEW_TOKENS)
    return model.generate(input_ids, **kwargs)


def speculative_generate(model, input_ids, drafter, **kwargs):
    """hf_speculators through transformers' `custom_generate` entry point."""
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("max_new_tokens", MAX_NEW_TOKENS)
    return model.generate(input_ids, custom_generate=hs.generate, candidate_generator=drafter, **kwargs)


def make_drafter(kind: str, num_draft_tokens: int, zoo, arch: str, *, reference=None,
                 num_correct: int | None = None) -> hs.Drafter:
    """A drafter of kind `kind` (one of `DRAFTER_KINDS`) for `zoo.target(arch)`.

    "draft_model" drafts with a small random model (its drafts are nearly always rejected), "noisy_draft_model"
    with a perturbed copy of the target (partly accepted). The test drafters continue `reference`; a scripted
    drafter gets `num_correct` right tokens per step, by default `num_draft_tokens // 2`.
    """
    if kind == "prompt_lookup":
        return hs.PromptLookupDrafter(num_draft_tokens=num_draft_tokens)
    if kind == "draft_model":
        return hs.DraftModelDrafter(zoo.draft(arch), num_draft_tokens=num_draft_tokens)
    if kind == "noisy_draft_model":
        return hs.DraftModelDrafter(zoo.noisy_draft(arch), num_draft_tokens=num_draft_tokens)
    if kind == "oracle":
        return OracleDrafter(reference, num_draft_tokens)
    if kind == "adversary":
        return AdversaryDrafter(reference, num_draft_tokens)
    if kind == "scripted":
        num_correct = num_draft_tokens // 2 if num_correct is None else num_correct
        return ScriptedDrafter(reference, num_draft_tokens, num_correct=num_correct)
    raise ValueError(f"unknown drafter kind {kind!r}")


def output_cache(output):
    """The cache a model or generate output carries, under the installed release's field (`cache` from 5.24 on)."""
    return getattr(output, CACHE_FIELD)


def cache_kwargs(model, cache) -> dict:
    """`cache` as the keyword argument `model`'s forward and generate take it in the installed release."""
    return {cache_argument(model): cache}


def assert_same_tokens(actual: torch.LongTensor, expected: torch.LongTensor) -> None:
    """Token-for-token equality, reported as lists so a failure shows where the outputs diverge."""
    assert actual.reshape(-1).tolist() == expected.reshape(-1).tolist()


def assert_cache_matches_sequence(output) -> None:
    """After generate, the cache holds every token but the last (the next forward's input)."""
    assert output_cache(output).get_seq_length() == output.sequences.shape[1] - 1


def check_exact(zoo, arch: str, prompt: str, kind: str, num_draft_tokens: int, *, num_correct: int | None = None,
                floor: bool = True, **generate_kwargs):
    """Runs speculative greedy decoding and asserts it equals plain greedy `generate` with the same settings
    (`floor=False`: without the plain-speed floor, for tests that count what the drafter proposed every step).

    Returns the speculative output (with `speculative_stats`) and the drafter.
    """
    expected = zoo.reference(arch, prompt, **generate_kwargs)
    drafter = make_drafter(kind, num_draft_tokens, zoo, arch, reference=expected, num_correct=num_correct)
    output = speculative_generate(zoo.target(arch), prompt_ids(prompt), drafter, return_dict_in_generate=True,
                                  plain_floor=floor, **generate_kwargs)
    assert_same_tokens(output.sequences, expected)
    assert_cache_matches_sequence(output)
    return output, drafter


def generated_token(zoo, arch: str, prompt: str, position: int) -> int:
    """The token plain greedy decoding (no EOS) produces at 0-based generated position `position`."""
    return int(zoo.reference(arch, prompt)[0, len(PROMPTS[prompt]) + position])


@contextlib.contextmanager
def recording_forward_lengths(model):
    """Yields a list that receives the `input_ids` length of every forward of `model` inside the block."""
    lengths = []

    def hook(module, args, kwargs):
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        lengths.append(input_ids.shape[-1])

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield lengths
    finally:
        handle.remove()


@contextlib.contextmanager
def transformers_warnings():
    """Collects what transformers logs at WARNING and above (its `warning_once` memory cleared first, so that a
    warning an earlier test caused shows again)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = transformers_logging.get_logger("transformers")
    logging.Logger.warning_once.cache_clear()
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
