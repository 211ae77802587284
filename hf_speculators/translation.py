"""Drafting with a model of another tokenizer (heterogeneous vocabularies; Timor et al. 2025, "Accelerating LLM
Inference with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies", ICML).

Two translations between the target's tokens and the draft model's:

- String-level exact matching (SLEM, greedy decoding): draft tokens are decoded to text and the text is encoded
  with the target's tokenizer after a look-behind window of committed target tokens; the draft proposes only target
  tokens that decode to exactly the draft's text after the committed tokens. Verification is exact matching, so
  the output is the target's own greedy output whatever the translation does.
- Token-level intersection (TLI, sampling): the draft samples only tokens whose text exists in both vocabularies,
  from its distribution renormalised over that set and laid out in the target's vocabulary (`VocabularyMap`), so
  standard rejection sampling is lossless.

Committed target tokens reach the draft model as text re-encoded with its tokenizer (`TokenizerBridge.to_draft`),
a deterministic function of the committed tokens, as losslessness requires.
"""

from functools import cached_property

import torch

from .vocab import widen_logits

# committed target tokens decoded before the draft's text when translating it (transformers' target_lookbehind)
LOOKBEHIND = 10
# draft context tokens decoded before the draft tokens, so that a leading space marker decodes as it would in place
DRAFT_ANCHOR = 4


def same_vocabulary(target_tokenizer, draft_tokenizer) -> bool:
    """Whether two tokenizers map the same strings to the same ids (compared as vocabularies, not sizes: a padded
    model vocabulary, as Qwen2.5-7B's beside Qwen2.5-0.5B's, has the same tokenizer)."""
    return target_tokenizer is draft_tokenizer or target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


