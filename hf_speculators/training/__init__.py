"""Training draft heads and draft models for your own target: EAGLE-3, Medusa-1 and draft-model distillation.

```python
from hf_speculators.training import TrainingSettings, load_texts, regenerate, split_held_out, train_eagle3

texts, held_out = split_held_out(load_texts(["prompts.jsonl"]), 16)
report = train_eagle3(target, tokenizer, regenerate(target, tokenizer, texts), regenerate(target, tokenizer, held_out),
                      "my-eagle3", target_name="org/target", draft_vocab_size=2048,
                      settings=TrainingSettings(max_steps=2000))
config = hs.SpeculativeConfig.from_pretrained("my-eagle3")
```

Modules, one job each: `data` (sources and on-policy regeneration), `target_features` (the frozen target's
features), `eagle3`, `medusa`, `distill` (the losses and new drafters), `loop` (the `accelerate` training loop with
checkpoint choice by measured acceptance), `evaluate` (acceptance through `generate()`), `trainers` (end to end,
saving folders that `SpeculativeConfig.from_pretrained` loads), `cli` (`hf-speculators train` and `evaluate`).

Training needs the `train` extra (`accelerate`, `datasets`): the names below are imported on first use, so that
`import hf_speculators` and the rest of the command line work without it.
"""

import importlib

# public name -> the module defining it
_EXPORTS = {
    "Text": "data", "load_texts": "data", "split_held_out": "data", "regenerate": "data",
    "reference_examples": "data", "save_examples": "data", "load_examples": "data", "token_counts": "data",
    "distill_mtp": "native", "distill_dflash": "native", "TargetFeatures": "target_features", "draft_vocabulary": "eagle3", "build_eagle3_head": "eagle3",
    "Eagle3Loss": "eagle3", "build_medusa_heads": "medusa", "MedusaLoss": "medusa", "DistillLoss": "distill",
    "load_draft": "distill", "TrainingSettings": "loop", "fit": "loop", "Acceptance": "evaluate",
    "measure_acceptance": "evaluate", "train_eagle3": "trainers", "train_medusa": "trainers",
    "train_draft": "trainers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
