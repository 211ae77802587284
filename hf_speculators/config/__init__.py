"""Settings and what is made from them: `SpeculativeConfig`, building drafters and verifiers from it, the bundled
presets (Hub model cards), the settings read from draft checkpoints, and the speculators and vLLM exports."""

from .registry import head_methods
from .speculative_config import SpeculativeConfig, method_fields

__all__ = ["SpeculativeConfig", "head_methods", "method_fields"]
