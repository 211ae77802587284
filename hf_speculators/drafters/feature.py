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

    Runs only inside `hf_speculators.generate`, on the model types `DecoderLayers` takes.

    Raises:
        `ValueError`: at the start of generation, for feature points the target does not have.
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

    def committed_features(self, input_ids: torch.LongTensor) -> tuple[int, torch.FloatTensor | None]:
        """`(position, rows)`: the features `(num_new, width)` of the tokens committed since the last call, the first
        at `position` (see `TargetFeatures.commit`); `rows` is `None` when nothing new was recorded."""
        return self._features.commit(input_ids)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs):
        raise RuntimeError(
            f"{type(self).__name__} drafts from the target's hidden states, which only hf_speculators.generate "
            "records; run it through model.generate(..., custom_generate=hf_speculators.generate)."
        )
