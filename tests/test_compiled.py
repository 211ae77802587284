"""Compiled decoding steps (static cache + `compile_config`): no recompilation after warm-up, exact under inductor.

The recompilation test compiles with dynamo's `"eager"` backend (graphs are captured and guarded as with inductor,
without code generation), so it costs seconds; one test runs inductor for exactness (about a minute on one core).
"""

import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache, StaticCache

import hf_speculators as hs
from hf_speculators.compiled import (compiled_steps, compiles, run_draft_model, run_draft_model_chain,
                                    run_draft_model_step)
from hf_speculators.drafters.base import TargetNeeds
from hf_speculators.drafters.draft_model import DraftModelDrafter
from batch_helpers import MAX_NEW_TOKENS, PAD, left_padded
from test_batch import BATCH_PROMPTS, batched, expected_batch
from speculative_helpers import PROMPTS, plain_generate
from tiny_models import build_noisy_copy, build_target


def compile_config(backend: str) -> CompileConfig:
    """transformers' CompileConfig, told to compile on the CPU too (as the bench does for every method)."""
    config = CompileConfig(backend=backend, mode=None if backend == "eager" else "default")
    config._compile_all_devices = True
    return config


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def frame_graphs(*functions) -> list[int]:
    """Per function, the graphs dynamo keeps for its code object: its limit (`recompile_limit`) counts per frame."""
    return [len(_debug_get_cache_entry_list(function.__code__)) for function in functions]


def fresh_dynamo() -> None:
    """Forgets every compiled graph and dynamo's counters (`reset` keeps them: earlier tests' graphs would count)."""
    torch._dynamo.reset()
    counters.clear()


def test_compiles_as_transformers_decides(zoo):
    model = zoo.target("llama")
    static = StaticCache(config=model.config, max_cache_len=8)
    config = model.generation_config
    assert not compiles(model, static, config)  # a CPU without _compile_all_devices
    config = type(config)(compile_config=compile_config("eager"))
    assert compiles(model, static, config) and not compiles(model, DynamicCache(), config)
    assert compiled_steps(model, static, config, hs.PromptLookupDrafter(3)).widths == (4,)
    hybrid = hs.HybridDrafter(hs.SuffixDrafter(num_draft_tokens=8), hs.DraftModelDrafter(model, num_draft_tokens=3))
    assert compiled_steps(model, static, config, hybrid).widths == (4, 9)

    class FeatureReader(hs.PromptLookupDrafter):  # reads hidden states, as EAGLE and Medusa heads do
        def target_needs(self, target):
            return TargetNeeds(layer_ids=(0,))

    assert compiled_steps(model, static, config, FeatureReader(3)).widths == (4,)  # through output_hidden_states
    config.disable_compile = True
    assert not compiles(model, static, config)


def test_no_recompilation_after_warm_up():
    """Calls with new prompt lengths, draft lengths that change every step (the goodput schedule, budgets cut by
    max_length) and rejections: the first call compiles the graphs of its steps, the target's and the draft model's,
    later calls compile nothing."""
    fresh_dynamo()
    model = hs.enable(build_target("llama"))
    drafter = hs.DraftModelDrafter(build_noisy_copy("llama"), num_draft_tokens=4)
    settings = dict(do_sample=False, cache_implementation="static", compile_config=compile_config("eager"))
    prompts = [PROMPTS["random"], PROMPTS["one_token"], tuple(range(3, 40)), PROMPTS["repetitive"]]
    graphs, lengths = [], set()
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        out = model.generate(ids, candidate_generator=drafter, max_new_tokens=MAX_NEW_TOKENS + i,
                             num_draft_tokens_schedule="goodput" if i % 2 else "constant",
                             return_dict_in_generate=True, **settings)
        assert out.sequences.tolist() == plain_generate(model, ids, max_new_tokens=MAX_NEW_TOKENS + i).tolist()
        lengths.update(k for k, steps in enumerate(out.speculative_stats.draft_lengths) if steps)
        graphs.append(unique_graphs())
    assert len(lengths) > 2  # drafts of several lengths ran
    # compiled in the first call (constant k): the target's verify forward of k + 1 slots, the draft model's whole
    # greedy chain and its one-token forwards (budgets cut by max_length); in the second (goodput: shorter drafts)
    # its catch-up of k + 1 slots alone; eager drafting would count 1, a new width or batch size one more
    assert graphs == [3] + [4] * (len(prompts) - 1)
    assert frame_graphs(run_draft_model, run_draft_model_step, run_draft_model_chain) == [1, 1, 1]  # a frame each


