"""Learned heads (EAGLE-3, EAGLE-1/2, Medusa) drafting for a batch, chains and token trees: every row identical to
its own plain greedy output and drafted exactly as it is alone, rows finishing at different steps, lossless sampling
per row (chains and EAGLE trees, with a broken-verifier control)."""

import pytest
import torch
from batch_helpers import PAD, left_padded, two_token_joint
from eagle_heads import fit_lm_head, random_eagle, random_eagle3
from speculative_helpers import PROMPTS, plain_generate, prompt_ids, speculative_generate
from test_compiled import compile_config, fresh_dynamo
from test_lossless import chi_square, chi_square_critical
from test_medusa import train_heads
from tiny_models import VOCAB_SIZE, build_model
from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers import TemperatureLogitsWarper, TopKLogitsWarper

import hf_speculators as hs
import hf_speculators.verifiers.rejection as rejection_module

ARCHS = ("llama", "qwen2")
BATCH_PROMPTS = ("random", "repetitive", "one_token")  # 8, 9 and 1 tokens
EOS_STEP = 6  # the first row's greedy token at this step is its EOS: it finishes before the others


@pytest.fixture(scope="module")
def targets():
    """4-layer fp32 targets (the EAGLE test heads read the inputs of layers 0, 2 and 3)."""
    return {arch: build_model(arch, num_layers=4, seed=1) for arch in ARCHS}


@pytest.fixture(scope="module")
def heads(targets, zoo):
    """`(target, drafter factory)` per (arch, kind): a fitted EAGLE-3 head (drafts partly accepted), a random EAGLE-1/2
    head, and trained Medusa heads (on the zoo's target)."""
    made = {}
    for arch, target in targets.items():
        sequences = [plain_generate(target, prompt_ids(name)) for name in ("random", "repetitive")]
        eagle3 = fit_lm_head(random_eagle3(30, draft_vocab_size=64), target, sequences)
        eagle = random_eagle(7)
        medusa = train_heads(zoo.target(arch), own_lm_heads=False)
        made[arch, "eagle3"] = target, lambda k, head=eagle3: hs.EagleDrafter(head, num_draft_tokens=k)
        made[arch, "eagle"] = target, lambda k, head=eagle: hs.EagleDrafter(head, num_draft_tokens=k)
        made[arch, "medusa"] = zoo.target(arch), lambda k, head=medusa: hs.MedusaDrafter(head, num_draft_tokens=k)
    return made


def recording(drafter):
    """Wraps `drafter`'s propose to keep every draft asked for: `{row: {committed length: (draft tokens, parent
    ids)}}` (rows with no room left are asked for nothing)."""
    drafts = {}
    propose = drafter.propose

    def record(state, input_ids, max_tokens, rows):
        row_drafts = propose(state, input_ids, max_tokens, rows)
        for ids, budget, row, draft in zip(input_ids, max_tokens, rows, row_drafts):
            if budget:
                drafts.setdefault(row, {})[ids.shape[1]] = (draft.token_ids.tolist(), draft.parent_ids.tolist())
        return row_drafts

    drafter.propose = record
    return drafter, drafts


def check_rows_alone(target, make, settings: dict) -> dict:
    """Runs the batch of `BATCH_PROMPTS` and each prompt alone with drafters from `make()`: each row's tokens are
    its own plain greedy output (the first row stops at an EOS, the others at max_new_tokens) and its drafts are
    those it gets alone. Returns the batch's drafts."""
    input_ids, attention_mask = left_padded([PROMPTS[name] for name in BATCH_PROMPTS])
    drafter, drafts = recording(make())
    # without the floor, which reads the clock: the drafts of a row must be those it gets alone
    out = speculative_generate(target, input_ids, drafter, attention_mask=attention_mask, plain_floor=False,
                               **settings)
    lengths = []
    for row, name in enumerate(BATCH_PROMPTS):
        expected = plain_generate(target, prompt_ids(name), **settings)[0, len(PROMPTS[name]):]
        new_tokens = out[row, input_ids.shape[1]:]
        assert new_tokens[: len(expected)].tolist() == expected.tolist(), f"row {row} ({name})"
        assert (new_tokens[len(expected):] == PAD).all()
        lengths.append(len(expected))
        alone, alone_drafts = recording(make())
        speculative_generate(target, prompt_ids(name), alone, plain_floor=False, **settings)
        assert drafts[row] == alone_drafts[0], f"row {row} ({name}) drafted differently in the batch"
    assert len(set(lengths)) > 1  # rows finished at different steps
    return drafts


