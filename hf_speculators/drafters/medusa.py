"""Drafting with Medusa heads on the target's own last hidden state: a chain of each head's top token, or a tree of
each head's top-k along Medusa tree choices."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..draft import Draft
from ..heads.files import head_folder
from ..heads.medusa import MedusaHeads
from ..heads.medusa_formats import read_medusa_heads
from .base import DraftState, StepFeedback, TargetNeeds
from .draft_model import vocabulary_size
from .head import HeadDrafter, tree_depth
from .tree_growth import DynamicTree, StaticTree, position_trees, tree_shape
from .spec import MethodSpec, Setting, Variant

# Medusa's default tree, `mc_sim_7b_63` in FasterDecoding/Medusa `medusa/model/medusa_choices.py` (@e2a5d20):
# 63 paths of child ranks, depth <= 4, found by simulating acceptance with Vicuna-7B's heads (Cai et al. 2024,
# Section 2.1.2). Path (c1, ..., cd) is head 0's c1-th most likely token, ..., head d-1's cd-th.
MC_SIM_7B_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
    (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,), (9,),
    (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6),
    (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2),
    (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0), (0, 0, 0, 1),
    (1, 6), (0, 7, 0),
)
MEDUSA_TREE_NAMES = ("medusa", "mc_sim_7b_63")


def medusa_tree(tree, num_heads: int) -> StaticTree | DynamicTree:
    """The tree shape of a `MedusaDrafter` with `num_heads` heads.

    Args:
        tree: `"medusa"` or `"mc_sim_7b_63"` (Medusa's default tree, its paths no deeper than `num_heads`), or
            anything `tree_shape` takes (a `StaticTree`, `DynamicTree`, list of paths or preset mapping).

    Raises:
        `ValueError`: an unknown tree name, a malformed tree, or one deeper than the heads.
    """
    if isinstance(tree, str):
        if tree not in MEDUSA_TREE_NAMES:
            raise ValueError(f"Unknown Medusa tree {tree!r}: use one of {MEDUSA_TREE_NAMES}, a list of paths of child "
                             "ranks, a StaticTree or a DynamicTree.")
        return StaticTree([path for path in MC_SIM_7B_63 if len(path) <= num_heads])
    shape = tree_shape(tree)
    if shape.depth > num_heads:
        raise ValueError(f"The tree is {shape.depth} tokens deep but there are {num_heads} Medusa heads: head d drafts "
                         "depth d + 1 only, so the tree can be at most as deep as the heads are many.")
    return shape


@dataclass
class MedusaState(DraftState):
    """A `MedusaDrafter`'s call: the heads on the target's device and dtype, the target's LM head for heads without
    their own, and each row's newest feature (the final norm's output at its newest kept position)."""

    heads: nn.Module = None
    lm_head: nn.Module | None = None
    newest: dict = field(default_factory=dict)  # row -> `(hidden_size,)`


class MedusaDrafter(HeadDrafter):
    """Drafts with Medusa heads (Cai et al. 2024) on the target's last hidden state, captured in its own forwards.

    At a step whose committed length is n, the newest target feature is the final norm's output at position n - 2
    (the last committed token x_{n-1} is pending, the draft's root); head d (0-based) drafts x_{n+d} from it. The
    heads do not depend on the drafted tokens, so a step costs one pass of the heads over every row's newest hidden
    state and no draft forward per token.

    - chain (`tree=None`): head d's most likely token after the call's logits processors and warpers, or under
      sampling a token drawn from that processed distribution, returned as `draft_probs` so that rejection sampling
      is lossless.
    - tree: each head's top-k along a `StaticTree` of child ranks (`tree="medusa"`: Medusa's default
      `mc_sim_7b_63`, 63 nodes of depth <= 4) or a `DynamicTree` (EAGLE-2's expansion, scored by the heads'
      probabilities); the children of every node at depth d are head d's top tokens. The draft is deterministic
      (`draft_probs=None`): rejection verification treats each node as one-hot, which is lossless.

    Every row of a batch drafts at once (chains or trees, from one pass of the heads).

    Medusa itself verifies with typical acceptance (`verifier="typical"`, `TypicalVerifier(epsilon=0.09,
    delta=0.3)`: its `posterior_threshold` and `posterior_alpha`), which is not lossless.

    Args:
        heads (`MedusaHeads`): the heads, for the target's hidden size (and vocabulary, with their own LM heads).
            They run on the target's device in its dtype: heads elsewhere are never changed; the drafter keeps a
            converted copy per (device, dtype) (see `HeadDrafter`). Heads loaded by `from_pretrained` are moved in
            place.
        num_draft_tokens (`int`, *optional*): draft tokens per step, at most the number of heads (a tree's depth at
            most); defaults to the number of heads (a tree's depth).
        tree (`str`, `StaticTree`, `DynamicTree`, list of paths or mapping, *optional*): `None` for a chain; else the
            tree (see `medusa_tree`).

    Raises:
        `ValueError`: at construction, for `num_draft_tokens` or a tree deeper than the heads; at the start of
            generation, for heads whose `hidden_size` or `vocab_size` differ from the target's.

    Example:

    ```python
    drafter = hs.MedusaDrafter.from_pretrained("FasterDecoding/medusa-vicuna-7b-v1.3", tree="medusa")
    out = model.generate(**inputs, custom_generate=hs.generate, candidate_generator=drafter, verifier="typical")
    ```
    """

    name = "medusa"
    state_class = MedusaState

    def __init__(self, heads: MedusaHeads, num_draft_tokens: int | None = None,
                 tree: "str | StaticTree | DynamicTree | Sequence | Mapping | None" = None):
        if not isinstance(heads, MedusaHeads):
            raise ValueError(f"MedusaDrafter takes MedusaHeads (or use MedusaDrafter.from_pretrained), got "
                             f"{type(heads).__name__}.")
        self.tree = None if tree is None else medusa_tree(tree, heads.num_heads)
        depth = heads.num_heads if self.tree is None else self.tree.depth
        super().__init__(heads, depth if num_draft_tokens is None else num_draft_tokens)
        if self.num_draft_tokens > depth:
            raise ValueError(f"num_draft_tokens={num_draft_tokens} is more than the {depth} tokens these Medusa heads "
                             f"draft ({'their number' if self.tree is None else 'the tree depth'}).")

    @property
    def heads(self) -> MedusaHeads:
        """The heads as given (or loaded)."""
        return self.module

    @classmethod
    def from_pretrained(cls, repo_id_or_path: str, *, revision: str | None = None, token: str | None = None,
                        num_draft_tokens: int | None = None, tree=None) -> "MedusaDrafter":
        """A drafter with the Medusa heads of a checkpoint (Medusa v0.1 or version 2, detected from its files; see
        `hf_speculators.heads.medusa_formats`): a local folder, a demo id (`"hf_speculators/demo-medusa"`) or a
        Hub repo (its JSON and weight files only; never code). The drafter owns the heads (moved in place to each
        call's target device and dtype).

        Raises:
            `ValueError`: not a Medusa checkpoint (no config.json with `medusa_num_heads` and `medusa_lm_head`
                weights), or malformed weights; the drafter's own errors.
            `FileNotFoundError`: a local path that is not a folder.
        """
        heads = read_medusa_heads(head_folder(repo_id_or_path, revision=revision, token=token))
        drafter = cls(heads, num_draft_tokens=num_draft_tokens, tree=tree)
        drafter.owns_module = True
        return drafter

    def target_needs(self, target) -> TargetNeeds:
        return TargetNeeds(final_norm=True)

    def start(self, state: MedusaState) -> None:
        lm_head = state.target.get_output_embeddings()
        vocab_size, hidden_size = vocabulary_size(state.target), lm_head.weight.shape[1]
        if self.heads.hidden_size != hidden_size:
            raise ValueError(f"The Medusa heads have hidden_size {self.heads.hidden_size} but the target's hidden "
                             f"size is {hidden_size}: they were trained for another model.")
        if self.heads.has_lm_heads and self.heads.vocab_size != vocab_size:
            raise ValueError(f"The Medusa heads have vocab_size {self.heads.vocab_size} but the target's vocabulary "
                             f"has {vocab_size} tokens: they were trained for another model.")
        if isinstance(self.tree, StaticTree) and max(self.tree.ranks) >= vocab_size:
            raise ValueError(f"The tree asks for child rank {max(self.tree.ranks)} of a {vocab_size}-token vocabulary.")
        state.heads = self.module_for(lm_head.weight.device, lm_head.weight.dtype)
        state.lm_head = None if self.heads.has_lm_heads else lm_head

    def observe(self, state: MedusaState, feedback: StepFeedback) -> None:
        """Keeps each row's newest feature: the heads read nothing older."""
        for row, features in zip(feedback.rows, feedback.features):
            if len(features):  # a one-token prompt keeps nothing in a batch's prefill
                state.newest[row] = features[-1]

    @torch.no_grad()
    def propose(self, state: MedusaState, input_ids: Sequence[torch.LongTensor], max_tokens: Sequence[int],
                rows: Sequence[int]) -> list[Draft]:
        drafts = [Draft.empty(ids.device) for ids in input_ids]
        if len(state.newest) > len(rows):  # rows that finished
            state.newest = {row: state.newest[row] for row in rows if row in state.newest}
        # rows with a feature (a one-token prompt has none at its first step) and room for a draft
        ready = [i for i, (row, budget) in enumerate(zip(rows, max_tokens)) if row in state.newest and budget > 0]
        if not ready:
            return drafts
        budgets = [min(self.num_draft_tokens, max_tokens[i]) for i in ready]
        # head d's logits for x_{n+d} of every ready row, all from its newest feature (position n - 2)
        newest = torch.stack([state.newest[rows[i]] for i in ready])  # [num_ready, hidden_size]
        logits = state.heads(newest, state.lm_head, max(budgets)).to(input_ids[0].device)  # [depths, ready, vocab]
        ready_ids = [input_ids[i] for i in ready]
        if self.tree is None:
            ready_drafts = self.draft_chains(state, ready_ids, logits[0], budgets, lambda step, *_: logits[step + 1])
        else:
            # the heads read no draft token: depth d's children come from head d's logits, whatever the parent
            ready_drafts = position_trees(self.tree, ready_ids, state.logits_processor, list(logits.transpose(0, 1)),
                                          budgets)
        for i, draft in zip(ready, ready_drafts):
            drafts[i] = draft
        return drafts

    def __repr__(self) -> str:
        return (f"MedusaDrafter(num_heads={self.heads.num_heads}, num_draft_tokens={self.num_draft_tokens}, "
                f"tree={self.tree!r})")


MEDUSA_SPEC = MethodSpec(
    "medusa", MedusaDrafter, required=("draft_model",), shared=("draft_revision", "tree"), loads="head",
    checkpoint=Setting("medusa_head", str,
                       help="medusa and medusa-tree: the Medusa heads checkpoint (default: the demo target's)"),
    variants={"medusa": Variant(), "medusa-tree": Variant(length="depth")}, draft_length=tree_depth,
    vllm_refusal=(
        "vLLM reads Medusa heads in its own layout (blocks.*, lm_heads.*), not the FasterDecoding checkpoints "
        "hf_speculators reads: `hf-speculators export NAME --to vllm` (or `convert_medusa_heads`) writes them in "
        "vLLM's layout, then pass them as speculative_config={'method': 'medusa', 'model': FOLDER}."),
)
