"""HybridDrafter: suffix decoding where its match is long, a model drafter elsewhere; exact, lossless, its figures;
the model-free methods in SpeculativeConfig and the named methods."""

import pytest
import torch

import hf_speculators as hs
from hf_speculators.config.build import build_drafter
from hf_speculators.config.methods import method_config
from batch_helpers import MAX_NEW_TOKENS, batched_generate, laid_out
from drafters_for_tests import ScriptedDrafter
from eagle_heads import random_eagle
from speculative_helpers import PROMPTS, plain_generate, prompt_ids, speculative_generate
from test_batch import SAMPLING_PROMPTS, chi_square_ratio, exact_two_token_distribution, sampled_counts, scripted
from test_lossless import AlwaysAcceptVerifier
from tiny_models import build_model

BATCH_PROMPTS = ("random", "one_token", "repetitive")


def test_greedy_output_is_exact_and_a_repeat_drafts_from_memory(zoo):
    """A model drafter right for 2 tokens of 4: the first call drafts with it; the repeat of the same prompt
    finds the first call's output in the suffix memory, whose long matches predict more than 2 tokens."""
    model, reference = zoo.target("llama"), zoo.reference("llama", "random")
    drafter = hs.HybridDrafter(hs.SuffixDrafter(num_draft_tokens=8), ScriptedDrafter(reference, 4, num_correct=2))
    figures = []
    for _ in range(2):
        out = speculative_generate(model, prompt_ids("random"), drafter, return_dict_in_generate=True)
        assert torch.equal(out.sequences, reference)
        stats = out.speculative_stats
        sources = stats.drafter_stats
        accepted = sum(source["accepted_tokens"] for source in sources.values())
        assert stats.num_accepted_tokens <= accepted <= stats.num_accepted_tokens + 8  # the length limit cuts
        assert sum(source["drafted_tokens"] for source in sources.values()) == stats.num_drafted_tokens
        figures.append(sources)
    assert figures[0]["model"]["steps"] > figures[0]["model_free"]["steps"]
    assert figures[1]["model_free"]["steps"] > 0
    assert figures[1]["model_free"]["accepted_tokens"] > 2 * figures[1]["model_free"]["steps"]


@pytest.mark.parametrize("use_tree_spec, cut", [(False, False), (True, True)], ids=["chain", "tree-cut"])
def test_every_row_of_a_batch_is_its_plain_greedy_output(zoo, monkeypatch, use_tree_spec, cut):
    """With `cut`, every model-free draft is cut to the narrowest common width (`HybridState.common_width`):
    a token tree's first nodes, best first, still a tree."""
    from hf_speculators.drafters.hybrid import HybridState

    if cut:
        monkeypatch.setattr(HybridState, "common_width", lambda self, probs, widths, rows, seconds: max([1, *widths]))
    model, prompts = zoo.target("llama"), [PROMPTS[name] for name in BATCH_PROMPTS]
    expected = laid_out(prompts, [zoo.reference("llama", name)[0].tolist() for name in BATCH_PROMPTS])
    drafter = hs.HybridDrafter(hs.SuffixDrafter(num_draft_tokens=6, use_tree_spec=use_tree_spec),
                               scripted(zoo, "llama", BATCH_PROMPTS, 3, max_new_tokens=MAX_NEW_TOKENS))
    for _ in range(2):  # the second call mixes sources across rows and steps
        out = batched_generate(model, drafter, prompts)
        assert torch.equal(out.sequences, expected)
    figures = out.speculative_stats.drafter_stats
    assert all(source["steps"] > 0 for source in figures.values())
    free = figures["model_free"]
    assert sum(source["drafted_tokens"] for source in figures.values()) == out.speculative_stats.num_drafted_tokens
    assert free["drafted_tokens"] <= 3 * free["steps"] or not cut  # no longer than the model's 3 when cut


class GreedyContinuationDrafter(hs.Drafter):
    """Drafts the plain greedy output's next tokens when the row is a prefix of one of `references` (none else):
    a model drafter's drafts without a forward."""

    name = "greedy-continuation-test"

    def __init__(self, references: list[list[int]], num_draft_tokens: int):
        super().__init__(num_draft_tokens)
        self.references = references

    def draft_row(self, state, input_ids, max_tokens, row):
        committed = input_ids[0].tolist()
        future = next((r[len(committed) : len(committed) + max_tokens] for r in self.references
                       if r[: len(committed)] == committed), [])
        return hs.Draft.chain(torch.tensor(future, dtype=torch.long))


