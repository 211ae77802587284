"""Drafters and their registry, keyed by the names the CLI's `--method` takes."""

from .base import Drafter
from .draft_model import DraftModelDrafter
from .layer_skip import LayerSkipDrafter
from .prompt_lookup import PromptLookupDrafter
from .tree import DynamicTree, StaticTree, TreeDrafter, tree_shape

DRAFTERS: dict[str, type[Drafter]] = {
    PromptLookupDrafter.name: PromptLookupDrafter,
    DraftModelDrafter.name: DraftModelDrafter,
    LayerSkipDrafter.name: LayerSkipDrafter,
    TreeDrafter.name: TreeDrafter,
}

__all__ = [
    "DRAFTERS", "DraftModelDrafter", "Drafter", "DynamicTree", "LayerSkipDrafter", "PromptLookupDrafter", "StaticTree", "TreeDrafter",
    "tree_shape",
]
