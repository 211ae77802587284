"""The base of drafters that draft with a learned head on the target's own hidden states (EAGLE, Medusa)."""

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..draft import Draft
from .base import Drafter, DraftState, StepFeedback
from .tree_growth import tree_shape


def bounded_depth(num_draft_tokens: int | None, tree, most: int, what: str) -> int:
    """The draft length of a drafter that drafts at most `most` tokens per step (`what` says why): `num_draft_tokens`
    (default `most`), or the depth of `tree` (capped at `most`).

    Raises:
        `ValueError`: `num_draft_tokens` outside `1 .. most`.
    """
    if tree is not None:
        return min(tree.depth, most)
    if num_draft_tokens is None:
        return most
    if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, int) or not 1 <= num_draft_tokens <= most:
        raise ValueError(f"num_draft_tokens must be an integer in 1..{most} ({what}), got {num_draft_tokens!r}.")
    return num_draft_tokens


def keep_features(pending: dict, feedback: StepFeedback) -> None:
    """Keeps each row's features of its newly kept tokens (`feedback.features`) in `pending` (row -> list of
    `(n, hidden_size)` tensors) until the drafter's next `propose` feeds them (`take_features`)."""
    for row, features in zip(feedback.rows, feedback.features):
        pending.setdefault(row, []).append(features)


def take_features(pending: dict, rows: Sequence[int]) -> list[torch.FloatTensor | None]:
    """Each of `rows`' kept features since its last draft, `(n, hidden_size)`, or `None` for a row with none; the
    features of rows no longer running are dropped."""
    parts = [pending.pop(row, None) for row in rows]
    pending.clear()
    return [None if row_parts is None else torch.cat(row_parts) if len(row_parts) > 1 else row_parts[0]
            for row_parts in parts]


class HeadDrafter(Drafter):
    """A drafter whose draft module (`self.module`: an EAGLE head, Medusa heads) reads the target's hidden states,
    which the speculative loop captures in its own forwards and hands over through `observe` (see `target_needs`):
    no second target forward.

    The module runs on the target's device and in its dtype (`module_for`). A module you passed in is never changed:
    when it is elsewhere, the drafter keeps a converted copy per (device, dtype) it served, for as long as the
    drafter lives. A module the drafter loaded itself (`from_pretrained`) is moved in place instead, so a call on a
    target of another device or dtype converts it and loads nothing from disk.

    Raises:
        `RuntimeError`: from `get_candidates`: transformers' own assisted loop does not pass the target's hidden
            states.
    """

    converts_per_call = True  # `module_for`: a drafter built for one device and dtype serves any other
    tree = None  # the token-tree shape (`StaticTree` or `DynamicTree`) of a drafter that drafts trees; else chains

    @property
    def drafts_trees(self) -> bool:
        return self.tree is not None

    def shape_repr(self) -> str:
        """What the drafter drafts, for `__repr__`: its tree, or its chains' length."""
        return f"num_draft_tokens={self.num_draft_tokens}" if self.tree is None else f"tree={self.tree!r}"

    def __init__(self, module: nn.Module, num_draft_tokens: int, owns_module: bool = False):
        super().__init__(num_draft_tokens)
        self.module, self.owns_module = module, owns_module
        self._converted: dict[tuple[torch.device, torch.dtype], nn.Module] = {}

    def module_for(self, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The draft module on `device` in `dtype`: itself when it is there already or this drafter loaded it (then
        moved in place), else a converted copy, made once per (device, dtype) and kept on the drafter."""
        parameter = next(self.module.parameters())
        if (parameter.device, parameter.dtype) == (torch.device(device), dtype):
            return self.module
        if self.owns_module:
            return self.module.to(device=device, dtype=dtype)
        key = (torch.device(device), dtype)
        if key not in self._converted:
            self._converted[key] = copy.deepcopy(self.module).to(device=device, dtype=dtype).eval()
        return self._converted[key]

    def draft_modules(self, target) -> tuple:
        """The draft module as it runs for `target` (`module_for`), and the target's embeddings and LM head, which
        head drafters call outside the target's forward (embedding draft tokens, scoring draft features)."""
        return (self.module_for(target.device, target.dtype), target.get_input_embeddings(),
                target.get_output_embeddings())

    @staticmethod
    def draft_chains(state: DraftState, input_ids: Sequence[torch.LongTensor], logits: torch.FloatTensor,
                     budgets: Sequence[int], next_logits: Callable) -> list[Draft]:
        """Each row's chain of `budgets[i]` draft tokens, one token of every row per step.

        Step s picks the tokens of the rows still drafting (`state.draft_tokens`: the call's processors, sampled
        under sampling with `draft_probs`, else the argmax) from that step's logits, each row continuing its
        committed tokens and its chain so far.

        Args:
            state (`DraftState`): the call's state.
            input_ids (`Sequence[torch.LongTensor]`): each row's committed tokens, `(1, sequence_length_i)`.
            logits (`torch.FloatTensor` of shape `(num_rows, vocab_size)`): the draft logits of each row's first token.
            budgets (`Sequence[int]`): each row's chain length (0: no draft).
            next_logits (`Callable[[int, torch.LongTensor, list[bool]], torch.FloatTensor]`): given the step s,
                the tokens it drafted `(num_rows,)` (any id in rows that drafted none) and which rows draft a token
                at step s + 1, the draft logits of step s + 1 `(num_rows, vocab_size)`.
        """
        num_rows, num_steps = len(budgets), max(budgets, default=0)
        tokens, probs = [[] for _ in budgets], [[] for _ in budgets]

        def prefixes(rows):  # read only when the call has logits processors
            return (torch.cat([input_ids[i], torch.stack(tokens[i])[None]], dim=-1) if tokens[i] else input_ids[i]
                    for i in rows)

        for step in range(num_steps):
            drafting = [i for i, budget in enumerate(budgets) if budget > step]
            every_row = len(drafting) == num_rows
            step_tokens, step_probs = state.draft_tokens(prefixes(drafting), logits if every_row else logits[drafting])
            for j, i in enumerate(drafting):
                tokens[i].append(step_tokens[j])
                probs[i].append(None if step_probs is None else step_probs[j])
            if step + 1 == num_steps:
                break
            fed = step_tokens
            if not every_row:
                fed = torch.zeros(num_rows, dtype=torch.long, device=logits.device)
                fed[drafting] = step_tokens
            logits = next_logits(step, fed, [budget > step + 1 for budget in budgets])
        return [Draft.chain(torch.stack(row_tokens), torch.stack(row_probs) if state.do_sample else None)
                if row_tokens else Draft.empty(ids.device)
                for ids, row_tokens, row_probs in zip(input_ids, tokens, probs)]

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        raise RuntimeError(
            f"{type(self).__name__} drafts from the target's hidden states, which only hf_speculators.generate "
            "records; run it through model.generate(..., custom_generate=hf_speculators.generate)."
        )


def tree_depth(config) -> int | None:
    """A learned head's draft length under `config.tree` (its depth), `None` for a chain."""
    return None if config.tree is None else tree_shape(config.tree).depth