@pytest.mark.parametrize("model_kind", ["draft_model", "eagle"])
def test_a_model_drafter_catches_up_after_steps_suffix_decoding_drafted(zoo, model_kind):
    """A draft model, or an EAGLE head reading the target's features after every step whichever source drafted,
    drafts again from the committed tokens after steps it did not draft: every row stays its plain greedy output,
    alone and in a batch, and some call mixes both sources."""
    if model_kind == "eagle":  # the EAGLE test heads read a 4-layer target
        target, model_drafter = build_model("llama", num_layers=4, seed=1), hs.EagleDrafter(random_eagle(7), 3)
    else:
        target, model_drafter = zoo.target("llama"), hs.DraftModelDrafter(zoo.draft("llama"), 3)
    references = [plain_generate(target, prompt_ids(name)) for name in BATCH_PROMPTS]
    prompts = [PROMPTS[name] for name in BATCH_PROMPTS]
    expected = laid_out(prompts, [reference[0].tolist() for reference in references])
    drafter = hs.HybridDrafter(hs.SuffixDrafter(num_draft_tokens=8), model_drafter)
    mixed = []  # per call: whether both sources drafted
    for _ in range(2):
        out = speculative_generate(target, prompt_ids("random"), drafter, return_dict_in_generate=True)
        assert torch.equal(out.sequences, references[0])
        mixed.append(all(source["steps"] for source in out.speculative_stats.drafter_stats.values()))
        out = batched_generate(target, drafter, prompts)
        assert torch.equal(out.sequences, expected)
        mixed.append(all(source["steps"] for source in out.speculative_stats.drafter_stats.values()))
    assert any(mixed), mixed


def test_sampling_is_lossless_and_the_test_catches_a_lossy_verifier(zoo):
    """Both sources draft: suffix decoding while its memory (greedy outputs, then the samples) predicts more than
    two tokens, the model's greedy continuation otherwise."""
    model, names = zoo.target("llama"), SAMPLING_PROMPTS * 16

    references = [zoo.reference("llama", name)[0].tolist() for name in SAMPLING_PROMPTS]

    def hybrid():  # the "model": the target's greedy continuation, often accepted under top-3 sampling
        suffix = hs.SuffixDrafter(num_draft_tokens=3)
        for reference in references:  # an earlier call's greedy outputs: long, sure matches at first
            suffix.cache.add(reference)
        return hs.HybridDrafter(suffix, GreedyContinuationDrafter(references, 2))

    drafter = hybrid()
    counts, accepted = sampled_counts(model, names, drafter=drafter)
    assert accepted > 100
    for name in SAMPLING_PROMPTS:
        assert chi_square_ratio(counts[name], exact_two_token_distribution(model, name)) < 1, name
    counts, _ = sampled_counts(model, names, verifier=AlwaysAcceptVerifier(), drafter=hybrid())
    assert all(chi_square_ratio(counts[name], exact_two_token_distribution(model, name)) > 5
               for name in SAMPLING_PROMPTS)


