"""Property-based tests (Hypothesis): a token tree's mask and positions against its parent list, and each verifier's
acceptance against its definition on random distributions."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_speculators as hs
from hf_speculators.draft import Draft

VOCAB = 6
FEW = settings(max_examples=40, deadline=None, database=None, derandomize=True, print_blob=False)


@st.composite
def parent_lists(draw, max_nodes: int = 9) -> list[int]:
    """A valid parent list: node i's parent is -1 or an earlier node."""
    num_nodes = draw(st.integers(0, max_nodes))
    return [draw(st.integers(-1, node - 1)) for node in range(num_nodes)]


def path_to_root(parents: list[int], node: int) -> set[int]:
    """Node `node` and its ancestors, by walking the parent list."""
    nodes = set()
    while node >= 0:
        nodes.add(node)
        node = parents[node]
    return nodes


@FEW
@given(parents=parent_lists(), num_prefix=st.integers(1, 4), data=st.data())
def test_tree_positions_and_mask_follow_the_parent_list(parents, num_prefix, data):
    tree = hs.TokenTree(torch.tensor(parents, dtype=torch.long))
    num_nodes = len(parents)
    num_query = data.draw(st.integers(1, num_prefix + num_nodes))
    depths = [len(path_to_root(parents, node)) - 1 for node in range(num_nodes)]
    full_positions = list(range(num_prefix)) + [num_prefix + depth for depth in depths]
    assert tree.position_ids(num_prefix, num_query)[0].tolist() == full_positions[-num_query:]

    mask = tree.attention_mask(num_prefix, num_query, torch.float32)
    assert mask.shape == (1, 1, num_query, num_prefix + num_nodes)
    assert set(mask.unique().tolist()) <= {0.0, torch.finfo(torch.float32).min}
    allowed = (mask[0, 0] == 0).tolist()
    for row, query in enumerate(range(num_prefix + num_nodes - num_query, num_prefix + num_nodes)):
        if query < num_prefix:  # a prefix token: causal
            expected = [key <= query for key in range(num_prefix + num_nodes)]
        else:  # a node: every prefix token, its ancestors and itself
            ancestors = path_to_root(parents, query - num_prefix)
            expected = [True] * num_prefix + [node in ancestors for node in range(num_nodes)]
        assert allowed[row] == expected


@st.composite
def drafts_and_scores(draw, chain: bool | None = None):
    """A draft (chain or tree) over a small vocabulary and random target scores `(num_nodes + 1, VOCAB)`, with a
    few exact ties so that argmax and rank questions are exercised."""
    parents = draw(parent_lists(max_nodes=6).filter(bool))
    if chain or (chain is None and draw(st.booleans())):
        parents = list(range(-1, len(parents) - 1))
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(parents), max_size=len(parents)))
    values = st.sampled_from([-3.0, -1.0, 0.0, 0.5, 2.0]) | st.floats(-5, 5, allow_nan=False)
    scores = draw(st.lists(st.lists(values, min_size=VOCAB, max_size=VOCAB), min_size=len(parents) + 1,
                           max_size=len(parents) + 1))
    draft = Draft(torch.tensor(tokens), torch.tensor(parents, dtype=torch.long))
    return draft, torch.tensor(scores)


def accepted_path_is_valid(draft: Draft, verdict, acceptable: list[bool]) -> None:
    """The accepted nodes form a root-to-node path of acceptable nodes, and no acceptable child extends it."""
    path = verdict.accepted_nodes.tolist()
    parents = draft.parent_ids.tolist()
    assert [parents[node] for node in path] == ([-1] + path[:-1] if path else [])
    assert all(acceptable[node] for node in path)
    depth = {node: len(path_to_root(parents, node)) for node in range(len(parents))}
    # the kept path is the deepest one whose every node is acceptable
    reachable = [n for n in range(len(parents)) if all(acceptable[a] for a in path_to_root(parents, n))]
    assert len(path) == max((depth[n] for n in reachable), default=0)


@FEW
@given(drafts_and_scores())
def test_exact_verification_keeps_the_deepest_path_of_argmax_tokens(case):
    draft, scores = case
    verdict = hs.ExactVerifier()(draft, scores, do_sample=False, generator=None)
    parents = draft.parent_ids.tolist()
    # node i is acceptable when its token is the target's argmax after its parent (row parent + 1)
    acceptable = [int(draft.token_ids[i]) == int(scores[parents[i] + 1].argmax()) for i in range(len(parents))]
    accepted_path_is_valid(draft, verdict, acceptable)
    last = int(verdict.accepted_nodes[-1]) + 1 if len(verdict.accepted_nodes) else 0
    assert int(verdict.next_token) == int(scores[last].argmax())