def eos_settings(target) -> dict:
    """An EOS token that the first row generates at step `EOS_STEP`, so that it finishes first."""
    eos = int(plain_generate(target, prompt_ids(BATCH_PROMPTS[0]))[0, len(PROMPTS[BATCH_PROMPTS[0]]) + EOS_STEP])
    return dict(eos_token_id=eos, pad_token_id=PAD)


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rows_match_their_own_greedy_output_and_drafts(heads, arch, kind, num_draft_tokens):
    target, make = heads[arch, kind]
    drafts = check_rows_alone(target, lambda: make(num_draft_tokens), eos_settings(target))
    assert any(tokens for row_drafts in drafts.values() for tokens, _ in row_drafts.values())


def test_compiled_eagle3_rows_match_the_eager_batch(heads, monkeypatch):
    """Compiled steps with the EAGLE-3 head compiled over a static head cache whose rows keep their place after they
    finish (`RaggedCache(fixed_rows=True)`): the same tokens and drafts as the eager batch over dynamic caches (each
    row its own greedy output and the drafts it gets alone: `test_rows_match_their_own_greedy_output_and_drafts`)."""
    fresh_dynamo()
    compiled_rows = []  # the rows of each compiled head forward
    head_forward = hs.EagleDrafter._run

    def run(self, state, token_ids, *args, call=None):
        compiled_rows.append(len(token_ids)) if call is not None else None
        return head_forward(self, state, token_ids, *args, call=call)

    monkeypatch.setattr(hs.EagleDrafter, "_run", run)
    target, make = heads["llama", "eagle3"]
    input_ids, attention_mask = left_padded([PROMPTS[name] for name in BATCH_PROMPTS])
    outputs = []
    for compile_settings in ({}, dict(cache_implementation="static", compile_config=compile_config("eager"))):
        drafter, drafts = recording(make(3))
        out = speculative_generate(target, input_ids, drafter, attention_mask=attention_mask, plain_floor=False,
                                   **eos_settings(target), **compile_settings)
        outputs.append((out.tolist(), drafts))
    assert outputs[1] == outputs[0]
    assert {3, 2} <= set(compiled_rows)  # the batch, then without the rows that finished
    assert any(tokens for row_drafts in outputs[0][1].values() for tokens, _ in row_drafts.values())


