"""Token trees: structure, mask and positions, tree forwards, KV compaction, tree drafters, greedy exactness."""

import pytest
import torch
from drafters_for_tests import WrongFirstTreeDrafter
from speculative_helpers import assert_cache_matches_sequence, assert_same_tokens, cache_kwargs, plain_generate, prompt_ids
from speculative_helpers import speculative_generate as speculative
from tiny_models import ARCHS, VOCAB_SIZE, build_draft, build_model, build_tokenizer
from transformers import DynamicCache, GenerationConfig

import hf_speculators as hs
from hf_speculators.cache import RaggedCache, rollback
from hf_speculators.query import Query, forward
from hf_speculators.tree import TokenTree, tree_from_paths, trie_from_sequences

#        0   1
#       / \   \
#      2   3   4
#      |
#      5
PARENTS = [-1, -1, 0, 0, 1, 2]
STATIC_PATHS = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0)]


def tree(parents=PARENTS) -> TokenTree:
    return TokenTree(torch.tensor(parents))


# ---------------------------------------------------------------- TokenTree


def test_structure():
    t = tree()
    assert not t.is_chain and t.num_nodes == 6 and t.depth == 3
    assert t.depths.tolist() == [0, 0, 1, 1, 1, 2]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for node, path in enumerate([[0], [1], [0, 2], [0, 3], [1, 4], [0, 2, 5]]):
        expected[node, path] = True
    assert torch.equal(t.ancestors, expected)
    assert [t.children(n) for n in (-1, 0, 1, 2, 5)] == [[0, 1], [2, 3], [4], [5], []]
    assert t.path(5).tolist() == [0, 2, 5] and t.path(-1).tolist() == []
    assert t.leftmost_path().tolist() == [0, 2, 5]


def test_chain_is_a_tree():
    chain = TokenTree.chain(4)
    assert chain.is_chain and chain.depth == 4 and chain.depths.tolist() == [0, 1, 2, 3]
    assert torch.equal(chain.ancestors, torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain.leftmost_path().tolist() == [0, 1, 2, 3]
    assert chain.position_ids(7, 5).tolist() == [[6, 7, 8, 9, 10]]
    empty = TokenTree.chain(0)
    assert empty.is_chain and empty.depth == 0 and empty.longest_path(torch.ones(0, dtype=torch.bool)).tolist() == []


@pytest.mark.parametrize(
    "accepted, path",
    [
        ([1, 1, 1, 0, 1, 1], [0, 2, 5]),  # the deepest path whose every node is accepted
        ([1, 1, 0, 1, 1, 1], [0, 3]),  # node 5 is accepted on its own but its parent is not
        ([0, 1, 1, 1, 1, 1], [1, 4]),
        ([1, 1, 0, 1, 0, 0], [0, 3]),  # a tie at depth 1 between nodes 3 and 4: the first in node order
        ([0, 0, 1, 1, 1, 1], []),
    ],
)
def test_longest_path(accepted, path):
    assert tree().longest_path(torch.tensor(accepted, dtype=torch.bool)).tolist() == path


def test_attention_mask_and_positions():
    t, num_prefix, num_pending = tree(), 4, 2  # 2 tokens cached, 2 pending, then the 6 nodes
    mask = t.attention_mask(num_prefix, num_pending + 6, torch.float32)
    assert mask.shape == (1, 1, 8, 10) and mask.dtype == torch.float32
    assert set(mask.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    allowed = (mask[0, 0] == 0).int()
    assert allowed[:2].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]]  # pending: causal
    assert allowed[2:, :4].all()  # nodes see every committed token
    assert torch.equal(allowed[2:, 4:].bool(), t.ancestors)
    assert t.position_ids(num_prefix, num_pending + 6).tolist() == [[2, 3, 4, 4, 5, 5, 5, 6]]
    # a forward over the last nodes only (the earlier ones already cached), as the tree drafter runs
    assert torch.equal((t.attention_mask(num_prefix, 2, torch.float16)[0, 0] == 0)[:, 4:], t.ancestors[4:])
    assert t.position_ids(num_prefix, 2).tolist() == [[5, 6]]


@pytest.mark.parametrize(
    "parents, message",
    [([-1, 1], "Malformed token tree"), ([-1, -2], "Malformed token tree"), ([0], "Malformed token tree")],
)
def test_malformed_tree(parents, message):
    with pytest.raises(ValueError, match=message):
        tree(parents)
    with pytest.raises(ValueError, match="must be 1D"):
        TokenTree(torch.zeros(2, 2, dtype=torch.long))
    draft = hs.Draft(token_ids=torch.zeros(len(parents), dtype=torch.long), parent_ids=torch.tensor(parents))
    with pytest.raises(ValueError, match=message):
        draft.tree


