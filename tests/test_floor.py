"""The plain-speed floor: it holds a row plain when its drafts are always wrong (and not when they are always
right), per row in a batch, with bounded probes; exact output and lossless sampling with it."""

import pytest
import torch

import hf_speculators as hs
from batch_helpers import PAD
from drafters_for_tests import ReferenceDrafter
from hf_speculators.floor import PlainFloor
from speculative_helpers import assert_same_tokens, make_drafter, prompt_ids
from test_lossless import START_TOKEN, VOCAB, draft_chain, statistics, target_scores
from test_schedules import simulated_clock, step_outcomes

MAX_NEW_TOKENS = 40
K = 4
COSTS = (0.010, 0.001)  # the simulated target forward: 10 ms plus 1 ms per token


def floor_run(zoo, arch: str, drafter, monkeypatch, input_ids=None, **kwargs):
    """Greedy constant-schedule generate under the simulated clock; returns the output."""
    input_ids = prompt_ids("repetitive") if input_ids is None else input_ids
    with simulated_clock(monkeypatch, {zoo.target(arch): COSTS}):
        return zoo.target(arch).generate(
            input_ids, custom_generate=hs.generate, candidate_generator=drafter, do_sample=False,
            max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_floor_holds_an_always_wrong_drafter_plain_and_probes(zoo, arch, monkeypatch):
    expected = zoo.reference(arch, "repetitive", max_new_tokens=MAX_NEW_TOKENS)
    drafter = make_drafter("adversary", K, zoo, arch, reference=expected)
    out = floor_run(zoo, arch, drafter, monkeypatch)
    assert_same_tokens(out.sequences, expected)
    stats = out.speculative_stats
    assert stats.num_floor_steps >= stats.num_steps * 3 // 4
    # the constant schedule asks for K every step but where the length limit leaves less (the last step)
    assert stats.num_floor_steps <= stats.draft_lengths[0] <= stats.num_floor_steps + 1
    assert 4 < stats.num_drafts == len(drafter.proposals) <= 4 + 8  # four drafted steps, then a few probes


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_floor_never_engages_on_an_always_right_drafter(zoo, arch, monkeypatch):
    expected = zoo.reference(arch, "repetitive", max_new_tokens=MAX_NEW_TOKENS)
    out = floor_run(zoo, arch, make_drafter("oracle", K, zoo, arch, reference=expected), monkeypatch)
    assert_same_tokens(out.sequences, expected)
    assert out.speculative_stats.num_floor_steps == 0 and out.speculative_stats.num_steps_without_draft == 0


def test_without_the_floor_an_always_wrong_drafter_drafts_every_step(zoo, monkeypatch):
    expected = zoo.reference("llama", "repetitive", max_new_tokens=MAX_NEW_TOKENS)
    out = floor_run(zoo, "llama", make_drafter("adversary", K, zoo, "llama", reference=expected), monkeypatch,
                    plain_floor=False)
    stats = out.speculative_stats
    assert stats.num_floor_steps == 0 and stats.num_drafts >= stats.num_steps - K


class RowDrafter(ReferenceDrafter):
    """Right in row 0, always wrong in every other row."""

    name = "row-test"

    def __init__(self, reference: torch.LongTensor, num_draft_tokens: int):
        super().__init__(reference, num_draft_tokens, num_correct=num_draft_tokens)
        self.rows_drafted: list[int] = []

    def draft_row(self, state, input_ids, max_tokens, row):
        self.num_correct = self.num_draft_tokens if row == 0 else 0
        if max_tokens:
            self.rows_drafted.append(row)
        return super().draft_row(state, input_ids, max_tokens, row)


def test_in_a_batch_the_floor_holds_only_the_losing_row_plain(zoo, monkeypatch):
    expected = zoo.reference("llama", "repetitive", max_new_tokens=MAX_NEW_TOKENS)
    drafter = RowDrafter(expected, K)
    out = floor_run(zoo, "llama", drafter, monkeypatch, input_ids=prompt_ids("repetitive").repeat(2, 1),
                    attention_mask=torch.ones(2, expected.shape[1] - MAX_NEW_TOKENS, dtype=torch.long),
                    pad_token_id=PAD)
    assert_same_tokens(out.sequences, expected.repeat(2, 1))
    winner, loser = out.speculative_stats.row_stats
    assert winner.num_floor_steps == 0 and winner.acceptance_rate == 1.0
    assert loser.num_floor_steps >= loser.num_steps * 2 // 3
    # the drafter was asked for row 1 only on its drafted steps (the first three and the probes): with row 0
    # drafting as deep, row 1's draft adds no query slots, so its probes are cheap and come often
    assert drafter.rows_drafted.count(1) == loser.num_drafts == sum(loser.draft_lengths[1:])


# ---------------------------------------------------------------- decisions on synthetic steps


def feed(floor: PlainFloor, num_steps: int, tokens_per_draft: int, plain=0.010, extra=0.004,
         probe_extra: float | None = None) -> list[int]:
    """Steps of one row asking for K tokens: a drafted step commits `tokens_per_draft` tokens and costs `plain +
    extra` seconds (a probe `plain + probe_extra`, default the same), a plain one `plain`. Returns the draft lengths
    the floor let through."""
    lengths = []
    for _ in range(num_steps):
        k = floor.budgets([0], [K])[0]
        cost = probe_extra if probe_extra is not None and 0 in floor.probing else extra
        nodes, accepted = (K, tokens_per_draft - 1) if k else (0, 0)
        floor.update(step_outcomes(k, [nodes], [nodes], [accepted]), cost if k else 0.0, plain)
        lengths.append(k)
    return lengths


def test_probe_waits_grow_with_the_probes_cost_and_a_winning_probe_resets_them():
    """A probe costs 0.4 plain steps: it waits until that is at most 1/2, 1/4, ... 1/32 of the plain steps since
    the last one (1, 2, 4, 7, 13 steps), with the first plain step measured after the row's fourth draft."""
    floor = PlainFloor()
    lengths = feed(floor, 120, tokens_per_draft=1)
    drafted = [i for i, k in enumerate(lengths) if k]
    assert drafted[:4] == [0, 1, 2, 3]
    gaps = [b - a - 1 for a, b in zip(drafted[4:], drafted[5:])]  # plain steps between probes
    assert gaps[:4] == [2, 4, 7, 13] and set(gaps[4:]) == {13}
    assert floor.num_plain_steps(0) == lengths.count(0)
    lengths = feed(floor, 40, tokens_per_draft=K + 1)  # the text became easy: the next probe wins the row back
    assert lengths[-10:] == [K] * 10 and floor.rows[0].budget == 0.5


def test_a_probes_catch_up_counts_in_its_waits_not_in_what_a_drafted_step_costs():
    """Drafted steps cost 0.4 plain steps, a probe 2 (it also catches up on the plain steps before it). A row whose
    drafts commit 1 token is held plain, its waits grown from the probe's cost (8, 16, 32 plain steps); when its
    drafts turn to 2 tokens (break-even at a drafted step's cost: 1.4) the next probe wins it back for good. Had the
    probes counted as drafted steps, a drafted step would seem to cost about 1 plain step more, and 2 tokens would
    not pay."""
    floor = PlainFloor()
    lengths = feed(floor, 80, tokens_per_draft=1, probe_extra=0.020)
    drafted = [i for i, k in enumerate(lengths) if k]
    assert [b - a - 1 for a, b in zip(drafted[4:], drafted[5:])] == [8, 16, 32]
    assert floor.drafted_seconds == pytest.approx(0.014)
    lengths = feed(floor, 40, tokens_per_draft=2, probe_extra=0.020)
    assert lengths[-20:] == [K] * 20


def test_a_free_drafter_probes_every_step_or_two():
    floor = PlainFloor()
    lengths = feed(floor, 40, tokens_per_draft=1, extra=0.0005)  # a probe costs 1/20 of a plain step
    runs = "".join("p" if k == 0 else "d" for k in lengths[3:]).split("d")  # the stretches of plain steps
    assert lengths[3:].count(0) > 0 and max(map(len, runs)) <= 2  # at most ceil(32 / 20) plain steps per probe


def test_a_row_at_break_even_costs_keeps_drafting_only_when_its_tokens_pay():
    """A drafted step costs 1.4 plain steps: 1.6 tokens per draft pay, 1.2 do not."""
    for tokens, pays in ((2, True), (1, False)):
        floor = PlainFloor(memory=0.0)
        lengths = feed(floor, 30, tokens_per_draft=tokens)
        assert (lengths[-10:].count(0) == 0) == pays


def test_in_a_batch_each_row_is_judged_against_the_plain_steps_it_would_run():
    """Two rows committing 1 and 2 tokens by turns (about 1.5 per draft) at 3 ms per drafting row over a 10 ms plain
    step: each pays alone (break-even 1.3 tokens), so both keep drafting; the batch's tokens per second (1.5 - 1
    tokens for 3 ms against 2 rows' tokens for 10 ms) would have held both plain, though the call waits for its
    last row whatever the other does."""
    floor = PlainFloor()
    drafted = []
    for step in range(40):
        lengths = floor.budgets([0, 1], [K, K])
        accepted = [step % 2 if k else 0 for k in lengths]
        nodes = [K if k else 0 for k in lengths]
        floor.update(step_outcomes(K, nodes, nodes, accepted), 0.003 * sum(map(bool, lengths)), 0.010)
        drafted.append(lengths)
    assert all(lengths == [K, K] for lengths in drafted[-20:])
    assert floor.num_plain_steps(0) + floor.num_plain_steps(1) <= 2  # the first drafts' average is low


@pytest.mark.parametrize("tokens, held", [(1.2, True), (3.0, False)])
def test_a_floor_started_from_an_earlier_call_judges_a_row_from_its_first_step(tokens, held):
    """An earlier call measured plain steps of 10 ms and drafted ones of 20 ms (break-even: 2 tokens a step)."""
    floor = PlainFloor()
    floor.start_from(((0.010, 0.020, 0.012, 1.0), tokens, 0.5))
    assert floor.budgets([0], [K]) == [0 if held else K]
    if held:  # probes as usual: a free wait of ceil(1 / 0.5) = 2 plain steps
        assert [floor.budgets([0], [K])[0] for _ in range(2)] == [0, K]


# ---------------------------------------------------------------- losslessness with the floor's decisions


def first_two_tokens_under_the_floor(floor: PlainFloor, sampled: bool, generator: torch.Generator,
                                     peek: bool = False):
    """Speculative steps from START_TOKEN until two tokens are produced, each drafting what the floor lets through
    of 3 tokens (synthetic timings). `peek=True` breaks the rule on purpose: it drops a draft after looking at it.
    Returns the two tokens and the steps that drafted."""
    produced, verifier, drafted = [], hs.RejectionVerifier(), 0
    while len(produced) < 2:
        last = produced[-1] if produced else START_TOKEN
        k = floor.budgets([0], [3])[0]
        drafted += k > 0
        draft = draft_chain(last, k, sampled, generator) if k else hs.Draft.empty("cpu")
        if peek and k and int(draft.token_ids[0]) != int(target_scores(last, draft)[0].argmax()):
            draft = hs.Draft.empty("cpu")
        verdict = verifier(draft, target_scores(last, draft), do_sample=True, generator=generator)
        produced += draft.token_ids[verdict.accepted_nodes].tolist() + [int(verdict.next_token)]
        n = draft.num_nodes
        floor.update(step_outcomes(k, [n], [n], [verdict.num_accepted]), 0.006 * n, 0.01 + 0.001 * (n + 1))
    return (produced[0], produced[1]), drafted


def simulate_floor(sampled: bool, num_runs: int, peek: bool = False) -> tuple[torch.Tensor, int, int]:
    """Counts `(VOCAB, VOCAB)` of the first two tokens over runs sharing one floor (its decisions depend on the
    acceptances before), and the floor's plain steps and drafted steps."""
    generator, floor = torch.Generator().manual_seed(1234), PlainFloor(max_wait=2)
    counts, drafted = torch.zeros(VOCAB, VOCAB), 0
    for _ in range(num_runs):
        tokens, num_drafted = first_two_tokens_under_the_floor(floor, sampled, generator, peek)
        counts[tokens] += 1
        drafted += num_drafted
    return counts, floor.num_plain_steps(0), drafted


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_draft", "deterministic_draft"])
def test_rejection_sampling_stays_lossless_under_the_floor(sampled):
    counts, plain_steps, drafted = simulate_floor(sampled, num_runs=10_000)
    assert plain_steps > 1000 and drafted > 1000  # the floor does switch
    first, joint = statistics(counts)
    assert first < 1 and joint < 1, (first, joint)


def test_the_statistic_rejects_a_draft_dropped_after_seeing_it_under_the_floor():
    first, joint = statistics(simulate_floor(True, num_runs=10_000, peek=True)[0])
    assert first > 5 and joint > 5, (first, joint)


@pytest.mark.parametrize("plain_floor, engages", [(None, False), (True, True)])
def test_under_sampling_the_floor_is_off_unless_asked(zoo, monkeypatch, plain_floor, engages):
    """Off by default under sampling (the floor's clock reads would change a seeded sample), on with True."""
    expected = zoo.reference("llama", "repetitive", max_new_tokens=MAX_NEW_TOKENS)
    drafter = make_drafter("adversary", K, zoo, "llama", reference=expected)
    with simulated_clock(monkeypatch, {zoo.target("llama"): COSTS}):
        out = zoo.target("llama").generate(
            prompt_ids("repetitive"), custom_generate=hs.generate, candidate_generator=drafter, do_sample=True,
            top_k=1, max_new_tokens=MAX_NEW_TOKENS, return_dict_in_generate=True, plain_floor=plain_floor)
    assert (out.speculative_stats.num_floor_steps > 0) == engages
