"""Draft-length schedules: exact output under every schedule, the goodput schedule's decisions on synthetic
acceptance and costs, transformers' heuristic rule, losslessness with history-dependent lengths, stats and CLI."""

import contextlib
import json
import random
from types import SimpleNamespace

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.candidate_generator import AssistedCandidateGenerator

import hf_speculators as hs
from hf_speculators import loop
from hf_speculators.tools import cli
from hf_speculators.schedules import SCHEDULES, HeuristicSchedule, make_schedule
from hf_speculators.schedules.goodput import CostFit, GoodputSchedule, MovingAverage
from hf_speculators.step import RowOutcome
from speculative_helpers import assert_cache_matches_sequence, assert_same_tokens, make_drafter, prompt_ids
from test_lossless import START_TOKEN, VOCAB, draft_chain, statistics, target_scores

MAX_NEW_TOKENS = 40
PROMPT_REPETITIVE = prompt_ids("repetitive")[0].tolist()
BOUND = 6


def step_outcomes(draft_length: int, num_nodes, depths, num_accepted) -> list[RowOutcome]:
    """A step's outcomes of rows that were asked for `draft_length` tokens, drafted `num_nodes[i]` of depth
    `depths[i]` and had `num_accepted[i]` accepted (as chains)."""
    return [RowOutcome(row, draft_length, nodes, depth, list(range(accepted)), accepted + 1, False)
            for row, (nodes, depth, accepted) in enumerate(zip(num_nodes, depths, num_accepted))]


# ---------------------------------------------------------------- exactness under every schedule


def schedule_drafter(kind: str, zoo, arch: str, reference) -> hs.Drafter:
    """Every drafter kind of the exactness tests, plus layer skip and the two trees (whose depth is scheduled)."""
    if kind == "layer_skip":
        return hs.LayerSkipDrafter(exit_layer=1, num_draft_tokens=BOUND)
    if kind == "prompt_lookup_tree":
        return hs.PromptLookupDrafter(num_draft_tokens=BOUND, num_candidates=3)
    if kind == "draft_model_tree":
        return hs.TreeDrafter(zoo.noisy_draft(arch), hs.DynamicTree(depth=BOUND, top_k=2, num_nodes=8))
    return make_drafter(kind, BOUND, zoo, arch, reference=reference, num_correct=2)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model", "noisy_draft_model", "oracle", "adversary",
                                  "scripted", "layer_skip", "prompt_lookup_tree", "draft_model_tree"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_output_equals_plain_generate_under_every_schedule(zoo, arch, kind, schedule):
    expected = zoo.reference(arch, "repetitive", max_new_tokens=MAX_NEW_TOKENS)
    drafter = schedule_drafter(kind, zoo, arch, expected)
    out = zoo.target(arch).generate(
        prompt_ids("repetitive"), custom_generate=hs.generate, candidate_generator=drafter, do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True, num_draft_tokens_schedule=schedule,
    )
    assert_same_tokens(out.sequences, expected)
    assert_cache_matches_sequence(out)
    stats = out.speculative_stats
    assert sum(stats.draft_lengths) == stats.num_steps
    if schedule == "constant":  # every step asks for the bound but where the length limit or the floor leaves less
        assert stats.draft_lengths[BOUND] + stats.num_floor_steps >= stats.num_steps - BOUND