def test_hybrid_catch_up_is_exact(monkeypatch):
    """After steps the suffix drafter drafted, the compiled draft model catches up with more than k + 1 tokens (the
    excess eagerly, then its fixed-width compiled forward): plain greedy output, no graph after the first call. The
    hybrid prices a draft width at the compiled width that holds it."""
    from hf_speculators.drafters.hybrid import HybridState

    fresh_dynamo()
    fed, step_slots = [], set()
    catch_up = DraftModelDrafter._catch_up_query
    monkeypatch.setattr(DraftModelDrafter, "_catch_up_query",
                        lambda self, state, new_ids, device: fed.append(max(map(len, new_ids)))
                        or catch_up(self, state, new_ids, device))
    observe_step = HybridState.observe_step
    monkeypatch.setattr(HybridState, "observe_step",
                        lambda self, *args: step_slots.add(self.step_slots) or observe_step(self, *args))
    model = hs.enable(build_target("llama"))
    drafter = hs.HybridDrafter(hs.SuffixDrafter(num_draft_tokens=8),
                               hs.DraftModelDrafter(build_noisy_copy("llama"), num_draft_tokens=2))
    graphs = []
    for name in ("repetitive", "random"):
        ids = torch.tensor([PROMPTS[name] * 3])
        out = model.generate(ids, candidate_generator=drafter, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                             plain_floor=False, cache_implementation="static", compile_config=compile_config("eager"))
        assert out.tolist() == plain_generate(model, ids).tolist()
        graphs.append(unique_graphs())
    assert max(fed) > 3  # a catch-up longer than the compiled width ran
    assert graphs[1] == graphs[0]
    assert step_slots == {3, 9}  # the compiled widths of 2 and 8 draft tokens (a step of 1 draft token: 3 slots)


def test_greedy_chain_drafts_what_one_forward_per_token_drafts(zoo, monkeypatch):
    """The draft model's compiled greedy chain (catch-up and chain forwards in one graph) proposes the tokens its
    forwards one at a time propose: the same acceptance at every draft position, for one row and a ragged batch
    (verification would hide a wrong draft in the output, not in the acceptance)."""
    fresh_dynamo()
    model = zoo.target("llama")
    drafter = hs.DraftModelDrafter(build_noisy_copy("llama"), num_draft_tokens=3)
    settings = dict(cache_implementation="static", compile_config=compile_config("eager"), plain_floor=False,
                    num_draft_tokens_schedule="constant")
    ids = torch.tensor([PROMPTS["random"]])

    def calls():  # a ragged batch (returns its statistics), one row
        return [batched(model, drafter, **settings),
                model.generate(ids, custom_generate=hs.generate, candidate_generator=drafter,
                               return_dict_in_generate=True, **settings)]

    chained = calls()
    assert frame_graphs(run_draft_model_chain) == [2]
    monkeypatch.setattr(DraftModelDrafter, "_chains", lambda *args: False)
    one_by_one = calls()
    for chain, single in zip(chained, one_by_one):
        assert torch.equal(chain.sequences, single.sequences)
        assert chain.speculative_stats.accepted_per_position == single.speculative_stats.accepted_per_position
        assert chain.speculative_stats.num_accepted_tokens > 0


def test_finished_rows_keep_the_batch_size(zoo):
    """A batch whose rows finish at different steps runs the graphs of a batch whose rows all run to the end: rows
    that finish keep their place in every compiled forward (the target's and the draft model's), so no new batch
    size compiles; each row is its own plain greedy output."""
    fresh_dynamo()
    model = zoo.target("llama")
    drafter = hs.DraftModelDrafter(build_noisy_copy("llama"), num_draft_tokens=3)
    settings = dict(cache_implementation="static", compile_config=compile_config("eager"), plain_floor=False)
    out = batched(model, drafter, **settings)
    assert torch.equal(out.sequences, expected_batch(zoo, "llama", BATCH_PROMPTS, max_new_tokens=MAX_NEW_TOKENS))
    graphs = unique_graphs()
    eos = int(zoo.reference("llama", "random", max_new_tokens=MAX_NEW_TOKENS)[0, len(PROMPTS["random"]) + 2])
    out = batched(model, drafter, eos_token_id=eos, **settings)
    expected = expected_batch(zoo, "llama", BATCH_PROMPTS, max_new_tokens=MAX_NEW_TOKENS, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    assert len({row.num_generated_tokens for row in out.speculative_stats.row_stats}) > 1  # a row left early
    assert unique_graphs() == graphs
    assert frame_graphs(run_draft_model_chain) == [1]  # the batch drafted as one compiled greedy chain


def test_exact_under_inductor():
    """One row and a ragged batch, with rejections, compiled by inductor (the draft model's greedy chain as one
    graph among them): token for token plain greedy output."""
    fresh_dynamo()
    model = build_target("llama")
    drafter = hs.DraftModelDrafter(build_noisy_copy("llama"), num_draft_tokens=3)
    settings = dict(do_sample=False, max_new_tokens=MAX_NEW_TOKENS, cache_implementation="static",
                    compile_config=compile_config("inductor"), pad_token_id=PAD, num_draft_tokens_schedule="constant")
    names = ("random", "repetitive")
    ids, mask = left_padded([PROMPTS[name] for name in names])
    out = model.generate(ids, attention_mask=mask, custom_generate=hs.generate, candidate_generator=drafter,
                         **settings)
    assert torch.equal(out, plain_generate(model, ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS,
                                           pad_token_id=PAD))
    ids = ids[1:]
    out = model.generate(ids, custom_generate=hs.generate, candidate_generator=drafter, **settings)
    assert out.tolist() == plain_generate(model, ids, max_new_tokens=MAX_NEW_TOKENS).tolist()
    assert unique_graphs() >= 1
    assert frame_graphs(run_draft_model_chain) == [2]  # the batch's and the row's