def test_draft_checks_shapes():
    with pytest.raises(ValueError, match="same length"):
        hs.Draft(token_ids=torch.tensor([1, 2]), parent_ids=torch.tensor([-1]))
    with pytest.raises(ValueError, match="one row per node"):
        hs.Draft.chain(torch.tensor([1, 2]), draft_probs=torch.full((3, 4), 0.25))


def test_tree_from_paths():
    parent_ids, ranks = tree_from_paths([(0, 0, 0), (1,), (0,), (0, 1), (0, 0)])
    # breadth first: (0,), (1,), (0, 0), (0, 1), (0, 0, 0)
    assert parent_ids == [-1, -1, 0, 0, 2] and ranks == [0, 1, 0, 1, 0]


@pytest.mark.parametrize(
    "paths, message",
    [
        ([], "needs a non-empty list of paths"),
        (7, "needs a non-empty list of paths"),
        ([(0,), 1], "non-empty tuple of child ranks"),
        ([()], "non-empty tuple of child ranks"),
        ([(0,), (-1,)], "integers >= 0"),
        ([(0,), (0.5,)], "integers >= 0"),
        ([(0,), (True,)], "integers >= 0"),
        ([(0,), (0,)], "repeated paths"),
        ([(0,), (1, 0)], r"the parent of path \(1, 0\) \(\(1,\)\) is not a path"),
    ],
)
def test_malformed_paths(paths, message):
    with pytest.raises(ValueError, match=message):
        tree_from_paths(paths)
    with pytest.raises(ValueError, match=message):
        hs.TreeDrafter(build_draft("llama"), paths)


def test_trie_from_sequences():
    token_ids, parent_ids = trie_from_sequences([[5, 6, 7], [5, 6, 8], [9], [5, 1]])
    assert token_ids == [5, 6, 7, 8, 9, 1] and parent_ids == [-1, 0, 1, 1, -1, 0]
    assert trie_from_sequences([[3, 4, 5]]) == ([3, 4, 5], [-1, 0, 1])  # one sequence: a chain
    assert trie_from_sequences([]) == ([], [])


@pytest.mark.parametrize(
    "kwargs, message",
    [({"depth": 0}, "depth must be an integer >= 1"), ({"top_k": 1.5}, "top_k must be"),
     ({"num_nodes": True}, "num_nodes must be")],
)
def test_dynamic_tree_checks_its_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        hs.DynamicTree(**kwargs)


# ---------------------------------------------------------------- tree forward and KV compaction


