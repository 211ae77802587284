"""The ways in: `custom_generate=hs.generate`, `hs.enable(model)`, and the `CandidateGenerator` protocol."""

import json

import pytest
import torch
from transformers import (
    GenerationConfig,
    StoppingCriteria,
    StoppingCriteriaList,
    TextIteratorStreamer,
)
from transformers.generation.streamers import BaseStreamer

import hf_speculators as hs
from drafters_for_tests import OracleDrafter
from speculative_helpers import (
    MAX_NEW_TOKENS,
    PROMPTS,
    assert_same_tokens,
    generated_token,
    make_drafter,
    plain_generate,
    prompt_ids,
    speculative_generate,
)
from tiny_models import ARCHS, build_target

PROMPT = "random"
PROMPT_LENGTH = len(PROMPTS[PROMPT])


class RecordingStreamer(BaseStreamer):
    """Records every `put` (as a list of token lists) and every `end`, in order."""

    def __init__(self):
        self.events: list = []

    def put(self, value):
        assert value.device.type == "cpu"
        self.events.append(value.tolist())

    def end(self):
        self.events.append("end")

    @property
    def prompt(self) -> list[int]:
        return self.events[0][0]  # the prompt comes as a (1, length) batch

    @property
    def streamed_tokens(self) -> list[int]:
        """The tokens after the prompt, in the order they were put, each put flattened."""
        return [t for event in self.events[1:-1] for t in torch.tensor(event).reshape(-1).tolist()]


