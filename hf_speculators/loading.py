"""Loading target and draft models and tokenizers from a local folder or a Hub id."""

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from .quantization import check_quantizable, quantization_config

DEMO_DIR = Path(__file__).parent / "demo"
DEMO_TARGET = str(DEMO_DIR / "target")
DEMO_DRAFT = str(DEMO_DIR / "draft")
# ids that name the bundled demo models wherever the package is installed (used by the demo presets)
DEMO_IDS = {
    "hf_speculators/demo-target": DEMO_TARGET,
    "hf_speculators/demo-draft": DEMO_DRAFT,
    "hf_speculators/demo-eagle3": str(DEMO_DIR / "eagle3"),  # an EAGLE-3 head for the demo target
    "hf_speculators/demo-medusa": str(DEMO_DIR / "medusa"),  # Medusa heads for the demo target
    "hf_speculators/demo-draft-sp": str(DEMO_DIR / "draft_sp"),  # a draft of another tokenizer (SentencePiece-style)
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
AUTO = "auto"  # --device and --dtype default: the best available device; the checkpoint's dtype on an accelerator
# files of which a local tokenizer folder holds at least one (fast, slow BPE, SentencePiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model")
# what reading a checkpoint raises for corrupted, truncated or mismatched files (transformers, safetensors, torch)
UNREADABLE_CHECKPOINT = (OSError, ValueError, KeyError, RuntimeError, SafetensorError, json.JSONDecodeError)


def resolve_device(device: str = AUTO) -> str:
    """The device to load onto: `"auto"` is the best available, CUDA, then MPS (Apple GPUs), then the CPU.

    Args:
        device (`str`, defaults to `"auto"`): `"auto"` or a torch device (`"cpu"`, `"cuda"`, `"cuda:1"`, `"mps"`),
            returned unchanged once checked.

    Raises:
        `ValueError`: a string that is not a torch device, or a device this machine does not have (CUDA or MPS not
            available, a CUDA index past the last GPU).
    """
    if device != AUTO:
        check_device(device)
        return device
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def check_device(device: str) -> None:
    """Raises `ValueError` unless `device` names a torch device this machine has (see `resolve_device`)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {device!r} is not a torch device: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'.") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        built = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"device {device!r} is not available: {built}. Use device 'cpu' or 'auto'.")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} is not available: this machine has {torch.cuda.device_count()} CUDA "
                         "GPU(s), numbered from 0.")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device!r} is not available: MPS needs an Apple GPU. Use 'cpu' or 'auto'.")
    if parsed.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {device!r} is not supported: use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'.")


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype to load in: `"auto"` keeps the checkpoint's dtype (its `config.json`'s `dtype`, e.g. bfloat16) on an
    accelerator and is `"float32"` on a CPU, where half-precision matmuls are slow or emulated; any other name of
    `DTYPES` is returned unchanged.

    Raises:
        `ValueError`: a dtype that is not a key of `DTYPES`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}: choose one of {sorted(DTYPES)}.")
    if dtype == AUTO and torch.device(device).type == "cpu":
        return "float32"
    return dtype


def resolve_model_id(name_or_path: str) -> str:
    """Returns the folder of a demo id from `DEMO_IDS` (and of a file in it, `"hf_speculators/demo-target/NAME"`),
    and any other name or path unchanged."""
    for name, folder in DEMO_IDS.items():
        if name_or_path == name or name_or_path.startswith(name + "/"):
            return folder + name_or_path[len(name):]
    return name_or_path


def looks_local(name_or_path: str) -> bool:
    """Whether `name_or_path` is meant as a local path rather than a Hub id (`name` or `org/name`)."""
    return name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1


def _check_local(name_or_path: str, what: str, needed: tuple[str, ...]) -> None:
    """Raises `FileNotFoundError` for a local-looking path that does not exist, and for a local folder holding none
    of the files `needed` (a folder that is not a model or has no tokenizer); a Hub id passes."""
    path = Path(name_or_path).expanduser()
    if looks_local(name_or_path) and not path.exists():
        raise FileNotFoundError(
            f"{what} path {name_or_path!r} does not exist. Pass an existing folder with config.json and weights, "
            "or a Hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'."
        )
    if path.is_dir() and not any((path / name).is_file() for name in needed):
        raise FileNotFoundError(
            f"{what} folder {name_or_path!r} holds none of {', '.join(needed)}: it is not a saved transformers "
            f"{what.lower()}. Pass the folder that save_pretrained wrote (or a Hub id)."
        )
    if path.exists() and not path.is_dir():
        raise FileNotFoundError(f"{what} path {name_or_path!r} is a file: pass the folder that holds the model.")


@contextmanager
def reading(name_or_path: str, what: str):
    """Within the block, what reading the checkpoint `name_or_path` raises (`UNREADABLE_CHECKPOINT`) becomes an
    `OSError` for a Hub id that cannot be fetched, or a `ValueError` for a local checkpoint whose files cannot be
    read (corrupted, truncated or incomplete), naming it as `what` (e.g. `"Model"`) and saying what to do."""
    try:
        yield
    except UNREADABLE_CHECKPOINT as error:
        reason = " ".join(str(error).split()) or type(error).__name__
        if not Path(name_or_path).expanduser().exists():
            raise OSError(
                f"{what} {name_or_path!r} is not a local folder and cannot be fetched from the Hub ({reason}). Pass "
                "a local folder, or connect to the network (a private repo needs `hf auth login`)."
            ) from error
        raise ValueError(
            f"{what} {name_or_path!r} cannot be read, its files may be corrupted or incomplete "
            f"({type(error).__name__}: {reason}). Save or download it again."
        ) from error


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu", revision: str | None = None,
               quantization: str | None = None):
    """Loads a causal LM in eval mode, quantized if asked, with its weights read straight onto `device`
    (`device_map={"": device}`: no copy is staged in CPU memory, so a model larger than the RAM loads onto a GPU).

    Args:
        name_or_path (`str`): a local folder, a Hub id (downloaded when a network is available), or a demo id
            from `DEMO_IDS` (`"hf_speculators/demo-target"`, `"hf_speculators/demo-draft"`).
        dtype (`str`): one of `DTYPES`: `"float32"`, `"bfloat16"`, `"float16"` or `"auto"`; with `quantization`,
            the dtype of the layers left unquantized and of the activations.
        device (`str`): a torch device, e.g. `"cpu"` or `"cuda"`.
        revision (`str`, *optional*): a Hub branch, tag or commit.
        quantization (`str`, *optional*): `"int8"`, `"nf4"`, `"int4"` or `"fp8"`: the weights are quantized as
            they load (see `hf_speculators.quantization` for the library of each mode).

    Raises:
        `FileNotFoundError`: a local path that does not exist, or a folder without `config.json`.
        `ValueError`: an unknown dtype or device; a quantization that is unknown, cannot run on `device` or does not
            fit the model (checked on its config before any weight is read, see `hf_speculators.quantization`); a
            local checkpoint whose files cannot be read (corrupted or truncated weights, malformed config).
        `ImportError`: the quantization library is not installed.
        `OSError`: a Hub id that cannot be fetched (offline, no such repo, no access).
    """
    if dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}: choose one of {sorted(DTYPES)}.")
    check_device(device)
    config = None if quantization is None else quantization_config(  # refused before any file is read
        quantization, device, DTYPES[dtype] if dtype != "auto" else None)
    name_or_path = resolve_model_id(name_or_path)
    _check_local(name_or_path, "Model", ("config.json",))
    if quantization is not None:
        with reading(name_or_path, "Model"), torch.device("meta"):  # the module structure, for the check
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name_or_path, revision=revision))
        check_quantizable(skeleton, quantization, device)
    with reading(name_or_path, "Model"):
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype], revision=revision,
                                                     quantization_config=config, device_map={"": device})
    return model.eval()


def load_tokenizer(name_or_path: str, revision: str | None = None):
    """Loads the tokenizer stored with a model.

    Args:
        name_or_path (`str`): a local folder, a Hub id or a demo id (as for `load_model`).
        revision (`str`, *optional*): a Hub branch, tag or commit.

    Raises:
        `FileNotFoundError`: a local path that does not exist, or a folder with no tokenizer file
            (`TOKENIZER_FILES`).
        `ValueError`: tokenizer files that cannot be read.
        `OSError`: a Hub id that cannot be fetched.
    """
    name_or_path = resolve_model_id(name_or_path)
    _check_local(name_or_path, "Tokenizer", TOKENIZER_FILES)
    with reading(name_or_path, "Tokenizer"):
        return AutoTokenizer.from_pretrained(name_or_path, revision=revision)