def test_the_model_free_draft_is_taken_when_it_promises_more_tokens_per_second():
    """Arctic Inference's threshold before anything is measured (score >= the model's draft length, then its mean
    accepted tokens); measured model-free drafts accepted below their scores raise the bar, measured model steps
    slower than model-free ones lower it."""
    from hf_speculators.drafters.hybrid import HybridState
    from transformers import GenerationConfig

    state = HybridState(None, GenerationConfig())
    assert state.takes_model_free(3.0, 3) and not state.takes_model_free(2.9, 3)
    state.figures["model"] = [10, 30, 20]  # 2 accepted per model draft
    assert state.takes_model_free(2.0, 3) and not state.takes_model_free(1.9, 3)
    state.figures["model_free"], state.free_scores = [10, 40, 8], 38.0  # 8 accepted for a score of 38
    assert state.free_accepted_per_score() == pytest.approx(0.25)
    assert not state.takes_model_free(4.0, 3) and state.takes_model_free(8.0, 3)
    for source, now in (("model_free", 0.0), ("model", 1.0), ("model_free", 4.0), ("model", 5.0)):
        state.time_step(source, now)  # a step runs from its propose to the next one
    assert state.step_seconds == {"model_free": [2, 2.0], "model": [1, 3.0], "plain": [0, 0.0]}
    assert state.step_started == ("model", 5.0)
    state.step_seconds |= {"model_free": [100, 100.0], "model": [100, 300.0]}  # model steps 3x as long
    assert state.cost_ratio() == pytest.approx(104 / 304)  # the prior: 2 steps of each at the mean, 2 s
    assert state.takes_model_free(0.5, 3) and not state.takes_model_free(0.0, 3)  # 1.125 and 1 against 3 * 0.34
    # a row the model floor holds back: any draft beats a plain step until plain steps were measured
    assert state.free_beats_plain(0.01)
    state.step_seconds["model_free"], state.step_seconds["plain"] = [100, 150.0], [100, 100.0]  # free steps 1.5x
    assert state.seconds_ratio("model_free", "plain") == pytest.approx(152.5 / 102.5)  # priors at the mean, 1.25 s
    assert not state.free_beats_plain(0.8) and state.free_beats_plain(2.0)  # 1 + 0.25 * score against 1.49


def test_a_long_model_free_draft_is_cut_to_the_width_of_the_most_tokens_per_second():
    """Four rows, one verify forward: a row's 8-token model-free draft widens every row's query. At 1 s plus 0.02 s
    per slot (0.08 s per token of width), drafts accepted as scored keep the tokens worth their slots; accepted at a
    tenth of their scores, the draft is cut to the model drafts' width; before a step was measured nothing is cut."""
    from hf_speculators.drafters.hybrid import HybridState
    from transformers import GenerationConfig

    state = HybridState(None, GenerationConfig())
    state.model_lengths = hs.schedules.make_schedule("constant", 2)
    probs = [(0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)]
    assert state.common_width(probs, [2], 4, 0.0) == 8
    for width in (1, 9):
        state.verify_cost.add(4 * (width + 1), 1.0 + 0.08 * (width + 1))
    assert state.verify_cost(8) == pytest.approx(1.16, rel=1e-3)
    state.figures["model"] = [10, 20, 10]  # 1 accepted per model draft
    # (4 rows + 1 model-accepted + sum(probs[:w])) / (1 + 0.08 * (w + 1)): 5.606 at w = 3, 5.714, 5.743, 5.705 at 6
    assert state.common_width(probs, [2], 4, 0.0) == 5
    assert state.common_width(probs, [2], 4, 10.0) == 8  # drafting dearer than verifying: every token pays
    state.figures["model_free"], state.free_scores = [10, 40, 1], 28.0  # accepted at (1 + 2) / (28 + 2) of scores
    assert state.common_width(probs, [2], 4, 0.0) == 2
    assert state.common_width(probs, [], 4, 0.0) == 1
    assert state.common_width([(0.9, 0.8)], [3], 4, 0.0) == 2  # nothing beyond the model's width to cut
    # compiled at widths 4 and 9 (3 and 8 draft tokens): a width costs the slots of the compiled one that holds it
    state.query_widths = (4, 9)
    assert state.slots(4, 2) == 16 and state.slots(4, 3) == 16 and state.slots(4, 4) == 36
    state.figures["model_free"], state.free_scores = [0, 0, 0], 0.0
    assert state.common_width(probs, [2], 4, 0.0) == 3  # 7.4 / 1.32 against 9.4 / 1.72 at 8
    assert state.common_width(probs, [2], 4, 1.0) == 8  # 7.4 / 2.32 against 9.4 / 2.72