@contextlib.contextmanager
def simulated_clock(monkeypatch, costs: dict):
    """Replaces the loop's clock by one that advances only inside model forwards, by `intercept + per_token *
    tokens` seconds for each model in `costs` (model -> (intercept, per_token)): decisions become deterministic."""
    now = [0.0]

    def charge(intercept: float, per_token: float):
        def hook(module, args, kwargs):
            input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            now[0] += intercept + per_token * input_ids.shape[-1]
        return hook

    monkeypatch.setattr(loop, "clock", lambda device: now[0])
    handles = [model.register_forward_pre_hook(charge(*cost), with_kwargs=True) for model, cost in costs.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def goodput_run(zoo, arch: str, drafter, monkeypatch, costs: dict):
    """Greedy goodput generate under `simulated_clock`; checks the output against plain greedy; returns stats."""
    expected = zoo.reference(arch, "repetitive", max_new_tokens=MAX_NEW_TOKENS)
    with simulated_clock(monkeypatch, costs):
        out = zoo.target(arch).generate(
            prompt_ids("repetitive"), custom_generate=hs.generate, candidate_generator=drafter, do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True, num_draft_tokens_schedule="goodput",
        )
    assert_same_tokens(out.sequences, expected)
    return out.speculative_stats


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_goodput_runs_plain_steps_when_drafts_cost_more_than_they_gain_and_probes(zoo, arch, monkeypatch):
    """A random draft model is nearly always rejected: after the first step (the bound), plain steps with the drafter
    not called, and now and then a one-token probe."""
    costs = {zoo.target(arch): (0.010, 0.001), zoo.draft(arch): (0.004, 0.0005)}
    stats = goodput_run(zoo, arch, make_drafter("draft_model", BOUND, zoo, arch), monkeypatch, costs)
    assert stats.draft_lengths[BOUND] == 1 and stats.draft_lengths[1] >= 2
    assert stats.draft_lengths[0] > stats.num_steps * 2 // 3
    assert stats.num_steps_without_draft >= stats.draft_lengths[0]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_goodput_drafts_the_bound_when_every_draft_token_is_accepted(zoo, arch, monkeypatch):
    expected = zoo.reference(arch, "repetitive", max_new_tokens=MAX_NEW_TOKENS)
    stats = goodput_run(zoo, arch, make_drafter("oracle", BOUND, zoo, arch, reference=expected), monkeypatch,
                        {zoo.target(arch): (0.010, 0.001)})
    assert stats.draft_lengths[BOUND] >= stats.num_steps - 1 and stats.acceptance_rate == 1.0  # the last: length limit


def test_the_schedule_comes_from_the_config_and_the_argument_wins(zoo, fresh_target):
    expected = zoo.reference("llama", "repetitive", max_new_tokens=MAX_NEW_TOKENS)
    model = hs.enable(fresh_target)
    config = hs.SpeculativeConfig(num_draft_tokens=BOUND, num_draft_tokens_schedule="heuristic")
    lengths = {}
    for schedule in (None, "constant"):
        out = model.generate(prompt_ids("repetitive"), speculative_config=config, do_sample=False,
                             max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True,
                             num_draft_tokens_schedule=schedule)
        assert_same_tokens(out.sequences, expected)
        lengths[schedule] = out.speculative_stats.draft_lengths
        floor_steps = out.speculative_stats.num_floor_steps
    assert lengths[None] != lengths["constant"]  # the config's heuristic changed the length after rejections
    assert len(lengths["constant"]) == BOUND + 1
    assert lengths["constant"][BOUND] + floor_steps >= sum(lengths["constant"]) - BOUND


def test_an_unknown_schedule_raises_before_any_forward(zoo):
    with pytest.raises(ValueError, match=r"num_draft_tokens_schedule must be one of \['constant', 'goodput', "
                                         r"'heuristic'\], got 'adaptive'"):
        zoo.target("llama").generate(prompt_ids("random"), custom_generate=hs.generate, max_new_tokens=3,
                                     candidate_generator=hs.PromptLookupDrafter(3),
                                     num_draft_tokens_schedule="adaptive")
    with pytest.raises(ValueError, match="num_draft_tokens_schedule must be one of"):
        make_schedule(3, 4)


# ---------------------------------------------------------------- transformers' heuristic


def test_heuristic_schedule_follows_transformers_rule():
    """Driven by the same acceptances, our length and transformers' own `update_candidate_strategy` agree."""
    assisted = SimpleNamespace(num_assistant_tokens=5, assistant_generation_config=GenerationConfig(
        num_assistant_tokens_schedule="heuristic", assistant_confidence_threshold=0.0))
    ours, rng = HeuristicSchedule(5), random.Random(0)
    for _ in range(300):
        k = ours.draft_length
        assert k == assisted.num_assistant_tokens
        num_accepted = k if rng.random() < 0.4 else rng.randrange(k)
        AssistedCandidateGenerator.update_candidate_strategy(assisted, None, torch.zeros(1, k + 1, 4), num_accepted)
        ours.update(step_outcomes(k, [k], [k], [num_accepted]), 0.0, 0.0)
    # an empty draft (prompt lookup found nothing): unchanged
    ours.update(step_outcomes(ours.draft_length, [0], [0], [0]), 0.0, 0.0)
    assert ours.draft_length == assisted.num_assistant_tokens


def test_in_a_batch_the_heuristic_moves_at_most_two_up_or_one_down_per_step():
    """One update per step with every row: +2 when every row that drafted had its whole draft accepted, else -1
    (called once per row, as before the one loop, it moved +2B / -B per step)."""
    schedule = HeuristicSchedule(5)
    schedule.update(step_outcomes(5, [5, 5, 5, 5], [5, 5, 5, 5], [5, 5, 5, 5]), 0.0, 0.0)
    assert schedule.draft_length == 7
    schedule.update(step_outcomes(7, [7, 7, 7, 7], [7, 7, 7, 7], [7, 0, 1, 7]), 0.0, 0.0)
    assert schedule.draft_length == 6
    # a row without a draft does not count
    schedule.update(step_outcomes(6, [6, 0, 6], [6, 0, 6], [6, 0, 6]), 0.0, 0.0)
    assert schedule.draft_length == 8
    schedule.update(step_outcomes(8, [0, 0], [0, 0], [0, 0]), 0.0, 0.0)  # no row drafted: unchanged
    assert schedule.draft_length == 8
    rng = random.Random(0)
    for _ in range(200):
        k, rows = schedule.draft_length, rng.randint(1, 8)
        nodes = [rng.choice([0, k]) for _ in range(rows)]
        accepted = [n if rng.random() < 0.7 else rng.randrange(n + 1) for n in nodes]
        schedule.update(step_outcomes(k, nodes, nodes, accepted), 0.0, 0.0)
        assert schedule.draft_length - k in ((2, -1) if any(nodes) else (0,)) or schedule.draft_length == k == 1


def test_goodput_charges_a_batched_steps_seconds_once():
    """A step of B rows costs its measured seconds once (not B times): the draft line against the deepest draft,
    the verification line against the B * (widest draft + 1) query slots its one forward scored."""
    rows, schedule = 4, GoodputSchedule(BOUND, explore_interval=None)
    for step in range(40):
        k = [2, 4, 6][step % 3]
        schedule.update(step_outcomes(k, [k] * rows, [k] * rows, [k // 2] * rows), 0.003 * k,
                        0.010 + 0.001 * rows * (k + 1))
    assert schedule.draft_cost.count == schedule.verify_cost.count == 40  # one observation per step, not per row
    assert schedule.draft_cost(4) == pytest.approx(0.012, rel=0.02)
    assert schedule.verify_cost(rows * 5) == pytest.approx(0.010 + 0.001 * rows * 5, rel=0.02)
    _, seconds = schedule.expected_tokens_and_seconds()  # a draft of k: draft(k) + verify(rows * (k + 1))
    assert seconds[BOUND] == pytest.approx(0.003 * BOUND + 0.010 + 0.001 * rows * (BOUND + 1), rel=0.05)
    for _ in range(5):
        # plain steps: one observation each
        schedule.update(step_outcomes(0, [0] * rows, [0] * rows, [0] * rows), 0.0, 0.014)
    assert schedule.plain_cost.count == 5 and schedule.plain_cost.value == pytest.approx(0.014)


def test_a_batched_generate_updates_the_schedule_once_per_step(monkeypatch):
    """The loop hands the schedule one update per step with every running row (layer skip on a left-padded batch)."""
    from batch_helpers import batched_generate
    from tiny_models import build_model

    calls = []
    update = HeuristicSchedule.update

    def spy(self, outcomes, draft_seconds, verify_seconds):
        before = self.draft_length
        update(self, outcomes, draft_seconds, verify_seconds)
        calls.append((len(outcomes), self.draft_length - before))

    monkeypatch.setattr(HeuristicSchedule, "update", spy)
    model = build_model("llama", hidden_size=48, num_layers=4, seed=1)
    prompts = (PROMPT_REPETITIVE, PROMPT_REPETITIVE[:3], (5, 9))
    out = batched_generate(model, hs.LayerSkipDrafter(exit_layer=2, num_draft_tokens=3), prompts,
                           num_draft_tokens_schedule="heuristic")
    assert len(calls) == out.speculative_stats.num_target_forwards - 1  # every step but the prefill
    assert calls[0][0] == len(prompts) and all(delta in (2, -1, 0) for _, delta in calls)


# ---------------------------------------------------------------- goodput decisions on synthetic inputs


def simulate_steps(schedule, num_steps: int, acceptance, draft_cost: float, verify_intercept: float,
                   verify_slope: float, rng: random.Random, draft_tokens=None) -> list[int]:
    """Feeds `schedule` steps of a synthetic drafter: position i accepted with probability `acceptance(i)` when the
    earlier ones were; seconds `draft_cost * depth` and `verify_intercept + verify_slope * tokens scored`; the
    drafter returns `draft_tokens(k)` tokens when asked for k (default k). Returns the lengths asked for."""
    lengths = []
    for _ in range(num_steps):
        k = schedule.draft_length
        depth = k if draft_tokens is None else draft_tokens(k)
        accepted = 0
        while accepted < depth and rng.random() < acceptance(accepted):
            accepted += 1
        schedule.update(step_outcomes(k, [depth], [depth], [accepted]), draft_cost * depth,
                        verify_intercept + verify_slope * (depth + 1))
        lengths.append(k)
    return lengths


def true_goodput(k: int, acceptance, draft_cost: float, verify_intercept: float, verify_slope: float) -> float:
    tokens, survival = 1.0, 1.0
    for i in range(k):
        survival *= acceptance(i)
        tokens += survival
    return tokens / (draft_cost * k + verify_intercept + verify_slope * (k + 1))


def test_the_first_step_drafts_the_bound_and_waits_for_a_measured_draft():
    schedule = GoodputSchedule(BOUND)
    assert schedule.draft_length == BOUND
    # asked, found nothing (prompt lookup): no draft cost measured yet
    schedule.update(step_outcomes(BOUND, [0], [0], [0]), 1e-5, 0.01)
    assert schedule.draft_length == BOUND


def test_cheap_verification_and_high_acceptance_draft_the_bound():
    schedule = GoodputSchedule(BOUND, explore_interval=None)
    lengths = simulate_steps(schedule, 60, lambda i: 0.95, draft_cost=0.0005, verify_intercept=0.01,
                             verify_slope=0.0002, rng=random.Random(0))
    assert lengths[10:] == [BOUND] * 50


def probe_waits(lengths: list[int]) -> list[int]:
    """The plain steps before each probe, from the first plain step on."""
    text = "".join("p" if k == 0 else "d" for k in lengths[lengths.index(0):])
    return [len(run) for run in text.split("d")[:-1] if run]


def test_no_acceptance_gives_plain_steps_then_probes_whose_waits_grow_to_the_overhead_floor():
    """A one-token probe costs 0.015 s against a plain step's 0.011 s: 0.004 s more, which the plain steps before
    it pay for at 0.5, 0.25, 0.125, then (the floor) 0.0625 of their time: waits of 1, 2, 3, then 6 steps."""
    schedule = GoodputSchedule(BOUND, explore_interval=None)
    lengths = simulate_steps(schedule, 80, lambda i: 0.0, draft_cost=0.003, verify_intercept=0.01,
                             verify_slope=0.001, rng=random.Random(0))
    assert lengths.index(0) <= 3
    assert set(lengths[lengths.index(0):]) == {0, 1}  # a probe drafts the best length >= 1: one token
    assert probe_waits(lengths)[:6] == [1, 2, 3, 6, 6, 6]


def test_the_wait_for_a_probe_grows_with_what_the_probe_costs():
    """Probing spends a share of the plain steps' time, not a number of steps: a free drafter (prompt lookup)
    probes every other step while a dear one waits tens of steps."""
    waits = {}
    for draft_cost in (0.0, 0.03):
        lengths = simulate_steps(GoodputSchedule(BOUND, explore_interval=None), 150, lambda i: 0.0,
                                 draft_cost=draft_cost, verify_intercept=0.01, verify_slope=0.001,
                                 rng=random.Random(0))
        waits[draft_cost] = probe_waits(lengths)[-1]
    assert waits[0.0] <= 2 and waits[0.03] >= 40


def test_a_free_drafter_drafts_a_copyable_stretch_after_a_long_run_of_rejections():
    """Prompt lookup on text with nothing to copy, then on a copyable stretch: drafting resumes at once and reaches
    the bound within ten steps (probes that backed off to tens of plain steps would miss most of the stretch)."""
    schedule, rng = GoodputSchedule(BOUND, explore_interval=None), random.Random(0)
    costs = dict(draft_cost=0.0, verify_intercept=0.01, verify_slope=0.0005, rng=rng)
    assert simulate_steps(schedule, 60, lambda i: 0.0, **costs)[-20:].count(0) >= 8  # mostly plain steps by then
    lengths = simulate_steps(schedule, 20, lambda i: 1.0, **costs)
    assert lengths[:2].count(0) <= 1 and 0 not in lengths[2:] and lengths[10:] == [BOUND] * 10


def test_drafting_resumes_when_a_probe_is_accepted():
    schedule, rng = GoodputSchedule(BOUND, explore_interval=None), random.Random(0)
    costs = dict(draft_cost=0.001, verify_intercept=0.01, verify_slope=0.0005, rng=rng)
    assert simulate_steps(schedule, 30, lambda i: 0.0, **costs)[-10:].count(0) >= 7  # plain but for probes
    lengths = simulate_steps(schedule, 80, lambda i: 1.0, **costs)
    assert lengths[-10:] == [BOUND] * 10


@pytest.mark.parametrize(
    ("acceptance", "draft_cost", "verify_slope"),
    [
        (lambda i: 0.7, 0.003, 0.001),  # a draft model: the best length is in between
        (lambda i: 0.8 if i < 2 else 0.3, 0.001, 0.0005),  # acceptance falls after two positions
        (lambda i: 0.5, 0.006, 0.002),  # drafting barely pays
        (lambda i: 0.9, 0.0, 0.004),  # free drafts (prompt lookup), costly verification
    ],
)
def test_goodput_choices_come_within_3_percent_of_the_best_length(acceptance, draft_cost, verify_slope):
    schedule = GoodputSchedule(BOUND)
    costs = dict(draft_cost=draft_cost, verify_intercept=0.01, verify_slope=verify_slope)
    lengths = simulate_steps(schedule, 400, acceptance, rng=random.Random(1), **costs)
    rates = [true_goodput(k, acceptance, **costs) for k in range(BOUND + 1)]
    achieved = sum(rates[k] for k in lengths[100:]) / len(lengths[100:])
    assert achieved >= 0.97 * max(rates), (lengths[-20:], rates)


def test_shorter_drafts_than_asked_count_in_the_expected_cost():
    """A drafter that often returns nothing (prompt lookup without a match) is still asked for the bound when
    its drafts are free and always right: an empty draft costs nothing extra."""
    schedule, rng = GoodputSchedule(BOUND, explore_interval=None), random.Random(2)
    lengths = simulate_steps(schedule, 60, lambda i: 1.0, draft_cost=0.0, verify_intercept=0.01, verify_slope=0.0003,
                             rng=rng, draft_tokens=lambda k: k if rng.random() < 0.3 else 0)
    assert lengths[20:] == [BOUND] * 40


def test_exploration_tries_the_neighbouring_lengths():
    schedule = GoodputSchedule(BOUND, explore_interval=4)
    lengths = simulate_steps(schedule, 40, lambda i: 0.95, draft_cost=0.0005, verify_intercept=0.01,
                             verify_slope=0.0002, rng=random.Random(0))
    assert BOUND - 1 in lengths[10:] and set(lengths[10:]) <= {BOUND - 1, BOUND}


def test_cost_fit_recovers_a_line_from_several_lengths():
    fit = CostFit(relative_slope=0.1, memory=0.95)
    for _ in range(10):
        for tokens in (1, 3, 6):
            fit.add(tokens, 0.010 + 0.002 * tokens)
    assert fit.intercept == pytest.approx(0.010, rel=0.03) and fit.slope == pytest.approx(0.002, rel=0.03)
    one_length = CostFit(relative_slope=1.0, memory=0.95)
    one_length.add(4, 0.008)  # one length seen: the prior's proportional line
    assert one_length(1) == pytest.approx(0.002) and one_length(0) == pytest.approx(0.0)


def test_a_descheduled_step_counts_as_at_most_twice_the_expected_duration():
    fit, average = CostFit(relative_slope=0.1, memory=0.98), MovingAverage(memory=0.98)
    for _ in range(3):
        fit.add(2, 0.010)
        average.add(0.010)
    fit.add(2, 1.0)  # the process lost the CPU for a second
    average.add(1.0)
    assert fit(2) == pytest.approx((3 * 0.010 + 0.020) / 4, rel=0.02)
    assert average.value == pytest.approx((0.98**3 * 0.010 + 0.98**2 * 0.010 + 0.98 * 0.010 + 0.020) /
                                          (0.98**3 + 0.98**2 + 0.98 + 1))


# ---------------------------------------------------------------- losslessness with history-dependent lengths


def first_two_tokens_scheduled(schedule, sampled: bool, generator: torch.Generator, peek: bool = False):
    """Speculative steps from START_TOKEN until two tokens are produced, each step drafting `schedule.draft_length`
    tokens (synthetic timings). `peek=True` breaks the rule on purpose: it drops a draft after looking at it."""
    produced, verifier = [], hs.RejectionVerifier()
    while len(produced) < 2:
        last = produced[-1] if produced else START_TOKEN
        k = schedule.draft_length
        draft = draft_chain(last, k, sampled, generator) if k else hs.Draft.empty("cpu")
        if peek and k and int(draft.token_ids[0]) != int(target_scores(last, draft)[0].argmax()):
            draft = hs.Draft.empty("cpu")  # keeps only drafts that start with the target's likeliest token
        verdict = verifier(draft, target_scores(last, draft), do_sample=True, generator=generator)
        produced += draft.token_ids[verdict.accepted_nodes].tolist() + [int(verdict.next_token)]
        n = draft.num_nodes
        schedule.update(step_outcomes(k, [n], [n], [verdict.num_accepted]), 0.004 * n, 0.01 + 0.001 * (n + 1))
    return produced[0], produced[1]


def simulate_scheduled(sampled: bool, num_runs: int, peek: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Counts `(VOCAB, VOCAB)` of the first two tokens over runs that share one goodput schedule, so each run's
    draft lengths depend on the acceptances before it; also the histogram of lengths asked."""
    generator, schedule = torch.Generator().manual_seed(4321), GoodputSchedule(3, explore_interval=5)
    counts = torch.zeros(VOCAB, VOCAB)
    lengths = [0] * 4
    for _ in range(num_runs):
        lengths[schedule.draft_length] += 1
        counts[first_two_tokens_scheduled(schedule, sampled, generator, peek)] += 1
    return counts, lengths


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_draft", "deterministic_draft"])
def test_rejection_sampling_stays_lossless_under_the_goodput_schedule(sampled):
    counts, lengths = simulate_scheduled(sampled, num_runs=10_000)
    assert lengths[0] > 0 and sum(lengths[1:]) > 0 and sum(1 for n in lengths if n) >= 3  # the lengths do vary
    first, joint = statistics(counts)
    assert first < 1 and joint < 1, (first, joint)


def test_the_statistic_rejects_a_length_chosen_after_seeing_the_draft():
    first, joint = statistics(simulate_scheduled(True, num_runs=5_000, peek=True)[0])
    assert first > 5 and joint > 5, (first, joint)


# ---------------------------------------------------------------- stats, command line


def test_stats_count_draft_lengths_and_steps_without_a_draft():
    stats = hs.SpeculativeStats()
    for num_nodes, accepted, generated, draft_length in [(3, 3, 4, 3), (0, 0, 1, 0), (0, 0, 1, 2), (1, 0, 1, 1)]:
        stats.record(num_nodes, accepted, generated, draft_length=draft_length)
    assert stats.draft_lengths == [1, 1, 1, 1]
    assert stats.num_steps_without_draft == 2  # one asked for none, one got none from the drafter
    payload = json.loads(json.dumps(stats.to_dict()))
    assert payload["draft_lengths"] == [1, 1, 1, 1] and payload["num_steps_without_draft"] == 2


def test_cli_schedule_flags_and_defaults():
    parser = cli.build_parser()
    generate_args = parser.parse_args(["generate", "x"])
    assert generate_args.num_draft_tokens_schedule is None and cli.DEFAULT_GENERATE_SCHEDULE == "goodput"
    args = parser.parse_args(["generate", "x", "--num-draft-tokens-schedule", "heuristic"])
    assert cli.config_from_args(args).num_draft_tokens_schedule == "heuristic"
    bench_args = parser.parse_args(["bench", "--prompts", "p.jsonl", "--num-draft-tokens-schedule", "goodput"])
    assert bench_args.num_draft_tokens_schedule == "goodput"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--prompts", "p.jsonl", "--num-draft-tokens-schedule", "adaptive"])


def test_a_probe_that_finds_nothing_to_draft_keeps_the_wait():
    schedule = GoodputSchedule(BOUND, explore_interval=None)
    simulate_steps(schedule, 12, lambda i: 0.0, draft_cost=0.003, verify_intercept=0.01, verify_slope=0.001,
                   rng=random.Random(0))
    while not schedule.probing:
        schedule.update(step_outcomes(0, [0], [0], [0]), 0.0, 0.011)
    budget = schedule.probe_budget
    assert budget < schedule.probe_overhead  # the rejected probes before halved it
    # prompt lookup found no match: an empty draft
    schedule.update(step_outcomes(schedule.draft_length, [0], [0], [0]), 1e-5, 0.011)
    assert schedule.probe_budget == budget


def test_goodput_sampling_runs_and_heuristic_sampling_stays_reproducible(zoo):
    def sampled(schedule: str, seed: int) -> list[int]:
        out = zoo.target("llama").generate(
            prompt_ids("repetitive"), custom_generate=hs.generate, do_sample=True, top_k=0, max_new_tokens=20,
            candidate_generator=make_drafter("noisy_draft_model", 4, zoo, "llama"), num_draft_tokens_schedule=schedule,
            generator=torch.Generator().manual_seed(seed), plain_floor=False)  # the floor reads the clock
        return out[0].tolist()

    assert len(PROMPT_REPETITIVE) < len(sampled("goodput", 0)) <= len(PROMPT_REPETITIVE) + 20
    assert sampled("heuristic", 1) == sampled("heuristic", 1)
