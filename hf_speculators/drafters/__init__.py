"""Drafters and their method specs (`MethodSpec`, one declared beside each drafter), keyed by the config's method."""

from .base import Drafter
from .dflash import DFLASH_SPEC, DFlashDrafter
from .draft_model import DRAFT_MODEL_SPEC, DraftModelDrafter
from .eagle import EAGLE3_SPEC, EAGLE_SPEC, EagleDrafter
from .gemma4_assistant import GEMMA4_ASSISTANT_SPEC, Gemma4AssistantDrafter
from .hybrid import HYBRID_SPEC, HybridDrafter
from .layer_skip import LAYER_SKIP_SPEC, LayerSkipDrafter
from .lookahead import LOOKAHEAD_SPEC, LookaheadDrafter
from .medusa import MEDUSA_SPEC, MedusaDrafter
from .mtp import MTP_SPEC, MTPDrafter
from .prompt_lookup import PROMPT_LOOKUP_SPEC, PromptLookupDrafter
from .spec import Baseline, MethodSpec, Setting, Variant, VllmMapping
from .suffix import SuffixDrafter, SUFFIX_SPEC
from .tree import TREE_SPEC, TreeDrafter
from .tree_growth import DynamicTree, StaticTree, tree_shape

# method -> spec, in the order of the command line's and the benchmark's method lists
DRAFTER_SPECS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    PROMPT_LOOKUP_SPEC, SUFFIX_SPEC, LOOKAHEAD_SPEC, DRAFT_MODEL_SPEC, TREE_SPEC, HYBRID_SPEC, LAYER_SKIP_SPEC,
    EAGLE3_SPEC, EAGLE_SPEC, MEDUSA_SPEC, MTP_SPEC, DFLASH_SPEC, GEMMA4_ASSISTANT_SPEC)}
DRAFTERS: dict[str, type[Drafter]] = {name: spec.drafter for name, spec in DRAFTER_SPECS.items()}

__all__ = [
    "Baseline", "DRAFTERS", "DRAFTER_SPECS", "DFlashDrafter", "DraftModelDrafter", "Drafter", "DynamicTree",
    "EagleDrafter", "Gemma4AssistantDrafter", "HybridDrafter", "LayerSkipDrafter", "LookaheadDrafter", "MedusaDrafter",
    "MTPDrafter", "MethodSpec", "PromptLookupDrafter", "Setting", "StaticTree", "SuffixDrafter", "TreeDrafter",
    "Variant", "VllmMapping", "tree_shape",
]