def test_the_model_schedule_prices_every_row_of_the_step():
    """Four rows, the model drafting 2 tokens in one of them and suffix decoding 2 in another: the step's one forward
    scored 4 x 3 slots, and that is what the model's goodput schedule fits its verify line to and prices its next
    draft length for (counting only the model's row, it would see 3 slots and a one-row batch)."""
    from hf_speculators.drafters.hybrid import HybridState
    from hf_speculators.floor import PlainFloor
    from transformers import GenerationConfig

    state = HybridState(None, GenerationConfig())
    state.model_lengths, state.model_floor = hs.schedules.make_schedule("goodput", 3), PlainFloor()
    assert state.model_floor.budgets([0, 1, 2, 3], [0, 2, 0, 0]) == [0, 2, 0, 0]
    state.time_step("model", 0.0)
    state.model_step, state.step_slots = ({1: (2, 2, 2)}, 0.004, 0.004), 12
    state.observe_step({0: 0, 1: 1, 2: 2, 3: 0}, 0.030)
    schedule = state.model_lengths
    assert schedule.num_rows == 4
    assert schedule.verify_cost.tokens / schedule.verify_cost.weight == 12
    assert schedule.reached[:2] == [1.0, 1.0] and schedule.accepted[:2] == [1.0, 0.0]  # the model row's only


