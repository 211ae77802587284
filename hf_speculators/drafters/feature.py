"""The base of drafters that draft from the target's own hidden states (EAGLE, Medusa)."""

import torch

from ..features import TargetFeatures
from .base import Drafter


class FeatureDrafter(Drafter):
    """A drafter that reads the target's hidden states, recorded in the target's own prefill and verification
    forwards (`hf_speculators.features.TargetFeatures`): no second target forward.

    A subclass says which hidden states it reads (`feature_points`) and, in `propose`, takes the rows of the tokens
    committed since its last call with `committed_features(input_ids)`. At a step whose committed length is n the
    target's cache holds n - 1 tokens, so the newest row is the feature of position n - 2 (the last committed token
    is still pending): EAGLE drafts x_n from the pair (feature n - 2, x_{n-1}); Medusa's head 0 from feature n - 2.

    For a batch (`propose_batch`), `committed_features_batch` gives each row's features, recorded in the batch's
    verification forwards (`target_forward_batch`). Batches take chains only: a subclass keeps its token tree shape,
    if any, in `self.tree` (`None` for a chain).

    Runs only inside `hf_speculators.generate`, on the model types `DecoderLayers` takes.

    Raises:
        `ValueError`: at the start of generation, for feature points the target does not have; for a batch, with
            a token tree (`check_batch_support`).
        `RuntimeError`: from `get_candidates`: transformers' own assisted loop does not pass the target's hidden states.
    """

    def feature_points(self, target) -> tuple[list[int], bool]:
        """`(layer_ids, final_norm)`: the decoder layers whose input is read, and whether the final norm's output is."""
        raise NotImplementedError(f"{type(self).__name__} must implement feature_points(target)")

    def prepare(self, target, generation_config, logits_processor, generator, tokenizer=None, cache=None) -> None:
        super().prepare(target, generation_config, logits_processor, generator, tokenizer, cache)
        layer_ids, final_norm = self.feature_points(target)
        self._features = TargetFeatures(target, layer_ids, final_norm)

    def target_forward(self, model, cache, input_ids, tree, num_prefix, num_logits) -> torch.FloatTensor:
        """The target's forward (as `Drafter.target_forward`), recording the hidden states of the fed tokens."""
        parent = super().target_forward
        return self._features.record(lambda: parent(model, cache, input_ids, tree, num_prefix, num_logits),
                                     input_ids, tree, num_prefix)

    def target_forward_batch(self, model, cache, input_ids, new_valid, num_logits=None) -> torch.FloatTensor:
        """The target's forward over a batch (as `Drafter.target_forward_batch`), recording each row's hidden states."""
        parent = super().target_forward_batch
        return self._features.record_batch(lambda: parent(model, cache, input_ids, new_valid, num_logits),
                                           input_ids, new_valid, cache.rows, cache.lengths)

    def check_batch_support(self) -> None:
        if self.tree is not None:
            raise ValueError(
                f"{type(self).__name__}(tree=...) drafts token trees, which batch size > 1 does not support yet: use "
                "tree=None (a chain of num_draft_tokens), or call generate once per prompt."
            )

    def committed_features_batch(self, input_ids: list[torch.LongTensor],
                                 rows: list[int]) -> list[tuple[int, torch.FloatTensor | None]]:
        """`committed_features` of each sequence of a batch (`input_ids[i]` `(1, sequence_length_i)` is row
        `rows[i]`, as `propose_batch` gets them); rows that finished are forgotten."""
        return self._features.commit_batch(input_ids, rows)

    def committed_features(self, input_ids: torch.LongTensor) -> tuple[int, torch.FloatTensor | None]:
        """`(position, rows)`: the features `(num_new, width)` of the tokens committed since the last call, the first
        at `position` (see `TargetFeatures.commit`); `rows` is `None` when nothing new was recorded."""
        return self._features.commit(input_ids)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        raise RuntimeError(
            f"{type(self).__name__} drafts from the target's hidden states, which only hf_speculators.generate "
            "records; run it through model.generate(..., custom_generate=hf_speculators.generate)."
        )