class StopAtToken(StoppingCriteria):
    """A user stopping criterion: stop once `token` has been generated."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.fixture
def enabled_target(fresh_target):
    return hs.enable(fresh_target)


def enabled(arch: str):
    return hs.enable(build_target(arch))


# ---------------------------------------------------------------- the two entry points


@pytest.mark.parametrize("arch", ARCHS)
def test_enable_and_custom_generate_give_plain_greedy_output(zoo, arch):
    expected = zoo.reference(arch, PROMPT)
    via_custom = speculative_generate(zoo.target(arch), prompt_ids(PROMPT), hs.PromptLookupDrafter(4))
    via_enable = enabled(arch).generate(prompt_ids(PROMPT), candidate_generator=hs.PromptLookupDrafter(4),
                                        max_new_tokens=MAX_NEW_TOKENS)
    assert_same_tokens(via_custom, expected)
    assert_same_tokens(via_enable, expected)


def test_plain_generate_still_works_after_enable(zoo, enabled_target):
    out = enabled_target.generate(prompt_ids(PROMPT), max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True)
    assert_same_tokens(out.sequences, zoo.reference("llama", PROMPT))
    assert not hasattr(out, "speculative_stats")  # transformers' own decoding ran


def test_custom_generate_still_works_after_enable(zoo, enabled_target):
    """Both documented call styles must work on an enabled model (library code may use the custom_generate one)."""
    out = speculative_generate(enabled_target, prompt_ids(PROMPT), hs.PromptLookupDrafter(4))
    assert_same_tokens(out, zoo.reference("llama", PROMPT))


def test_enable_is_idempotent_and_per_instance(zoo, enabled_target):
    wrapped = enabled_target.generate
    assert hs.enable(enabled_target) is enabled_target
    assert enabled_target.generate is wrapped  # not wrapped twice
    # another instance of the same class is untouched: transformers rejects the unknown keyword
    with pytest.raises(ValueError, match="candidate_generator"):
        zoo.target("llama").generate(prompt_ids(PROMPT), candidate_generator=hs.PromptLookupDrafter(4),
                                     max_new_tokens=4)


# ---------------------------------------------------------------- streamer


def stream(generate, **kwargs) -> RecordingStreamer:
    streamer = RecordingStreamer()
    generate(prompt_ids(PROMPT), max_new_tokens=MAX_NEW_TOKENS, **kwargs, streamer=streamer)
    return streamer


@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model", "noisy_draft_model", "oracle"])
@pytest.mark.parametrize("eos_position", [None, 4], ids=["no_eos", "eos"])
def test_streamer_gets_prompt_then_each_token_once(zoo, enabled_target, kind, eos_position):
    settings = {} if eos_position is None else dict(eos_token_id=generated_token(zoo, "llama", PROMPT, eos_position))
    expected = zoo.reference("llama", PROMPT, **settings)[0].tolist()
    # the oracle continues the no-EOS output: with an EOS its drafts run past it
    drafter = make_drafter(kind, 5, zoo, "llama", reference=zoo.reference("llama", PROMPT))
    streamer = stream(enabled_target.generate, candidate_generator=drafter, **settings)
    assert streamer.prompt == expected[:PROMPT_LENGTH]
    assert streamer.streamed_tokens == expected[PROMPT_LENGTH:]
    assert streamer.events[-1] == "end" and streamer.events.count("end") == 1
    # same tokens as transformers' own streaming (which puts one token at a time)
    plain = stream(zoo.target("llama").generate, **settings)
    assert plain.streamed_tokens == streamer.streamed_tokens


def test_speculative_streamer_through_custom_generate(zoo):
    streamer = RecordingStreamer()
    speculative_generate(zoo.target("llama"), prompt_ids(PROMPT), hs.PromptLookupDrafter(4),
                         speculative_streamer=streamer)
    expected = zoo.reference("llama", PROMPT)[0].tolist()
    assert streamer.prompt == expected[:PROMPT_LENGTH]
    assert streamer.streamed_tokens == expected[PROMPT_LENGTH:]
    assert streamer.events.count("end") == 1


# ---------------------------------------------------------------- stop strings and stopping criteria


@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model", "noisy_draft_model", "oracle"])
def test_stop_strings_stop_where_plain_generate_stops(zoo, enabled_target, tokenizer, kind):
    no_stop = zoo.reference("llama", PROMPT)
    # two characters generated at positions 5 and 6: the stop string spans two tokens
    stop_string = "".join(tokenizer.convert_ids_to_tokens(no_stop[0, PROMPT_LENGTH + 5 : PROMPT_LENGTH + 7].tolist()))
    expected = zoo.target("llama").generate(prompt_ids(PROMPT), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                                            stop_strings=[stop_string], tokenizer=tokenizer)
    assert expected.shape[1] <= PROMPT_LENGTH + 7  # plain generate did stop early
    drafter = make_drafter(kind, 5, zoo, "llama", reference=no_stop)  # the oracle runs past it
    out = enabled_target.generate(prompt_ids(PROMPT), candidate_generator=drafter, max_new_tokens=MAX_NEW_TOKENS,
                                  stop_strings=[stop_string], tokenizer=tokenizer)
    assert_same_tokens(out, expected)


def test_stop_strings_from_a_generation_config(zoo, enabled_target, tokenizer):
    """Stop strings may come in a GenerationConfig (as from a model's generation_config.json) rather than as a
    keyword; with tokenizer= given, the enabled model must honour them as plain generate does."""
    no_stop = zoo.reference("llama", PROMPT)
    stop_string = "".join(tokenizer.convert_ids_to_tokens(no_stop[0, PROMPT_LENGTH + 5 : PROMPT_LENGTH + 7].tolist()))
    config = GenerationConfig(stop_strings=[stop_string], max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    expected = zoo.target("llama").generate(prompt_ids(PROMPT), generation_config=config, tokenizer=tokenizer)
    assert expected.shape[1] <= PROMPT_LENGTH + 7
    out = enabled_target.generate(prompt_ids(PROMPT), candidate_generator=hs.PromptLookupDrafter(4),
                                  generation_config=config, tokenizer=tokenizer)
    assert_same_tokens(out, expected)


def test_text_streamer_prints_the_same_text(zoo, enabled_target, tokenizer):
    def streamed_text(generate, **kwargs) -> str:
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
        generate(prompt_ids(PROMPT), max_new_tokens=MAX_NEW_TOKENS, streamer=streamer, **kwargs)
        return "".join(streamer)

    expected = streamed_text(zoo.target("llama").generate)
    assert len(expected) >= MAX_NEW_TOKENS // 2
    assert streamed_text(enabled_target.generate, candidate_generator=hs.PromptLookupDrafter(4)) == expected


@pytest.mark.parametrize("entry_point", ["enable", "custom_generate"])
def test_custom_stopping_criteria(zoo, enabled_target, entry_point):
    criteria = StoppingCriteriaList([StopAtToken(generated_token(zoo, "llama", PROMPT, 6))])
    expected = plain_generate(zoo.target("llama"), prompt_ids(PROMPT), stopping_criteria=criteria)
    assert expected.shape[1] <= PROMPT_LENGTH + 7
    drafter = OracleDrafter(zoo.reference("llama", PROMPT), 5)  # drafts run past the stop
    if entry_point == "enable":
        out = enabled_target.generate(prompt_ids(PROMPT), candidate_generator=drafter, stopping_criteria=criteria,
                                      max_new_tokens=MAX_NEW_TOKENS)
    else:
        out = speculative_generate(zoo.target("llama"), prompt_ids(PROMPT), drafter, stopping_criteria=criteria)
    assert_same_tokens(out, expected)


# ---------------------------------------------------------------- return_dict_in_generate


STATS_FIELDS = {
    "num_target_forwards", "num_steps", "num_drafts", "num_drafted_tokens", "num_accepted_tokens",
    "num_generated_tokens", "drafted_per_position", "accepted_per_position", "draft_time", "verify_time",
    "lossless", "verifier", "drafter",
}


@pytest.mark.parametrize("do_sample", [False, True], ids=["greedy", "sampling"])
def test_speculative_stats_fields(zoo, enabled_target, do_sample):
    drafter = hs.DraftModelDrafter(zoo.draft("llama"), num_draft_tokens=3)
    out = enabled_target.generate(prompt_ids(PROMPT), candidate_generator=drafter, max_new_tokens=MAX_NEW_TOKENS,
                                  do_sample=do_sample, generator=torch.Generator().manual_seed(0),
                                  return_dict_in_generate=True)
    stats = out.speculative_stats
    assert isinstance(out, hs.SpeculativeGenerateOutput) and isinstance(stats, hs.SpeculativeStats)
    assert STATS_FIELDS <= set(stats.to_dict())
    assert stats.verifier == ("rejection" if do_sample else "exact")
    assert stats.lossless is True
    assert stats.drafter == repr(drafter)
    assert stats.num_generated_tokens == out.sequences.shape[1] - PROMPT_LENGTH == MAX_NEW_TOKENS
    assert stats.num_generated_tokens == stats.num_accepted_tokens + stats.num_steps  # no stop mid-step here
    assert stats.num_drafted_tokens == sum(stats.drafted_per_position)
    assert stats.num_accepted_tokens == sum(stats.accepted_per_position)
    assert stats.draft_time > 0 and stats.verify_time > 0
    json.dumps(stats.to_dict())


class GreedyButNotLossless(hs.ExactVerifier):
    """A custom verifier object that declares itself lossy."""

    name = "custom-lossy"
    lossless = False


def test_stats_report_a_lossy_verifier(zoo):
    out = speculative_generate(zoo.target("llama"), prompt_ids(PROMPT), hs.PromptLookupDrafter(4),
                               verifier=GreedyButNotLossless(), return_dict_in_generate=True)
    assert out.speculative_stats.lossless is False
    assert out.speculative_stats.verifier == "custom-lossy"


def processed_outputs(generate, **kwargs):
    return generate(prompt_ids(PROMPT), max_new_tokens=MAX_NEW_TOKENS, do_sample=False, output_scores=True,
                    output_logits=True, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model", "noisy_draft_model", "oracle", "adversary"])
@pytest.mark.parametrize("setting", ["no_processor", "repetition_penalty", "no_repeat_ngram", "eos"])
def test_scores_and_logits_equal_plain_generate(zoo, enabled_target, kind, setting):
    settings = {
        "no_processor": {},
        "repetition_penalty": dict(repetition_penalty=1.3),
        "no_repeat_ngram": dict(no_repeat_ngram_size=2),
        "eos": dict(eos_token_id=generated_token(zoo, "llama", PROMPT, 6)),
    }[setting]
    expected = processed_outputs(zoo.target("llama").generate, **settings)
    drafter = make_drafter(kind, 5, zoo, "llama", reference=expected.sequences)
    out = processed_outputs(enabled_target.generate, candidate_generator=drafter, **settings)
    assert_same_tokens(out.sequences, expected.sequences)
    num_new_tokens = expected.sequences.shape[1] - PROMPT_LENGTH
    assert len(out.scores) == len(out.logits) == len(expected.scores) == num_new_tokens
    for name in ("scores", "logits"):
        for actual_row, expected_row in zip(getattr(out, name), getattr(expected, name)):
            assert actual_row.shape == expected_row.shape == (1, 96)
            torch.testing.assert_close(actual_row, expected_row, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- the CandidateGenerator protocol


@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model"])
def test_get_candidates_greedy(zoo, kind):
    input_ids = zoo.reference("llama", "repetitive")  # long enough for prompt lookup to find a match
    drafter = make_drafter(kind, 4, zoo, "llama")
    candidate_ids, candidate_logits = drafter.get_candidates(input_ids)
    assert candidate_logits is None  # deterministic drafts
    assert candidate_ids.shape == (1, input_ids.shape[1] + 4)
    assert_same_tokens(candidate_ids[:, : input_ids.shape[1]], input_ids)
    if kind == "draft_model":  # the draft model's own greedy continuation
        expected = zoo.draft("llama").generate(input_ids, max_new_tokens=4, do_sample=False)
        assert_same_tokens(candidate_ids, expected)
    drafter.update_candidate_strategy(candidate_ids, torch.zeros(1, 4, 96), 2)  # part of the protocol: a no-op


def test_get_candidates_sampled_returns_log_probabilities(zoo):
    input_ids = prompt_ids(PROMPT)
    drafter = hs.DraftModelDrafter(zoo.draft("llama"), num_draft_tokens=3)
    # transformers' assisted loop keeps one state per candidate generator; here a sampling one
    drafter._candidate_state = drafter.new_state(zoo.target("llama"), GenerationConfig(do_sample=True),
                                                 generator=torch.Generator().manual_seed(0))
    candidate_ids, candidate_logits = drafter.get_candidates(input_ids)
    assert candidate_ids.shape == (1, PROMPT_LENGTH + 3)
    assert candidate_logits.shape == (1, 3, 96)
    torch.testing.assert_close(candidate_logits.exp().sum(-1), torch.ones(1, 3))
    drafted = candidate_ids[0, PROMPT_LENGTH:]
    assert bool((candidate_logits[0, torch.arange(3), drafted] > -torch.inf).all())


@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model"])
def test_drafter_runs_inside_transformers_assisted_decoding(zoo, kind):
    """A drafter is a transformers CandidateGenerator: transformers' own assisted loop accepts it."""
    model = build_target("llama")
    drafter = make_drafter(kind, 3, zoo, "llama")
    model._get_candidate_generator = lambda **kwargs: drafter  # the loop's only way to take a custom generator
    out = model.generate(prompt_ids(PROMPT), prompt_lookup_num_tokens=3, max_new_tokens=MAX_NEW_TOKENS,
                         do_sample=False)
    assert_same_tokens(out, zoo.reference("llama", PROMPT))


def test_generate_called_directly_without_prepared_config(zoo):
    """`hs.generate(model, input_ids, candidate_generator=...)` has defaults for everything transformers prepares;
    called that way it must either decode (with the model's generation config) or refuse with a ValueError."""
    model = zoo.target("llama")
    try:
        out = hs.generate(model, prompt_ids(PROMPT), candidate_generator=hs.PromptLookupDrafter(4))
    except ValueError:
        return
    assert out.shape[0] == 1 and out.shape[1] > PROMPT_LENGTH


def test_env_prints_what_a_bug_report_needs(capsys):
    import transformers

    from hf_speculators.tools.cli import main

    assert main(["env"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"- transformers: {transformers.__version__}" in lines
    assert f"- torch: {torch.__version__}" in lines
    assert any(line.startswith("- Python: ") for line in lines)
    device = next(line for line in lines if line.startswith("- Device: "))
    assert device.startswith("- Device: cpu: ") or device.startswith(("- Device: cuda: ", "- Device: mps"))
    assert "float32" in next(line for line in lines if line.startswith("- Dtypes that run there: "))