def _tree_forward(model, input_ids, token_ids, parents):
    """Prefills all prompt tokens but the last, then scores the last one and the tree in one forward (the loop's
    query of one row); returns the logits `(1 + num_nodes, vocab)` and the ragged cache."""
    cache = RaggedCache(DynamicCache(config=model.config), torch.zeros(1, 0, dtype=torch.bool))
    prefix = torch.ones(1, input_ids.shape[1] - 1, dtype=torch.bool)
    with torch.no_grad():
        forward(model, cache, Query.chain(input_ids[:, :-1], prefix))
        cache.append(prefix)
        draft = hs.Draft(token_ids, torch.tensor(parents, dtype=torch.long))
        logits = forward(model, cache, Query.from_drafts(input_ids[0, -1:], [draft], 0))[0]
    return logits, cache


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_logits_equal_sequential_logits(zoo, arch):
    target = zoo.target(arch)
    input_ids, token_ids = prompt_ids("random"), torch.tensor([7, 7, 12, 30, 7, 41])  # nodes 0 and 1 share a token
    logits, _ = _tree_forward(target, input_ids, token_ids, PARENTS)
    t = tree()
    with torch.no_grad():
        for row, node in enumerate(range(-1, len(PARENTS))):
            sequence = torch.cat([input_ids, token_ids[t.path(node)][None]], dim=-1)
            expected = target(input_ids=sequence).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_compaction_keeps_the_accepted_path(zoo, arch):
    target, input_ids = zoo.target(arch), prompt_ids("random")
    num_prompt = input_ids.shape[1]
    reference = zoo.reference(arch, "random", max_new_tokens=8)
    greedy = reference[0, num_prompt:]
    # the greedy tokens sit on nodes 1 -> 4 of the tree, after a wrong sibling: their rows must be gathered
    token_ids = torch.tensor([(greedy[0] + 1) % VOCAB_SIZE, greedy[0], 5, 6, greedy[1], 9])
    _, ragged = _tree_forward(target, input_ids, token_ids, PARENTS)
    ragged.append(torch.tensor([[True, False, True, False, False, True, False]]))  # pending token, nodes 1 and 4
    cache = ragged.cache
    assert cache.get_seq_length() == num_prompt + 2 and bool(ragged.valid.all())
    expected = DynamicCache(config=target.config)
    with torch.no_grad():
        target(input_ids=reference[:, : num_prompt + 2], use_cache=True, **cache_kwargs(target, expected))
        for layer, expected_layer in zip(cache.layers, expected.layers):
            torch.testing.assert_close(layer.keys, expected_layer.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values, expected_layer.values, atol=1e-5, rtol=0)
        # continuing greedy decoding from the compacted cache gives plain greedy's tokens
        rollback(cache, 1)  # the last committed token is fed again for the next token's logits
        tokens = reference[:, : num_prompt + 2]
        while tokens.shape[1] < reference.shape[1]:
            position = torch.tensor([[tokens.shape[1] - 1]])
            next_logits = target(input_ids=tokens[:, -1:], position_ids=position, **cache_kwargs(target, cache)).logits
            tokens = torch.cat([tokens, next_logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    assert_same_tokens(tokens, reference)


def test_sliding_window_models_refuse_trees(zoo):
    target = zoo.target("qwen2_sliding")
    with pytest.raises(ValueError, match="Token trees need full-attention cache layers"):
        speculative(target, prompt_ids("random"), hs.TreeDrafter(target, [(0,), (1,)]))
    reference = zoo.reference("qwen2_sliding", "random")
    with pytest.raises(ValueError, match="DynamicSlidingWindowLayer"):
        speculative(target, prompt_ids("random"), WrongFirstTreeDrafter(reference, 3))


# ---------------------------------------------------------------- greedy exactness of tree drafts


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("share_tokens", [False, True])
def test_wrong_first_tree_is_exact(zoo, arch, share_tokens):
    reference = zoo.reference(arch, "random")  # 24 new tokens
    drafter = WrongFirstTreeDrafter(reference, 3, share_tokens=share_tokens)
    out = speculative(zoo.target(arch), prompt_ids("random"), drafter, return_dict_in_generate=True)
    assert_same_tokens(out.sequences, reference)
    assert_cache_matches_sequence(out)
    stats = out.speculative_stats
    assert stats.mean_acceptance_length == 4.0 and stats.num_target_forwards == 1 + 6  # prefill + 24 / 4 steps


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tree_shape", [STATIC_PATHS, hs.DynamicTree(depth=4, top_k=3, num_nodes=10)],
                         ids=["static", "dynamic"])
def test_tree_drafter_is_exact(zoo, arch, tree_shape):
    drafter = hs.TreeDrafter(zoo.noisy_draft(arch), tree_shape)
    out = speculative(zoo.target(arch), prompt_ids("random"), drafter, return_dict_in_generate=True,
                      plain_floor=False)  # the stats below count every step's tree
    assert_same_tokens(out.sequences, zoo.reference(arch, "random"))
    assert_cache_matches_sequence(out)
    stats = out.speculative_stats
    assert stats.mean_acceptance_length > 1.5  # the noisy draft agrees often: the tree path really is exercised
    assert stats.num_drafted_tokens > sum(stats.drafted_per_position)  # more nodes than depths: trees were drafted


@pytest.mark.parametrize("arch", ARCHS)
def test_multi_candidate_prompt_lookup_is_exact(zoo, arch):
    target = zoo.target(arch)
    greedy = zoo.reference(arch, "random", max_new_tokens=16)[:, prompt_ids("random").shape[1] :]
    # the prompt holds the greedy continuation and variants of it: several matches with different continuations
    variant = greedy.clone()
    variant[0, 3::4] = (variant[0, 3::4] + 1) % VOCAB_SIZE
    input_ids = torch.cat([greedy[:, :8], variant, prompt_ids("random"), greedy[:, :10], prompt_ids("random")], -1)
    reference = plain_generate(target, input_ids)
    drafter = hs.PromptLookupDrafter(num_draft_tokens=4, max_ngram_size=2, num_candidates=3)
    out = speculative(target, input_ids, drafter, return_dict_in_generate=True, plain_floor=False)
    assert_same_tokens(out.sequences, reference)
    chain = speculative(target, input_ids, hs.PromptLookupDrafter(num_draft_tokens=4, max_ngram_size=2),
                        return_dict_in_generate=True, plain_floor=False)  # both draft every step
    assert_same_tokens(chain.sequences, reference)
    assert out.speculative_stats.num_drafted_tokens > chain.speculative_stats.num_drafted_tokens


def test_tree_with_logits_processors_and_scores(zoo):
    target, input_ids = zoo.target("llama"), prompt_ids("random")
    processors = dict(repetition_penalty=1.5, no_repeat_ngram_size=2, output_scores=True, output_logits=True,
                      return_dict_in_generate=True)
    reference = plain_generate(target, input_ids, **processors)
    out = speculative(target, input_ids, hs.TreeDrafter(zoo.noisy_draft("llama"), STATIC_PATHS), **processors)
    assert_same_tokens(out.sequences, reference.sequences)
    torch.testing.assert_close(torch.cat(out.scores), torch.cat(reference.scores), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(out.logits), torch.cat(reference.logits), atol=1e-4, rtol=0)


def test_length_budget_limits_the_depth(zoo):
    drafter = hs.TreeDrafter(zoo.noisy_draft("llama"), hs.DynamicTree(depth=5))
    out = speculative(zoo.target("llama"), prompt_ids("random"), drafter, max_new_tokens=3,
                      return_dict_in_generate=True)
    assert_same_tokens(out.sequences, zoo.reference("llama", "random", max_new_tokens=3))
    assert len(out.speculative_stats.drafted_per_position) <= 2  # 3 tokens: 2 draft positions + 1 next token


# ---------------------------------------------------------------- drafters


def propose_alone(drafter, input_ids, max_tokens, target=None, generation_config=None):
    """`drafter`'s draft for the one sequence `input_ids` `(1, length)` in a call of its own."""
    state = drafter.new_state(target, generation_config or GenerationConfig())
    return drafter.propose(state, [input_ids], [max_tokens], [0])[0]


def test_multi_candidate_prompt_lookup_trie():
    a, b, c, d = 10, 11, 12, 13
    input_ids = torch.tensor([[a, b, c, a, b, d, a, b]])
    drafter = hs.PromptLookupDrafter(num_draft_tokens=3, max_ngram_size=2, num_candidates=2)
    draft = propose_alone(drafter, input_ids, 3)
    # "a b" was followed by d (latest) and by c: both continuations, latest first
    assert draft.token_ids.tolist() == [d, a, b, c, a, b] and draft.parent_ids.tolist() == [-1, 0, 1, -1, 3, 4]
    chain = propose_alone(hs.PromptLookupDrafter(num_draft_tokens=3, max_ngram_size=2), input_ids, 3)
    assert chain.token_ids.tolist() == [d, a, b] and chain.is_chain
    # candidates beyond the longest n-gram's come from shorter n-grams ("b" alone), none twice
    input_ids = torch.tensor([[a + 5, b, c, a, b, d, a, b]])  # "a b" was followed by d only; "b" by d and c
    three = propose_alone(hs.PromptLookupDrafter(num_draft_tokens=2, max_ngram_size=2, num_candidates=3), input_ids, 2)
    assert three.token_ids.tolist() == [d, a, c, a] and three.parent_ids.tolist() == [-1, 0, -1, 2]
    with pytest.raises(ValueError, match="num_candidates must be an integer >= 1"):
        hs.PromptLookupDrafter(num_candidates=0)


def test_tree_drafter_as_candidate_generator(zoo):
    draft = zoo.noisy_draft("llama")
    drafter = hs.TreeDrafter(draft, STATIC_PATHS)
    candidate_ids, candidate_logits = drafter.get_candidates(prompt_ids("random"))
    chain = hs.DraftModelDrafter(draft, num_draft_tokens=4).get_candidates(prompt_ids("random"))[0]
    assert torch.equal(candidate_ids, chain) and candidate_logits is None  # the leftmost path: the greedy chain
    assert drafter.num_draft_tokens == 4 and "StaticTree" in repr(drafter)


def test_a_tree_config_builds_a_tree_drafter(tmp_path):
    target, draft = build_model("llama", seed=1), build_draft("llama")
    draft.save_pretrained(tmp_path / "draft")
    build_tokenizer().save_pretrained(tmp_path / "draft")
    static = hs.SpeculativeConfig(method="tree", draft_model=str(tmp_path / "draft"), verification="top_k", top_k=2,
                                  tree={"paths": [[0], [1], [0, 0]]})
    drafter, verifier = static.build(target)
    assert isinstance(drafter.tree, hs.StaticTree) and drafter.num_draft_tokens == 2
    assert isinstance(verifier, hs.TopKVerifier) and verifier.top_k == 2
    dynamic = static.override(tree={"depth": 3, "top_k": 2}, verification=None)
    drafter, verifier = dynamic.build(target)
    assert repr(drafter.tree) == "DynamicTree(depth=3, top_k=2, num_nodes=24)" and verifier is None
    default, _ = hs.SpeculativeConfig(method="tree", draft_model=str(tmp_path / "draft")).build(target)
    assert repr(default.tree) == repr(hs.DynamicTree())
    with pytest.raises(ValueError, match=r"A tree mapping holds 'paths' .* got keys \['width'\]"):
        static.override(tree={"width": 3}).build(target)
    with pytest.raises(ValueError, match="num_draft_tokens does not apply to method='tree'"):
        static.override(num_draft_tokens=4)