TREES = {
    "eagle3": lambda head: hs.EagleDrafter(head, tree=hs.DynamicTree(depth=3, top_k=2, num_nodes=6)),
    "eagle3-static": lambda head: hs.EagleDrafter(head, tree=[(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]),
    "medusa": lambda heads: hs.MedusaDrafter(heads, tree="medusa", num_draft_tokens=3),
    "medusa-dynamic": lambda heads: hs.MedusaDrafter(heads, tree=hs.DynamicTree(depth=3, top_k=2, num_nodes=6)),
}


@pytest.mark.parametrize("kind", TREES)
@pytest.mark.parametrize("arch", ARCHS)
def test_token_trees_in_a_batch_match_each_rows_own_greedy_output(heads, arch, kind):
    """Batch size 3, each row a tree of its own shape in the same forwards: each row its own plain greedy output,
    drafted as alone."""
    target, make = heads[arch, kind.split("-")[0]]
    module = make(1).module  # the fitted EAGLE-3 head, or the trained Medusa heads
    drafts = check_rows_alone(target, lambda: TREES[kind](module), eos_settings(target))
    shapes = {tuple(parents) for row_drafts in drafts.values() for _, parents in row_drafts.values()}
    assert any(parents != list(range(-1, len(parents) - 1)) for parents in shapes)  # trees, not chains
    if kind == "eagle3":  # a dynamic tree: rows (and steps) draft trees of different shapes
        assert len(shapes) > 1


SAMPLING_NAMES = ("random", "repetitive") * 16  # rows alternate two prompts: rows mixed up would show
SAMPLING_CALLS = 40


def sampled_ratios(model, drafter, verifier=None) -> tuple[dict, int]:
    """Each prompt's chi-square statistic over its upper 0.1% quantile (pass below 1) for its rows' first two
    tokens over `SAMPLING_CALLS` seeded batched calls under top-3 sampling at temperature 0.8, against the target's
    own distribution; and the draft tokens accepted."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(3)])
    input_ids, attention_mask = left_padded([PROMPTS[name] for name in SAMPLING_NAMES])
    max_length = input_ids.shape[1] + 2
    config = GenerationConfig(do_sample=True, max_length=max_length, top_k=3, temperature=0.8, num_beams=1,
                              num_return_sequences=1, output_scores=False, output_logits=False, pad_token_id=PAD,
                              return_dict_in_generate=True)
    stopping = StoppingCriteriaList([MaxLengthCriteria(max_length)])
    generator = torch.Generator().manual_seed(0)
    counts = {name: torch.zeros(VOCAB_SIZE, VOCAB_SIZE) for name in set(SAMPLING_NAMES)}
    accepted = 0
    for _ in range(SAMPLING_CALLS):
        out = hs.generate(model, input_ids, logits_processor=warpers, stopping_criteria=stopping,
                          generation_config=config, candidate_generator=drafter, generator=generator,
                          verifier=verifier, attention_mask=attention_mask)
        accepted += out.speculative_stats.num_accepted_tokens
        for name, (first_token, second_token) in zip(SAMPLING_NAMES, out.sequences[:, -2:].tolist()):
            counts[name][first_token, second_token] += 1
    joint = {name: two_token_joint(model, prompt_ids(name), warpers) for name in counts}
    ratios = {name: chi_square(counts[name], joint[name]) / chi_square_critical(int((joint[name] > 0).sum()) - 1)
              for name in counts}
    return ratios, accepted


def test_sampled_eagle_chains_are_lossless_per_row(heads):
    """Sampled chains (`draft_probs` of a reduced draft vocabulary) in a batch: each row follows its own prompt's
    distribution."""
    model, make = heads["llama", "eagle3"]
    ratios, accepted = sampled_ratios(model, make(2))
    assert 0 < accepted < SAMPLING_CALLS * len(SAMPLING_NAMES) * 2
    assert all(ratio < 1 for ratio in ratios.values()), ratios


@pytest.fixture(scope="module")
def eagle_tree(heads):
    target, make = heads["llama", "eagle3"]
    return target, hs.EagleDrafter(make(1).head, tree=hs.DynamicTree(depth=2, top_k=2, num_nodes=4))


def test_rejection_sampling_with_an_eagle_tree_in_a_batch_is_lossless_per_row(eagle_tree):
    """Each row's first two tokens follow its own prompt's distribution, with deterministic tree nodes (one-hot
    under rejection sampling) accepted and rejected."""
    model, drafter = eagle_tree
    ratios, accepted = sampled_ratios(model, drafter)
    assert 0 < accepted < SAMPLING_CALLS * len(SAMPLING_NAMES) * 2
    assert all(ratio < 1 for ratio in ratios.values()), ratios


def test_the_tree_sampling_test_catches_a_broken_verifier(eagle_tree, monkeypatch):
    """The same statistic fails (three times its bound) when a rejected node's token is not taken out of the
    target's distribution (the next sibling and the recovered token are drawn from p instead of the residual)."""
    monkeypatch.setattr(rejection_module, "residual_distribution", lambda target_probs, draft_probs: target_probs)
    model, drafter = eagle_tree
    ratios, _ = sampled_ratios(model, drafter, verifier=hs.RejectionVerifier())
    assert all(ratio > 3 for ratio in ratios.values()), ratios