def decode(tokenizer, ids: list[int]) -> str:
    """`ids` as text, special tokens included, with no clean-up of spaces (clean-up would make the text depend on
    its neighbours)."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def token_texts(tokenizer, num_ids: int) -> list[str | None]:
    """The text each id `0..num_ids-1` adds after other text (so `Ġthe` and `▁the` both give `" the"`, and a
    byte-fallback token `<0x41>` gives `"A"`), or `None` for an id beyond the tokenizer, an empty text, or part of
    a multi-byte character (it decodes to U+FFFD: its text depends on its neighbours).

    Each id is decoded after an anchor (the tokens of `"a"`) and the anchor's text is removed, so that a space
    marker a tokenizer drops at the start of a text (SentencePiece's) is kept.
    """
    anchor = tokenizer.encode("a", add_special_tokens=False)
    anchor_text = decode(tokenizer, anchor)
    ids = range(min(num_ids, len(tokenizer)))
    texts = tokenizer.batch_decode([anchor + [i] for i in ids], skip_special_tokens=False,
                                   clean_up_tokenization_spaces=False)
    return [text[len(anchor_text):] if text.startswith(anchor_text) and len(text) > len(anchor_text)
            and "\ufffd" not in text else None for text in texts] + [None] * (num_ids - len(ids))


class VocabularyMap:
    """The token-level intersection of two vocabularies: the draft ids whose text (`token_texts`) is also a target
    token's, and that target id (vLLM's `VocabMapping` and transformers' `AssistantToTargetTranslator` compare
    token strings after normalising the space marker; comparing decoded texts also tells a byte-level `é` (one
    byte of a character) from a SentencePiece `é`).

    The map is injective (a text met twice keeps its first id on each side), so pushing a draft distribution
    through it keeps every probability (`widen`). Special tokens map by their text; the draft's EOS maps to the
    target's EOS.

    Args:
        target_tokenizer, draft_tokenizer (`PreTrainedTokenizerBase`): the two tokenizers.
        target_width (`int`): the width of the target's logits (ids at or above it are never mapped to).
        draft_width (`int`): the width of the draft model's logits.

    Attributes:
        draft_ids (`torch.LongTensor` of shape `(n,)`): the draft ids of the intersection, ascending.
        target_ids (`torch.LongTensor` of shape `(n,)`): the target id of each, all `< target_width`.
        to_draft_ids (`torch.LongTensor` of shape `(target_width,)`): each target id's draft id, -1 outside.

    Raises:
        `ValueError`: for an intersection with no token.
    """

    def __init__(self, target_tokenizer, draft_tokenizer, target_width: int, draft_width: int):
        target_of_text = {}
        for target_id, text in enumerate(token_texts(target_tokenizer, target_width)):
            if text is not None:
                target_of_text.setdefault(text, target_id)
        pairs = {}
        for draft_id, text in enumerate(token_texts(draft_tokenizer, draft_width)):
            if text is not None and text in target_of_text:
                pairs.setdefault(target_of_text[text], draft_id)
        draft_eos, target_eos = draft_tokenizer.eos_token_id, target_tokenizer.eos_token_id
        if draft_eos is not None and target_eos is not None and draft_eos < draft_width and target_eos < target_width:
            pairs = {t: d for t, d in pairs.items() if d != draft_eos} | {target_eos: draft_eos}
        if not pairs:
            raise ValueError("The draft's and the target's tokenizers share no token: no draft can be translated.")
        draft_ids, target_ids = zip(*sorted((d, t) for t, d in pairs.items()))
        self.draft_ids = torch.tensor(draft_ids, dtype=torch.long)
        self.target_ids = torch.tensor(target_ids, dtype=torch.long)
        self.to_draft_ids = torch.full((target_width,), -1, dtype=torch.long)
        self.to_draft_ids[self.target_ids] = self.draft_ids
        self.target_width = target_width
        self._copies = {}  # device -> the three index tensors there, copied once

    def _on(self, device) -> tuple[torch.LongTensor, torch.LongTensor, torch.LongTensor]:
        """`(draft_ids, target_ids, to_draft_ids)` on `device`."""
        if device not in self._copies:
            self._copies[device] = tuple(ids.to(device) for ids in (self.draft_ids, self.target_ids, self.to_draft_ids))
        return self._copies[device]

    def __len__(self) -> int:
        return len(self.draft_ids)

    def widen(self, draft_logits: torch.FloatTensor) -> torch.FloatTensor:
        """Draft logits `(..., draft_width)` as target logits `(..., target_width)`: each intersection token's logit
        at its target id, the lowest logit elsewhere (probability 0 after a softmax: the draft distribution is
        renormalised over the intersection)."""
        draft_ids, target_ids, _ = self._on(draft_logits.device)
        return widen_logits(draft_logits[..., draft_ids], target_ids, self.target_width)

    def to_draft(self, target_ids: torch.LongTensor) -> torch.LongTensor:
        """The draft ids of intersection target ids `(n,)`.

        Raises:
            `ValueError`: a target id outside the intersection (a bug: a TLI draft samples only inside it).
        """
        draft_ids = self._on(target_ids.device)[2][target_ids]
        if bool((draft_ids < 0).any()):
            raise ValueError(f"Target tokens {target_ids.tolist()} are not all in the vocabularies' intersection.")
        return draft_ids


class TokenizerBridge:
    """Translates between a target's tokens and a draft model's of another tokenizer (see the module docstring).

    Args:
        target_tokenizer, draft_tokenizer (`PreTrainedTokenizerBase`): the two tokenizers (fast tokenizers are
            much quicker: every step decodes and encodes).
        target_width (`int`): the width of the target's logits; translated ids are checked against it.
        draft_width (`int`): the width of the draft model's logits.
    """

    def __init__(self, target_tokenizer, draft_tokenizer, target_width: int, draft_width: int):
        self.target_tokenizer, self.draft_tokenizer = target_tokenizer, draft_tokenizer
        self.target_width, self.draft_width = target_width, draft_width
        bos = draft_tokenizer.bos_token_id  # the draft's BOS, when its tokenizer puts one before a text prompt
        self.draft_bos = [bos] if bos is not None and draft_tokenizer.encode("a")[:1] == [bos] else []

    @cached_property
    def vocabulary(self) -> VocabularyMap:
        """The token-level intersection (built on first use: sampling only)."""
        return VocabularyMap(self.target_tokenizer, self.draft_tokenizer, self.target_width, self.draft_width)

    def to_draft(self, target_ids: list[int]) -> list[int]:
        """The draft's tokens `(m,)` of the text of committed target tokens `(n,)`: decoded with their special tokens
        as text (a special token the draft's tokenizer also has becomes its id) except a leading BOS, and encoded
        after the draft's BOS if its tokenizer puts one before a text prompt.

        Raises:
            `ValueError`: an encoding with an id at or over the draft's logits width (a tokenizer that does not
                belong to the draft model).
        """
        bos = self.target_tokenizer.bos_token_id
        start = 1 if target_ids and bos is not None and target_ids[0] == bos else 0
        ids = self.draft_bos + self.draft_tokenizer.encode(decode(self.target_tokenizer, target_ids[start:]),
                                                           add_special_tokens=False)
        if ids and max(ids) >= self.draft_width:
            raise ValueError(f"The draft tokenizer gave token id {max(ids)}, but the draft model scores "
                             f"{self.draft_width} tokens: pass the draft model's own tokenizer as draft_tokenizer=.")
        return ids

    def draft_text(self, draft_context: list[int], draft_ids: list[int]) -> str:
        """The text of draft tokens after their context: decoded after the context's last tokens (so that a leading
        space marker is kept), without a trailing partial character."""
        anchor = draft_context[-DRAFT_ANCHOR:]
        anchor_text, text = decode(self.draft_tokenizer, anchor), decode(self.draft_tokenizer, anchor + draft_ids)
        text = text[len(anchor_text):] if text.startswith(anchor_text) else decode(self.draft_tokenizer, draft_ids)
        return text.rstrip("\ufffd")

    def to_target(self, committed: list[int], draft_context: list[int], draft_ids: list[int]) -> list[int]:
        """String-level exact matching: the target tokens that decode to exactly the draft tokens' text after the
        committed target tokens, or fewer (none when no such tokens are found).

        The text is encoded after the text of the last `LOOKBEHIND` committed tokens; when the encoding keeps that
        window's own tokens, the tokens after them are the draft; when it merges across the boundary (the
        committed tokens end inside a word the draft continues), the text is encoded on its own. Either is kept only
        if the committed window and it decode to the window's text and the draft's (string-level exact match). The
        result is cut before the first id at or over the target's logits width. A draft EOS ends the text and
        becomes the target's EOS.

        Args:
            committed (`list[int]`): the row's committed target tokens.
            draft_context (`list[int]`): the draft's tokens of the same text (`to_draft`).
            draft_ids (`list[int]`): draft tokens after `draft_context`.
        """
        draft_eos, target_eos = self.draft_tokenizer.eos_token_id, self.target_tokenizer.eos_token_id
        ends = draft_eos is not None and target_eos is not None and draft_eos in draft_ids
        if ends:
            draft_ids = draft_ids[: draft_ids.index(draft_eos)]
        text = self.draft_text(draft_context, draft_ids) if draft_ids else ""
        if not text:
            return [target_eos] if ends and target_eos < self.target_width else []
        window = committed[-LOOKBEHIND:]
        window_text = decode(self.target_tokenizer, window)
        window_ids = self.target_tokenizer.encode(window_text, add_special_tokens=False)
        full_ids = self.target_tokenizer.encode(window_text + text, add_special_tokens=False)
        if full_ids[: len(window_ids)] == window_ids:
            candidates = full_ids[len(window_ids):]
        else:
            candidates = self.target_tokenizer.encode(text, add_special_tokens=False)
        if decode(self.target_tokenizer, window + candidates) != window_text + text:
            return []
        candidates += [target_eos] if ends else []
        out_of_range = [i for i, token in enumerate(candidates) if token >= self.target_width]
        return candidates[: out_of_range[0]] if out_of_range else candidates

    def draft_length(self, num_target_tokens: int, draft_per_target: float) -> int:
        """Draft tokens to draft for `num_target_tokens` target tokens, at `draft_per_target` draft tokens per
        target token (measured on the prompt), rounded, at least 1."""
        return max(1, round(num_target_tokens * draft_per_target))
