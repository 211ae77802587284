"""Loading target and draft models and tokenizers from a local folder or a Hub id."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DEMO_DIR = Path(__file__).parent / "demo"
DEMO_TARGET = str(DEMO_DIR / "target")
DEMO_DRAFT = str(DEMO_DIR / "draft")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}


def _check_exists(name_or_path: str) -> None:
    """Raises `FileNotFoundError` for a local-looking path that does not exist (Hub ids are `org/name`)."""
    looks_local = name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1
    if looks_local and not Path(name_or_path).expanduser().exists():
        raise FileNotFoundError(
            f"Model path {name_or_path!r} does not exist. Pass an existing folder with config.json and weights, "
            "or a Hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'."
        )


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu"):
    """Loads a causal LM in eval mode.

    Args:
        name_or_path (`str`): a local folder or a Hub id (downloaded when a network is available).
        dtype (`str`): one of `DTYPES`: `"float32"`, `"bfloat16"`, `"float16"` or `"auto"`.
        device (`str`): a torch device, e.g. `"cpu"` or `"cuda"`.

    Raises:
        `FileNotFoundError`: a local path that does not exist.
        `ValueError`: an unknown dtype.
        `OSError`: a Hub id that cannot be fetched (from transformers).
    """
    if dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}: choose one of {sorted(DTYPES)}.")
    _check_exists(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype])
    return model.to(device).eval()


def load_tokenizer(name_or_path: str):
    """Loads the tokenizer stored with a model (same arguments and errors as `load_model`)."""
    _check_exists(name_or_path)
    return AutoTokenizer.from_pretrained(name_or_path)
