"""hf_speculators: speculative decoding inside transformers' `model.generate()`."""

from .config import SpeculativeConfig
from .decoding import SpeculativeGenerateOutput, enable, generate
from .drafters import DRAFTERS, DraftModelDrafter, Drafter, PromptLookupDrafter
from .metrics import SpeculativeStats
from .types import Draft, Verdict
from .verifiers import VERIFIERS, ExactVerifier, RejectionVerifier, Verifier

__version__ = "0.1.0"

__all__ = [
    "DRAFTERS",
    "VERIFIERS",
    "Draft",
    "DraftModelDrafter",
    "Drafter",
    "ExactVerifier",
    "PromptLookupDrafter",
    "RejectionVerifier",
    "SpeculativeConfig",
    "SpeculativeGenerateOutput",
    "SpeculativeStats",
    "Verdict",
    "Verifier",
    "enable",
    "generate",
]