@pytest.mark.parametrize("num_correct, short", [(1, True), (4, False)])
def test_the_model_draft_length_follows_the_measured_acceptance(zoo, monkeypatch, num_correct, short):
    """A model drafter right for 1 token of 4, with a target forward of 10 ms plus 1 ms per token: after a few
    steps the hybrid asks it for at most 2 tokens (more would commit no more and cost more); a drafter right for
    all 4 keeps drafting 4."""
    from hf_speculators.drafters import hybrid
    from test_schedules import simulated_clock

    model = zoo.target("llama")
    reference = zoo.reference("llama", "random", max_new_tokens=64)
    scripted = ScriptedDrafter(reference, 4, num_correct=num_correct)
    drafter = hs.HybridDrafter(hs.SuffixDrafter(num_draft_tokens=8, max_cached_requests=0), scripted)
    with simulated_clock(monkeypatch, {model: (0.010, 0.001)}):
        monkeypatch.setattr(hybrid, "clock", lambda device: hs.loop.clock(device))
        out = speculative_generate(model, prompt_ids("random"), drafter, max_new_tokens=64, plain_floor=False)
    assert torch.equal(out, reference)
    asked = [max_tokens for _, max_tokens in scripted.calls]
    assert asked[0] == 4
    later = asked[len(asked) // 2 :]
    if short:  # the unasked second position drifts back to its prior, so 2 is retried every other step or so
        assert max(later) <= 2 and later.count(1) >= len(later) // 3
    else:  # one exploration step at 3
        assert later.count(4) >= len(later) - 1


class MeteredScriptedDrafter(ScriptedDrafter):
    """A scripted drafter whose every call runs `meter`, a module that `simulated_clock` charges as a draft forward
    of as many tokens as the longest draft asked."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.meter = torch.nn.Identity()

    def propose(self, state, input_ids, max_tokens, rows):
        self.meter(torch.zeros(1, max(max_tokens)))
        return super().propose(state, input_ids, max_tokens, rows)


@pytest.mark.parametrize("draft_seconds, held", [(0.060, True), (0.002, False)])
def test_the_model_drafter_is_held_back_where_its_steps_lose_to_plain_ones(zoo, monkeypatch, draft_seconds, held):
    """A model drafter right for 3 tokens of 4 whose call costs 60 ms against a target forward of 10 ms plus 1 ms per
    token: its steps commit fewer tokens per second than plain ones, so after its first drafts the hybrid's model
    floor holds it back (the loop's own floor off), with a probe now and then, and the next call starts from what
    the first measured: held from its first step; at 2 ms a call it is never held. A call inside `memory_kept` (the
    bench's warm-up) leaves the next call's start as it was."""
    from hf_speculators.drafters import hybrid
    from test_schedules import simulated_clock

    model = zoo.target("llama")
    reference = zoo.reference("llama", "random", max_new_tokens=64)
    scripted = MeteredScriptedDrafter(reference, 4, num_correct=3)
    drafter = hs.HybridDrafter(hs.SuffixDrafter(num_draft_tokens=8, max_cached_requests=0), scripted)
    calls = []
    with simulated_clock(monkeypatch, {model: (0.010, 0.001), scripted.meter: (draft_seconds, 0.0)}):
        monkeypatch.setattr(hybrid, "clock", lambda device: hs.loop.clock(device))
        for _ in range(2):
            out = speculative_generate(model, prompt_ids("random"), drafter, max_new_tokens=64, plain_floor=False,
                                       return_dict_in_generate=True)
            assert torch.equal(out.sequences, reference)
            calls.append((out.speculative_stats.num_steps, out.speculative_stats.drafter_stats["model"]))
        prior = drafter._floor_prior
        with drafter.memory_kept():
            speculative_generate(model, prompt_ids("random"), drafter, max_new_tokens=64, plain_floor=False)
            assert drafter._floor_prior is not prior  # the call measured
        assert drafter._floor_prior is prior
    (num_steps, first), (_, second) = calls
    if held:
        assert first["held_steps"] >= num_steps // 2 and first["steps"] <= num_steps // 3, first
        assert second["steps"] < first["steps"] and second["held_steps"] > first["held_steps"], (first, second)
    else:
        assert first["held_steps"] == second["held_steps"] == 0 and first["steps"] >= num_steps // 2, first


def test_a_model_free_drafter_must_score_its_drafts(zoo):
    with pytest.raises(ValueError, match="scores its drafts"):
        hs.HybridDrafter(hs.PromptLookupDrafter(), hs.SuffixDrafter())
    with pytest.raises(ValueError, match="model_schedule must be one of"):
        hs.HybridDrafter(hs.SuffixDrafter(), hs.PromptLookupDrafter(), model_schedule="adaptive")


def test_configs_and_named_methods_build_the_model_free_drafters(zoo):
    target = zoo.target("llama")
    suffix = hs.SpeculativeConfig("suffix", num_draft_tokens=6, max_tree_depth=8, use_tree_spec=True)
    drafter = build_drafter(suffix, target)
    assert isinstance(drafter, hs.SuffixDrafter) and drafter.max_tree_depth == 8 and drafter.drafts_trees
    lookahead = build_drafter(method_config("lookahead", num_draft_tokens=5, window_size=2, ngram_size=4), target)
    assert (lookahead.window_size, lookahead.ngram_size, lookahead.num_draft_tokens) == (2, 4, 3)
    hybrid = build_drafter(method_config("hybrid", draft_model="<loaded draft model>", num_draft_tokens=3,
                                         min_token_prob=0.3), target, draft_model=zoo.draft("llama"))
    assert isinstance(hybrid.model_drafter, hs.DraftModelDrafter) and hybrid.model_drafter.num_draft_tokens == 3
    assert hybrid.model_free.min_token_prob == 0.3
    assert method_config("hybrid-eagle3", eagle_head="heads/eagle").model_method == "eagle3"
    assert build_drafter(method_config("suffix", max_cached_requests=0), target).cache.max_cached_requests == 0


@pytest.mark.parametrize("settings, message", [
    ({"method": "lookahead", "num_draft_tokens": 4}, "ngram_size"),
    ({"method": "hybrid"}, "draft_model is required"),
    ({"method": "suffix", "window_size": 3}, "window_size does not apply"),
    ({"method": "suffix", "max_cached_requests": -1}, "max_cached_requests"),
    ({"method": "suffix", "min_token_prob": 2.0}, "min_token_prob"),
    ({"method": "hybrid", "draft_model": "d", "model_method": "medusa"}, "model_method"),
])
def test_configs_refuse_what_does_not_apply(settings, message):
    with pytest.raises(ValueError, match=message):
        hs.SpeculativeConfig(**settings)


def test_the_loops_floor_is_off_by_default_for_a_drafter_with_a_floor_of_its_own():
    """The hybrid holds its model back itself; the loop's floor would judge its suffix drafts by the model's costs."""
    from hf_speculators.decoding import _floor
    from hf_speculators.floor import PlainFloor
    from transformers import GenerationConfig

    greedy, suffix = GenerationConfig(do_sample=False), hs.SuffixDrafter()
    hybrid = hs.HybridDrafter(hs.SuffixDrafter(), hs.PromptLookupDrafter())
    assert _floor(None, greedy, hybrid) is None and isinstance(_floor(None, greedy, suffix), PlainFloor)
    assert isinstance(_floor(True, greedy, hybrid), PlainFloor) and _floor(False, greedy, suffix) is None
