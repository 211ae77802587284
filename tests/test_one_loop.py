"""The one loop: token trees in batches, attention implementations, per-call state, unverified query tokens."""

import threading

import pytest
import torch
from transformers import DynamicCache

import hf_speculators as hs
from batch_helpers import PAD, batched_generate, laid_out
from hf_speculators.cache import RaggedCache
from hf_speculators.drafters.base import StepFeedback
from hf_speculators.query import Query, forward
from speculative_helpers import PROMPTS, plain_generate, prompt_ids, speculative_generate
from tiny_models import ARCHS, build_target

NAMES = ("random", "one_token", "repetitive")


def expected_rows(zoo, arch: str, names=NAMES, model=None) -> torch.LongTensor:
    model = model if model is not None else zoo.target(arch)
    outputs = [plain_generate(model, prompt_ids(name))[0].tolist() for name in names]
    return laid_out([PROMPTS[name] for name in names], outputs)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_lookup_trees_in_a_batch_are_each_rows_own_greedy_output(zoo, arch):
    """Rows with different trie shapes (and no draft at all) in one forward, each its own plain greedy output."""
    drafter = hs.PromptLookupDrafter(num_draft_tokens=4, max_ngram_size=2, num_candidates=3)
    out = batched_generate(zoo.target(arch), drafter, [PROMPTS[name] for name in NAMES])
    assert torch.equal(out.sequences, expected_rows(zoo, arch))
    assert sum(row.num_drafts for row in out.speculative_stats.row_stats) > 0


@pytest.mark.parametrize("num_candidates", [1, 3])
def test_exact_under_eager_attention(num_candidates):
    """Chains and trees, one row and three, under eager attention (sdpa is every other test's). flex_attention is
    not tested: on a CPU, torch 2.13's inductor fails to compile its kernel (so it is refused for custom masks)."""
    model = build_target("llama")
    model.set_attn_implementation("eager")
    drafter = hs.PromptLookupDrafter(num_draft_tokens=4, max_ngram_size=2, num_candidates=num_candidates)
    single = speculative_generate(model, prompt_ids("repetitive"), drafter)
    assert torch.equal(single, plain_generate(model, prompt_ids("repetitive")))
    out = batched_generate(model, drafter, [PROMPTS[name] for name in NAMES])
    assert torch.equal(out.sequences, expected_rows(None, "llama", model=model))


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention"])
@pytest.mark.parametrize("case", ["batch", "tree"])
def test_kernels_without_custom_masks_refuse_batches_and_trees_before_any_forward(case, implementation):
    model = build_target("llama")
    model.config._attn_implementation = implementation  # flash attention cannot run on a CPU: the check comes first
    forwards = []
    model.register_forward_pre_hook(lambda *args: forwards.append(1))
    with pytest.raises(ValueError, match=r'attn_implementation="sdpa"'):
        if case == "batch":
            batched_generate(model, hs.PromptLookupDrafter(3), [PROMPTS["random"], PROMPTS["repetitive"]])
        else:
            speculative_generate(model, prompt_ids("random"), hs.PromptLookupDrafter(3, num_candidates=2))
    assert forwards == []


def test_synced_gpus_is_refused(fresh_target):
    """transformers drops synced_gpus= before a custom generate callable: enable's wrapper refuses it."""
    hs.enable(fresh_target)
    with pytest.raises(ValueError, match="synced_gpus=True"):
        fresh_target.generate(prompt_ids("random"), candidate_generator=hs.PromptLookupDrafter(3), synced_gpus=True)


def test_concurrent_calls_share_a_drafter_but_no_state(zoo):
    """One drafter instance in several threads at once: each call has its own n-gram indexes."""
    drafter, model = hs.PromptLookupDrafter(num_draft_tokens=4, max_ngram_size=2), zoo.target("llama")
    expected = {name: plain_generate(model, prompt_ids(name)) for name in NAMES}
    results, errors = {}, []

    def run(name):
        try:
            for _ in range(3):
                results.setdefault(name, []).append(speculative_generate(model, prompt_ids(name), drafter))
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(name,)) for name in NAMES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert all(torch.equal(out, expected[name]) for name in NAMES for out in results[name])


class ExtraTokensDrafter(hs.Drafter):
    """Drafts the reference's next token and asks for two unverified tokens: a continuation (x, y) placed at offsets
    1 and 2 that sees the pending token and each other but not the draft node, as a lookahead window's column does."""

    name = "extra-tokens-test"

    def __init__(self, reference: list[int]):
        super().__init__(1)
        self.reference, self.feedback = reference, []

    def draft_row(self, state, input_ids, max_tokens, row):
        length = input_ids.shape[1]
        token = torch.tensor(self.reference[length : length + 1])
        extra = torch.tensor([7, 9])
        visible = torch.tensor([[True, False, True, False], [True, False, True, True]])  # pending, node, x, y
        return hs.Draft(token, torch.tensor([-1])[: len(token)], extra_token_ids=extra,
                        extra_offsets=torch.tensor([1, 2]), extra_visible=visible[:, : 1 + len(token) + 2])

    def observe(self, state, feedback: StepFeedback):
        self.feedback.append(feedback)


def test_unverified_query_tokens_get_the_logits_of_their_own_sequence(zoo):
    model = zoo.target("llama")
    reference = plain_generate(model, prompt_ids("random"))
    drafter = ExtraTokensDrafter(reference[0].tolist())
    out = speculative_generate(model, prompt_ids("random"), drafter, return_dict_in_generate=True)
    assert torch.equal(out.sequences, reference)  # extra tokens change nothing that is verified or cached
    first = next(f for f in drafter.feedback if f.extra_logits)
    committed = prompt_ids("random")[0].tolist()[: first.positions[0] + 1]  # the cache's tokens, then pending
    virtual = torch.tensor([committed + [7, 9]])
    expected = model(virtual).logits[0, -2:]
    torch.testing.assert_close(first.extra_logits[0], expected, rtol=1e-4, atol=1e-4)


def test_one_row_keeps_no_hole_after_a_tree_step(zoo):
    """The accepted path of a tree is gathered to the front of the step's slots: the cache equals a plain one."""
    model = zoo.target("llama")
    ragged = RaggedCache(DynamicCache(config=model.config), torch.zeros(1, 0, dtype=torch.bool))
    forward(model, ragged, Query.chain(torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.bool)))
    ragged.append(torch.ones(1, 3, dtype=torch.bool))
    draft = hs.Draft.from_lists([11, 12, 13], [-1, -1, 1], "cpu")  # the path 12 -> 13 is accepted
    query = Query.from_drafts(torch.tensor([8]), [draft], PAD)
    forward(model, ragged, query)
    ragged.append(torch.tensor([[True, False, True, True]]))
    assert ragged.valid.all() and ragged.valid.shape[1] == 6
    logits = forward(model, ragged, Query.chain(torch.tensor([[20]]), torch.ones(1, 1, dtype=torch.bool)))
    torch.testing.assert_close(logits[0, -1], model(torch.tensor([[5, 6, 7, 8, 12, 13, 20]])).logits[0, -1],
                               rtol=1e-5, atol=1e-5)
