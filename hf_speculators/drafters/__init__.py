"""Drafters and their registry, keyed by the names the CLI's `--method` takes."""

from .base import Drafter
from .dflash import DFlashDrafter
from .draft_model import DraftModelDrafter
from .eagle import EagleDrafter
from .gemma4_assistant import Gemma4AssistantDrafter
from .hybrid import HybridDrafter
from .layer_skip import LayerSkipDrafter
from .lookahead import LookaheadDrafter
from .medusa import MedusaDrafter
from .mtp import MTPDrafter
from .prompt_lookup import PromptLookupDrafter
from .suffix import SuffixDrafter
from .tree import TreeDrafter
from .tree_growth import DynamicTree, StaticTree, tree_shape

DRAFTERS: dict[str, type[Drafter]] = {
    PromptLookupDrafter.name: PromptLookupDrafter,
    DraftModelDrafter.name: DraftModelDrafter,
    LayerSkipDrafter.name: LayerSkipDrafter,
    TreeDrafter.name: TreeDrafter,
    "eagle3": EagleDrafter,  # the checkpoint's files say which EAGLE format; the method name is vLLM's
    "eagle": EagleDrafter,
    MedusaDrafter.name: MedusaDrafter,
    LookaheadDrafter.name: LookaheadDrafter,
    SuffixDrafter.name: SuffixDrafter,
    MTPDrafter.name: MTPDrafter,
    DFlashDrafter.name: DFlashDrafter,
    Gemma4AssistantDrafter.name: Gemma4AssistantDrafter,
    HybridDrafter.name: HybridDrafter,  # built from a config by build.build_drafter: suffix + a model drafter
}

__all__ = [
    "DRAFTERS", "DFlashDrafter", "DraftModelDrafter", "Drafter", "DynamicTree", "EagleDrafter", "Gemma4AssistantDrafter", "HybridDrafter", "LayerSkipDrafter", "LookaheadDrafter", "MedusaDrafter", "MTPDrafter",
    "PromptLookupDrafter", "StaticTree", "SuffixDrafter", "TreeDrafter", "tree_shape",
]
