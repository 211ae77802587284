"""Rejection sampling keeps the target's distribution: closed form, Monte Carlo, and seeded end-to-end sampling."""

import math

import pytest
import torch
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import hf_speculators as hs
import hf_speculators.drafters.base as drafter_base_module
import hf_speculators.loop as loop_module
import hf_speculators.verifiers.rejection as rejection_module
from hf_speculators.sampling import process_logits, residual_distribution, sample
from speculative_helpers import make_drafter, prompt_ids, speculative_generate
from tiny_models import ARCHS

VOCAB = 6


def random_distribution(generator: torch.Generator, size: int = VOCAB, sharpness: float = 1.5) -> torch.Tensor:
    return torch.softmax(sharpness * torch.randn(size, generator=generator, dtype=torch.float64), dim=-1)


# ---------------------------------------------------------------- (1) one step, in closed form


def one_step_output_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """P(output = x) of one rejection step: accept the draft x ~ q with min(1, p/q), else sample the residual."""
    ratio = torch.where(draft_probs > 0, target_probs / draft_probs, torch.ones_like(target_probs))
    accept = draft_probs * ratio.clamp(max=1.0)
    reject_probability = 1.0 - accept.sum()
    return accept + reject_probability * residual_distribution(target_probs, draft_probs)


def identity_cases():
    generator = torch.Generator().manual_seed(0)
    cases = {f"random_{i}": (random_distribution(generator), random_distribution(generator)) for i in range(20)}
    p, q = random_distribution(generator), random_distribution(generator)
    cases["draft_equals_target"] = (p, p.clone())
    cases["one_hot_draft"] = (p, torch.eye(VOCAB, dtype=torch.float64)[2])  # a deterministic drafter
    q_missing = q.clone()
    q_missing[:2] = 0  # the draft can never propose tokens 0 and 1
    cases["draft_misses_tokens"] = (p, q_missing / q_missing.sum())
    p_missing = p.clone()
    p_missing[3:] = 0  # after top-k, the target gives tokens 3.. no mass
    cases["target_misses_tokens"] = (p_missing / p_missing.sum(), q)
    return cases


IDENTITY_CASES = identity_cases()


@pytest.mark.parametrize("case", IDENTITY_CASES)
def test_one_step_identity(case):
    target_probs, draft_probs = IDENTITY_CASES[case]
    output = one_step_output_distribution(target_probs, draft_probs)
    torch.testing.assert_close(output, target_probs, rtol=0, atol=1e-12)


def test_residual_distribution_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.2, 0.4, 0.1, 0.3])
    torch.testing.assert_close(residual_distribution(p, q), torch.tensor([0.75, 0.0, 0.25, 0.0]))


# ---------------------------------------------------------------- (2) Monte Carlo on a chain

NUM_RUNS = 20_000


def markov_table(seed: int, sharpness: float) -> torch.Tensor:
    """`(VOCAB, VOCAB)` next-token distributions: row t is the distribution after token t."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([random_distribution(generator, sharpness=sharpness) for _ in range(VOCAB)]).float()


# The target and the draft are first-order Markov "models": the verifier sees target_scores built from the draft
# tokens, so the test covers position-dependent (not just fixed) target distributions.
TARGET = markov_table(seed=1, sharpness=1.5)
DRAFT = markov_table(seed=2, sharpness=1.5)
START_TOKEN = 0


def draft_chain(last_token: int, num_draft_tokens: int, sampled: bool, generator: torch.Generator) -> hs.Draft:
    """A chain drawn from DRAFT (sampled, with draft_probs) or its argmax path (deterministic, no draft_probs)."""
    tokens, probs = [], []
    for _ in range(num_draft_tokens):
        row = DRAFT[tokens[-1] if tokens else last_token]
        tokens.append(int(sample(row, generator)) if sampled else int(row.argmax()))
        probs.append(row)
    return hs.Draft.chain(torch.tensor(tokens), torch.stack(probs) if sampled else None)


def target_scores(last_token: int, draft: hs.Draft) -> torch.Tensor:
    """`(k + 1, VOCAB)` log-probabilities of TARGET after the last token and after each draft token."""
    previous = [last_token] + draft.token_ids.tolist()
    return TARGET[previous].log()


def first_two_tokens(verifier, num_draft_tokens: int, sampled: bool, generator: torch.Generator) -> tuple[int, int]:
    """Runs speculative steps from START_TOKEN until two tokens are produced; returns them."""
    produced = []
    while len(produced) < 2:
        last = produced[-1] if produced else START_TOKEN
        draft = draft_chain(last, num_draft_tokens, sampled, generator)
        verdict = verifier(draft, target_scores(last, draft), do_sample=True, generator=generator)
        produced += draft.token_ids[verdict.accepted_nodes].tolist() + [int(verdict.next_token)]
    return produced[0], produced[1]


def simulate(verifier, num_draft_tokens: int, sampled: bool, num_runs: int = NUM_RUNS) -> torch.Tensor:
    """`(VOCAB, VOCAB)` counts of the first two produced tokens over `num_runs` seeded runs."""
    generator = torch.Generator().manual_seed(1234)
    counts = torch.zeros(VOCAB, VOCAB)
    for _ in range(num_runs):
        counts[first_two_tokens(verifier, num_draft_tokens, sampled, generator)] += 1
    return counts


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic; a count where the probability is 0 makes it infinite."""
    counts, expected = counts.flatten().double(), probs.flatten().double() * counts.sum()
    if bool((counts[expected == 0] > 0).any()):
        return math.inf
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def chi_square_critical(degrees_of_freedom: int, z: float = 3.09) -> float:
    """Upper 0.1% quantile of chi-square (Wilson-Hilferty approximation, z = 3.09 for 0.001)."""
    c = 2 / (9 * degrees_of_freedom)
    return degrees_of_freedom * (1 - c + z * math.sqrt(c)) ** 3


