"""Learned heads (EAGLE-3, EAGLE-1/2, Medusa) drafting for a batch: every row identical to its own plain greedy
output and drafted exactly as it is alone, rows finishing at different steps, lossless sampling per row, and the
refusal of token trees."""

import pytest
import torch
from batch_helpers import PAD, left_padded, two_token_joint
from eagle_heads import fit_lm_head, random_eagle, random_eagle3
from speculative_helpers import PROMPTS, plain_generate, prompt_ids, speculative_generate
from test_lossless import chi_square, chi_square_critical
from test_medusa import train_heads
from tiny_models import build_model
from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers import TemperatureLogitsWarper, TopKLogitsWarper

import hf_speculators as hs

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
    """Wraps `drafter`'s propose and propose_batch to keep every draft asked for: `{row: {committed length: draft
    tokens}}` (a batch asks a row with no room left for nothing, which a single sequence does not ask at all)."""
    drafts = {}
    propose, propose_batch = drafter.propose, drafter.propose_batch

    def one(input_ids, max_tokens):
        draft = propose(input_ids, max_tokens)
        drafts.setdefault(0, {})[input_ids.shape[1]] = draft.token_ids.tolist()
        return draft

    def batch(input_ids, max_tokens, rows):
        batch_drafts = propose_batch(input_ids, max_tokens, rows)
        for ids, budget, row, draft in zip(input_ids, max_tokens, rows, batch_drafts):
            if budget:
                drafts.setdefault(row, {})[ids.shape[1]] = draft.token_ids.tolist()
        return batch_drafts

    drafter.propose, drafter.propose_batch = one, batch
    return drafter, drafts


@pytest.mark.parametrize("num_draft_tokens", [1, 3, 5])
@pytest.mark.parametrize("kind", ["eagle3", "eagle", "medusa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_rows_match_their_own_greedy_output_and_drafts(heads, arch, kind, num_draft_tokens):
    """Each row's tokens are its own plain greedy output (the first row stops at an EOS, the others at
    max_new_tokens), and each row's drafts are those the drafter makes for that row alone."""
    target, make = heads[arch, kind]
    eos = int(plain_generate(target, prompt_ids(BATCH_PROMPTS[0]))[0, len(PROMPTS[BATCH_PROMPTS[0]]) + EOS_STEP])
    settings = dict(eos_token_id=eos, pad_token_id=PAD)
    input_ids, attention_mask = left_padded([PROMPTS[name] for name in BATCH_PROMPTS])
    drafter, drafts = recording(make(num_draft_tokens))
    out = speculative_generate(target, input_ids, drafter, attention_mask=attention_mask, **settings)
    lengths = []
    for row, name in enumerate(BATCH_PROMPTS):
        expected = plain_generate(target, prompt_ids(name), **settings)[0, len(PROMPTS[name]):]
        new_tokens = out[row, input_ids.shape[1]:]
        assert new_tokens[: len(expected)].tolist() == expected.tolist(), f"row {row} ({name})"
        assert (new_tokens[len(expected):] == PAD).all()
        lengths.append(len(expected))
        alone, alone_drafts = recording(make(num_draft_tokens))
        speculative_generate(target, prompt_ids(name), alone, **settings)
        assert drafts[row] == alone_drafts[0], f"row {row} ({name}) drafted differently in the batch"
    assert len(set(lengths)) > 1  # rows finished at different steps
    assert any(tokens for row_drafts in drafts.values() for tokens in row_drafts.values())


def test_sampled_eagle_chain_is_lossless_per_row(targets):
    """The first two tokens of each row under temperature and top-k, over seeded batched runs: distributed as the
    target's own, per prompt (chi-square at the 0.1% level)."""
    model, names = targets["llama"], ("random", "repetitive", "random", "repetitive")
    sequences = [plain_generate(model, prompt_ids(name)) for name in ("random", "repetitive")]
    drafter = hs.EagleDrafter(fit_lm_head(random_eagle3(30, draft_vocab_size=64), model, sequences),
                              num_draft_tokens=2)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(3)])

    joint = {name: two_token_joint(model, prompt_ids(name), warpers) for name in set(names)}
    input_ids, attention_mask = left_padded([PROMPTS[name] for name in names])
    max_length = input_ids.shape[1] + 2
    config = GenerationConfig(do_sample=True, max_length=max_length, top_k=3, temperature=0.8, num_beams=1,
                              num_return_sequences=1, output_scores=False, output_logits=False, pad_token_id=PAD,
                              return_dict_in_generate=False)
    stopping = StoppingCriteriaList([MaxLengthCriteria(max_length)])
    generator = torch.Generator().manual_seed(0)
    counts = {name: torch.zeros_like(table) for name, table in joint.items()}
    for _ in range(200):
        out = hs.generate(model, input_ids, logits_processor=warpers, stopping_criteria=stopping,
                          generation_config=config, candidate_generator=drafter, generator=generator,
                          attention_mask=attention_mask)
        for name, (first_token, second_token) in zip(names, out[:, -2:].tolist()):
            counts[name][first_token, second_token] += 1
    for name, table in joint.items():
        assert chi_square(counts[name], table) / chi_square_critical(int((table > 0).sum()) - 1) < 1, name


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_token_trees_are_refused_for_a_batch(heads, kind):
    target, make = heads["llama", kind]
    drafter = make(2)
    tree = [(0,), (1,), (0, 0)]
    drafter = (hs.EagleDrafter(drafter.head, tree=tree) if kind == "eagle3"
               else hs.MedusaDrafter(drafter.heads, tree=tree))
    input_ids, attention_mask = left_padded([PROMPTS[name] for name in BATCH_PROMPTS])
    with pytest.raises(ValueError, match=r"\(tree=\.\.\.\) drafts token trees, which batch size > 1 does not"):
        speculative_generate(target, input_ids, drafter, attention_mask=attention_mask, pad_token_id=PAD)
