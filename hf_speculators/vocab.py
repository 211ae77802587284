"""A reduced draft vocabulary: the LM head restricted to frequent tokens, so that drafting pays for fewer rows.

FR-Spec (Zhao et al. 2025, "FR-Spec: Accelerating Large-Vocabulary Language Models via Frequency-Ranked
Speculative Sampling") drafts from the most frequent tokens only; EAGLE-3 drafts over a reduced vocabulary too.
Verification still scores the full vocabulary, so greedy output stays the target's and rejection sampling stays
lossless: a token outside the draft vocabulary is never drafted, and the target may still produce it.
"""

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from huggingface_hub import HfFileSystem

from .loading import resolve_model_id


def rank_tokens(tokenizer, texts: Iterable[str]) -> list[int]:
    """Every token id that occurs in `texts`, the most frequent first (ties: the lower id first).

    Raises:
        `ValueError`: for texts holding no token.
    """
    counts = Counter()
    for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        counts.update(ids)
    if not counts:
        raise ValueError("The texts hold no token: give a corpus to count token frequencies on.")
    return sorted(counts, key=lambda token: (-counts[token], token))


def frequent_tokens(tokenizer, texts: Iterable[str], num_tokens: int) -> torch.LongTensor:
    """The `num_tokens` token ids most frequent in `texts`, and the tokenizer's special tokens (FR-Spec).

    Args:
        tokenizer (`PreTrainedTokenizerBase`): the target's tokenizer.
        texts (`Iterable[str]`): a corpus like the text to be generated (FR-Spec counts a general pretraining
            corpus).
        num_tokens (`int`): how many of the most frequent ids to keep, >= 1 (ties: the lower id first).

    Returns:
        `torch.LongTensor` of shape `(n,)`: the ids, ascending; n is at most `num_tokens` plus the special tokens.

    Raises:
        `ValueError`: for `num_tokens < 1`, or texts holding no token.
    """
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an integer >= 1, got {num_tokens!r}.")
    ranked = rank_tokens(tokenizer, texts)[:num_tokens]
    return torch.tensor(sorted(set(ranked) | set(tokenizer.all_special_ids)), dtype=torch.long)


def load_token_ranking(location: str) -> list[int]:
    """A token ranking saved as JSON: a list of token ids, the most frequent first, or `{"token_ids": [...]}`.

    Args:
        location (`str`): a local path; a file of a bundled demo model (`"hf_speculators/demo-target/NAME"`); or a
            Hub file as `"hf://ORG/REPO/NAME"` (read with `huggingface_hub.HfFileSystem`; needs a network).

    Raises:
        `FileNotFoundError`: a local path that is not a file.
        `ValueError`: a file that is not such JSON, naming it.
    """
    if location.startswith("hf://"):
        with HfFileSystem().open(location, "r", encoding="utf-8") as file:
            text = file.read()
    else:
        path = Path(resolve_model_id(location)).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"Token ranking {location!r} is not a file: pass a JSON list of token ids (e.g. "
                                    "hf_speculators/demo-target/token_ranking.json) or hf://ORG/REPO/FILE.")
        text = path.read_bytes().decode("utf-8", errors="replace")
    try:
        ranking = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{location}: malformed JSON: {error}") from None
    ranking = ranking.get("token_ids") if isinstance(ranking, dict) else ranking
    if not isinstance(ranking, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ranking):
        raise ValueError(f"{location}: a token ranking is a JSON list of token ids or {{\"token_ids\": [...]}}.")
    return ranking


def ranked_draft_vocab(location: str, num_tokens: int | None = None) -> torch.LongTensor:
    """The first `num_tokens` ids (all if `None`) of the token ranking at `location` (see `load_token_ranking`),
    as a draft vocabulary for `LayerSkipDrafter(draft_vocab=...)`.

    Raises:
        `ValueError`: for a malformed ranking (see `load_token_ranking` and `check_draft_vocab`).
    """
    ranking = load_token_ranking(location)
    return check_draft_vocab(ranking if num_tokens is None else ranking[:num_tokens])


def check_draft_vocab(draft_vocab) -> torch.LongTensor:
    """`draft_vocab` as a 1D tensor of distinct non-negative token ids, ascending.

    Raises:
        `ValueError`: for an empty, non-integer, multi-dimensional or negative selection, or repeated ids.
    """
    ids = torch.as_tensor(draft_vocab)
    integer = not (ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool)
    if ids.dim() != 1 or len(ids) == 0 or not integer:
        raise ValueError(
            f"draft_vocab must be a non-empty 1D sequence of token ids (e.g. from hf_speculators.vocab."
            f"frequent_tokens), got a {ids.dtype} tensor of shape {tuple(ids.shape)}."
        )
    ids = ids.long().sort().values
    if ids[0] < 0 or (ids[1:] == ids[:-1]).any():
        raise ValueError("draft_vocab must hold distinct non-negative token ids.")
    return ids


def widen_logits(logits: torch.FloatTensor, token_ids: torch.LongTensor, vocab_size: int) -> torch.FloatTensor:
    """Draft-vocabulary logits `(..., n)` laid out in the full vocabulary `(..., vocab_size)`: column i goes to token
    `token_ids[i]`, every other token gets the lowest logit (probability 0 after a softmax)."""
    full = logits.new_full((*logits.shape[:-1], vocab_size), torch.finfo(logits.dtype).min)
    full[..., token_ids] = logits
    return full


class DraftVocabHead:
    """An LM head that scores only the token ids of a draft vocabulary and gives the others the lowest logit.

    Holds a copy of the head's rows for those ids (`len(token_ids) x hidden_size` weights), so a draft token costs
    that many rows instead of the full vocabulary. The logits keep the full width, so logits processors and
    samplers see the usual shape, and a token outside the draft vocabulary gets probability 0.

    Args:
        head (`torch.nn.Linear`): the model's LM head (`get_output_embeddings()`), unquantized.
        token_ids (`torch.LongTensor` of shape `(n,)`): the draft vocabulary (see `check_draft_vocab`).

    Raises:
        `ValueError`: for a head that is not a plain `torch.nn.Linear` (e.g. a quantized one), or a token id at or
            over the head's number of rows.
    """

    def __init__(self, head, token_ids: torch.LongTensor):
        weight = getattr(head, "weight", None)
        if not isinstance(head, torch.nn.Linear) or type(weight.data) is not torch.Tensor:
            raise ValueError(
                f"A draft vocabulary slices the LM head's rows, and this head ({type(head).__name__} with "
                f"{type(weight).__name__} weights) is not a plain torch.nn.Linear; leave draft_vocab unset for a "
                "quantized target."
            )
        if token_ids[-1] >= head.out_features:
            raise ValueError(
                f"draft_vocab holds token id {int(token_ids[-1])}, but the LM head scores {head.out_features} tokens."
            )
        self.token_ids = token_ids.to(weight.device)
        self.vocab_size = head.out_features
        self.weight = weight.detach()[self.token_ids].contiguous()
        self.bias = None if head.bias is None else head.bias.detach()[self.token_ids]

    def __call__(self, hidden_states: torch.FloatTensor) -> torch.FloatTensor:
        """Logits `(..., vocab_size)` of normed hidden states `(..., hidden_size)`, lowest outside the vocabulary."""
        return widen_logits(torch.nn.functional.linear(hidden_states, self.weight, self.bias), self.token_ids,
                            self.vocab_size)
