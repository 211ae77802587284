"""hf_speculators: speculative decoding inside transformers' `model.generate()`."""

from .config import SpeculativeConfig
from .decoding import SpeculativeGenerateOutput, enable, generate
from .drafters import (
    DRAFTERS, DFlashDrafter, DraftModelDrafter, Drafter, DynamicTree, EagleDrafter, Gemma4AssistantDrafter, HybridDrafter,
    LayerSkipDrafter, LookaheadDrafter, MedusaDrafter, MTPDrafter, PromptLookupDrafter, StaticTree, SuffixDrafter, TreeDrafter,
)
from .draft import Draft
from .metrics import SpeculativeStats
from .onednn_linear import use_onednn_linear
from .schedules import SCHEDULES, DraftLengthSchedule, GoodputSchedule
from .tree import TokenTree
from .verifiers import (
    VERIFIERS,
    ExactVerifier,
    NodewiseVerifier,
    RejectionVerifier,
    TopKVerifier,
    TypicalVerifier,
    Verdict,
    Verifier,
)

__version__ = "0.1.0"

__all__ = [
    "DRAFTERS",
    "SCHEDULES",
    "VERIFIERS",
    "DFlashDrafter",
    "Draft",
    "DraftLengthSchedule",
    "DraftModelDrafter",
    "Drafter",
    "EagleDrafter",
    "Gemma4AssistantDrafter",
    "LayerSkipDrafter",
    "LookaheadDrafter",
    "MedusaDrafter",
    "MTPDrafter",
    "DynamicTree",
    "ExactVerifier",
    "GoodputSchedule",
    "HybridDrafter",
    "NodewiseVerifier",
    "PromptLookupDrafter",
    "RejectionVerifier",
    "SpeculativeConfig",
    "SpeculativeGenerateOutput",
    "SpeculativeStats",
    "StaticTree",
    "SuffixDrafter",
    "TokenTree",
    "TopKVerifier",
    "TreeDrafter",
    "TypicalVerifier",
    "Verdict",
    "Verifier",
    "enable",
    "generate",
    "use_onednn_linear",
]
