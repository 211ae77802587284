"""`outputs.commit_tokens`: the cut where plain `generate` stops, found at once for the criteria `generate` builds
from `max_length` and `eos_token_id`, and token by token for any other criterion."""

import pytest
import torch
from transformers import EosTokenCriteria, MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList

from hf_speculators.outputs import _known_stop, commit_tokens


class Never(StoppingCriteria):
    """A criterion of the user's: forces the token-by-token path, changes no cut."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def random_case(generator: torch.Generator, index: int):
    length, num_new = (int(torch.randint(1, high, (1,), generator=generator)) for high in (12, 6))
    input_ids = torch.randint(0, 8, (1, length), generator=generator)
    new_tokens = torch.randint(0, 8, (num_new,), generator=generator)
    criteria = []
    if index % 3:
        max_length = int(torch.randint(1, 18, (1,), generator=generator))
        criteria.append(MaxLengthCriteria(max_length, max_position_embeddings=None if index % 5 else 14))
    if index % 2:
        criteria.append(EosTokenCriteria([int(torch.randint(0, 8, (1,), generator=generator)), 7]))
    return input_ids, new_tokens, criteria


def test_the_cut_at_once_is_the_cut_token_by_token():
    generator, stopped = torch.Generator().manual_seed(0), 0
    for index in range(2000):
        input_ids, new_tokens, criteria = random_case(generator, index)
        scores = torch.zeros(len(new_tokens), 8)
        at_once = commit_tokens(input_ids, new_tokens, scores, StoppingCriteriaList(criteria))
        by_token = commit_tokens(input_ids, new_tokens, scores, StoppingCriteriaList([*criteria, Never()]))
        assert torch.equal(at_once[0], by_token[0]) and at_once[1:] == by_token[1:], (input_ids, new_tokens, criteria)
        stopped += at_once[2]
    assert 500 < stopped < 1500  # both outcomes are exercised


@pytest.mark.parametrize("criteria, expected", [
    ([MaxLengthCriteria(10), EosTokenCriteria(3)], (2, True)),  # EOS is the second new token
    ([MaxLengthCriteria(7), EosTokenCriteria(3)], (1, True)),  # the max length comes first
    ([MaxLengthCriteria(20)], (4, False)),
    ([], (4, False)),
])
def test_the_known_criteria_are_read_without_calling_them(criteria, expected):
    assert _known_stop(6, torch.tensor([5, 3, 3, 1]), StoppingCriteriaList(criteria)) == expected


def test_other_criteria_and_lengths_past_the_positions_go_token_by_token():
    new_tokens = torch.tensor([5, 3])
    assert _known_stop(6, new_tokens, StoppingCriteriaList([MaxLengthCriteria(20), Never()])) is None
    past = MaxLengthCriteria(20, max_position_embeddings=7)  # it warns once the length passes 7: let it
    assert _known_stop(6, new_tokens, StoppingCriteriaList([past])) is None
