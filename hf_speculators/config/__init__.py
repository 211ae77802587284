"""Settings and what is made from them: `SpeculativeConfig`, building drafters and verifiers from it, the bundled
presets (Hub model cards), the settings read from draft checkpoints, and the speculators and vLLM exports."""

from .speculative_config import HEAD_METHODS, SpeculativeConfig, method_fields

__all__ = ["HEAD_METHODS", "SpeculativeConfig", "method_fields"]