@FEW
@given(drafts_and_scores(), st.floats(0.01, 1.0), st.floats(0.05, 2.0))
def test_typical_acceptance_is_its_definition(case, epsilon, delta):
    draft, scores = case
    parents = draft.parent_ids.tolist()
    acceptable = []
    for node, parent in enumerate(parents):
        probs = torch.softmax(scores[parent + 1].double(), -1).tolist()
        entropy = -sum(p * math.log(p) for p in probs if p > 0)
        threshold = min(epsilon, delta * math.exp(-entropy))
        acceptable.append(probs[int(draft.token_ids[node])] > threshold)
    verifier = hs.TypicalVerifier(epsilon, delta)
    close = [abs(torch.softmax(scores[p + 1].double(), -1)[int(t)].item()
                 - min(epsilon, delta * math.exp(-sum(-q * math.log(q) for q in
                                                      torch.softmax(scores[p + 1].double(), -1).tolist() if q > 0))))
             < 1e-6 for p, t in zip(parents, draft.token_ids)]
    if any(close):  # float32 rounding may decide a token sitting on the threshold either way
        return
    accepted_path_is_valid(draft, verifier(draft, scores, do_sample=False, generator=None), acceptable)


@FEW
@given(drafts_and_scores(), st.integers(1, VOCAB), st.floats(0.0, 3.0))
def test_top_k_acceptance_is_its_definition(case, top_k, tolerance):
    draft, scores = case
    parents = draft.parent_ids.tolist()
    acceptable = []
    for node, parent in enumerate(parents):
        log_probs = torch.log_softmax(scores[parent + 1], -1).tolist()
        token = log_probs[int(draft.token_ids[node])]
        better = sum(value > token for value in log_probs)  # tokens strictly more likely
        acceptable.append(better < top_k and max(log_probs) - token <= tolerance + 1e-6)
        if abs(max(log_probs) - token - tolerance) < 1e-5:
            return  # on the tolerance's edge: float rounding may decide either way
    verifier = hs.TopKVerifier(top_k, tolerance)
    accepted_path_is_valid(draft, verifier(draft, scores, do_sample=False, generator=None), acceptable)


@st.composite
def distributions(draw, size: int = VOCAB) -> torch.Tensor:
    """A probability vector with some zeros."""
    weights = draw(st.lists(st.sampled_from([0.0, 0.0, 0.1, 0.5, 1.0, 3.0]) | st.floats(0.0, 5.0),
                            min_size=size, max_size=size).filter(lambda w: sum(w) > 0.01))
    probs = torch.tensor(weights, dtype=torch.float64)
    return (probs / probs.sum()).float()


@FEW
@given(target=distributions(), bonus=distributions(), draft=distributions(), seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_rejection_sampling_accepts_with_probability_min_1_p_over_q(target, bonus, draft, seed, data):
    """One draft token x ~ q: accepted exactly when u * q(x) < p(x) for the verifier's first uniform u (so with
    probability min(1, p(x) / q(x))); a rejection draws from norm(max(0, p - q)), an acceptance the bonus from the
    next row."""
    token = data.draw(st.sampled_from([i for i in range(VOCAB) if draft[i] > 0]))
    node = Draft(torch.tensor([token]), torch.tensor([-1]), draft[None])
    scores = torch.stack([target, bonus]).log()  # softmax(log p) = p
    verdict = hs.RejectionVerifier()(node, scores, do_sample=True, generator=torch.Generator().manual_seed(seed))
    uniform = float(torch.rand(1, generator=torch.Generator().manual_seed(seed)))
    p, q = float(torch.softmax(scores[0], -1)[token]), float(draft[token])
    if abs(uniform * q - p) < 1e-6:
        return  # on the boundary
    accepted = uniform * q < p
    assert verdict.accepted_nodes.tolist() == ([0] if accepted else [])
    next_token = int(verdict.next_token)
    if accepted:
        assert bonus[next_token] > 0
    else:
        assert float(torch.softmax(scores[0], -1)[next_token]) > float(draft[next_token])


@FEW
@given(target=distributions(), length=st.integers(1, 4), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_rejection_sampling_keeps_a_draft_drawn_from_the_target_itself(target, length, seed, data):
    """q = p at every position: min(1, p / q) = 1, so every node of the chain is accepted."""
    tokens = [data.draw(st.sampled_from([i for i in range(VOCAB) if target[i] > 0])) for _ in range(length)]
    chain = Draft(torch.tensor(tokens), torch.arange(-1, length - 1), target.expand(length, VOCAB).clone())
    scores = target.log().expand(length + 1, VOCAB).clone()
    verdict = hs.RejectionVerifier()(chain, scores, do_sample=True, generator=torch.Generator().manual_seed(seed))
    assert verdict.accepted_nodes.tolist() == list(range(length))


@pytest.mark.parametrize("verifier", [hs.ExactVerifier(), hs.RejectionVerifier()])
@FEW
@given(case=drafts_and_scores(chain=True))
def test_lossless_verifiers_agree_under_greedy_decoding(verifier, case):
    draft, scores = case
    verdict = verifier(draft, scores, do_sample=False, generator=torch.Generator().manual_seed(0))
    reference = hs.ExactVerifier()(draft, scores, do_sample=False, generator=None)
    assert verdict.accepted_nodes.tolist() == reference.accepted_nodes.tolist()
    assert int(verdict.next_token) == int(reference.next_token)