TARGET_FIRST = TARGET[START_TOKEN]  # [VOCAB]
TARGET_JOINT = TARGET_FIRST[:, None] * TARGET  # [VOCAB, VOCAB]: P(x1) P(x2 | x1)


def statistics(counts: torch.Tensor) -> tuple[float, float]:
    """(first-token statistic / its critical value, joint statistic / its critical value): pass below 1."""
    first = chi_square(counts.sum(1), TARGET_FIRST) / chi_square_critical(VOCAB - 1)
    joint = chi_square(counts, TARGET_JOINT) / chi_square_critical(VOCAB * VOCAB - 1)
    return first, joint


class AlwaysAcceptVerifier(hs.Verifier):
    """Broken on purpose: keeps every draft token, then samples a bonus token from the target."""

    name = "always-accept"
    lossless = False

    def __call__(self, draft, target_scores, *, do_sample, generator):
        bonus = sample(torch.softmax(target_scores[-1], dim=-1), generator)
        return hs.Verdict(accepted_nodes=torch.arange(draft.num_nodes), next_token=bonus)


def test_draft_differs_from_target_enough_to_matter():
    """Half the draft mass or more disagrees with the target, so acceptance and rejection paths both run."""
    total_variation = 0.5 * (TARGET - DRAFT).abs().sum(-1)
    assert bool((total_variation > 0.3).all())


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_draft", "deterministic_draft"])
@pytest.mark.parametrize("num_draft_tokens", [1, 3])
def test_rejection_sampling_keeps_target_distribution(num_draft_tokens, sampled):
    first, joint = statistics(simulate(hs.RejectionVerifier(), num_draft_tokens, sampled))
    assert first < 1 and joint < 1, (first, joint)


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled_draft", "deterministic_draft"])
@pytest.mark.parametrize("broken", ["recovered_from_target", "always_accept"])
def test_the_statistic_rejects_a_broken_verifier(monkeypatch, broken, sampled):
    """The bound is meaningful: the same test fails by far when the verifier is subtly or grossly wrong."""
    if broken == "recovered_from_target":
        # after a rejection, sample from p instead of norm(max(0, p - q)): rejected tokens come back too often
        monkeypatch.setattr(rejection_module, "residual_distribution", lambda target_probs, draft_probs: target_probs)
        verifier = hs.RejectionVerifier()
    else:
        verifier = AlwaysAcceptVerifier()
    first, joint = statistics(simulate(verifier, 3, sampled, num_runs=NUM_RUNS // 4))
    assert first > 5 and joint > 5, (first, joint)


# ---------------------------------------------------------------- (3) end to end


@pytest.mark.parametrize("kind", ["prompt_lookup", "draft_model", "noisy_draft_model"])
@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_sampling_is_reproducible(zoo, arch, kind):
    def sampled_output(seed: int) -> list[int]:
        drafter = make_drafter(kind, 4, zoo, arch)
        generator = torch.Generator().manual_seed(seed)
        out = speculative_generate(zoo.target(arch), prompt_ids("repetitive"), drafter, do_sample=True,
                                   generator=generator, top_k=0, plain_floor=False)  # the floor reads the clock
        return out[0].tolist()

    assert sampled_output(0) == sampled_output(0)
    assert len({tuple(sampled_output(seed)) for seed in (1, 2, 3)}) > 1  # the seed matters


def test_global_seed_makes_sampling_reproducible(zoo):
    """Without generator=, the loop's generator is seeded from torch's global RNG."""

    def sampled_output(seed: int) -> list[int]:
        torch.manual_seed(seed)
        out = speculative_generate(zoo.target("llama"), prompt_ids("random"), hs.PromptLookupDrafter(4),
                                   do_sample=True, top_k=0, plain_floor=False)
        return out[0].tolist()

    assert sampled_output(7) == sampled_output(7)
    assert sampled_output(7) != sampled_output(8)


def test_generator_argument_through_enable(zoo, fresh_target):
    model = hs.enable(fresh_target)

    def sampled_output(seed: int) -> list[int]:
        out = model.generate(prompt_ids("random"), candidate_generator=hs.DraftModelDrafter(zoo.draft("llama"), 3),
                             do_sample=True, top_k=0, max_new_tokens=20, generator=torch.Generator().manual_seed(seed),
                             plain_floor=False)  # the floor reads the clock
        return out[0].tolist()

    assert sampled_output(3) == sampled_output(3)
    assert sampled_output(3) != sampled_output(4)


@pytest.mark.parametrize("drafter_kind", ["draft_model", "layer_skip", "layer_skip_draft_vocab"])
def test_speculative_sampling_matches_the_target_distribution_end_to_end(zoo, drafter_kind):
    """First two tokens of `hs.generate` with top-k and temperature: distributed as the target's.

    The draft model (a perturbed copy of the target) and the target's own first layer (layer skip, drafting into
    the target's cache) overlap the target's top-3 in part, so accepted draft tokens, recovered tokens and bonus
    tokens all occur; with a draft vocabulary of every other token, layer skip never drafts part of that support.
    Temperature and top-k process every position of a step in one call (`sampling.rows_independent`).
    """
    statistic = end_to_end_statistic(zoo, drafter_kind)
    assert statistic < 1, statistic


def test_the_end_to_end_statistic_rejects_broken_logits_processing(zoo, monkeypatch):
    """The bound is meaningful for the processing of a step's positions: when every position of a step takes the
    processed scores of its first position (rows mixed up, as a wrong batched processing would), the test fails."""

    def first_row_for_all(logits_processor, prefixes, logits):
        scores = process_logits(logits_processor, prefixes, logits)
        return scores[:1].expand_as(scores).clone()

    monkeypatch.setattr(loop_module, "process_logits", first_row_for_all)
    monkeypatch.setattr(drafter_base_module, "process_logits", first_row_for_all)
    statistic = end_to_end_statistic(zoo, "draft_model", num_runs=500)
    assert statistic > 5, statistic


def end_to_end_statistic(zoo, drafter_kind: str, num_runs: int = 2000) -> float:
    """The chi-square statistic over its critical value (pass below 1) of the first two tokens of `num_runs`
    seeded `hs.generate` calls against the target's joint distribution, with temperature 0.8 and top-k 3.

    Calls `hs.generate` directly with the processors transformers would build, to keep the runs fast.
    """
    model, prompt = zoo.target("llama"), prompt_ids("random")
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(3)])

    def target_distribution(input_ids):
        logits = model(input_ids).logits[:, -1].float()
        return torch.softmax(warpers(input_ids, logits), dim=-1)[0]

    with torch.no_grad():
        first = target_distribution(prompt)
        support = first.nonzero().flatten().tolist()
        joint = torch.zeros(len(support), model.config.vocab_size)
        for i, token in enumerate(support):
            joint[i] = first[token] * target_distribution(torch.cat([prompt, torch.tensor([[token]])], dim=-1))

    generator = torch.Generator().manual_seed(0)
    drafter = {  # both partly accepted
        "draft_model": lambda: hs.DraftModelDrafter(zoo.noisy_draft("llama"), num_draft_tokens=2),
        "layer_skip": lambda: hs.LayerSkipDrafter(exit_layer=1, num_draft_tokens=2),
        # half the vocabulary: the target's support is partly outside it, so some tokens are never drafted
        "layer_skip_draft_vocab": lambda: hs.LayerSkipDrafter(exit_layer=1, num_draft_tokens=2,
                                                             draft_vocab=range(0, model.config.vocab_size, 2)),
    }[drafter_kind]()
    # the fields a transformers-prepared config has set (a fresh GenerationConfig leaves them None)
    config = GenerationConfig(do_sample=True, max_length=prompt.shape[1] + 2, top_k=3, temperature=0.8, num_beams=1,
                              num_return_sequences=1, output_scores=False, output_logits=False,
                              return_dict_in_generate=False)
    stopping = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + 2)])
    counts = torch.zeros_like(joint)
    for _ in range(num_runs):
        out = hs.generate(model, prompt, logits_processor=warpers, stopping_criteria=stopping,
                          generation_config=config, candidate_generator=drafter, generator=generator)
        first_token, second_token = out[0, -2:].tolist()
        counts[support.index(first_token), second_token] += 1
    return chi_square(counts, joint) / chi_square_critical(int((joint > 0).sum()) - 1)
