"""Loading target and draft models and tokenizers from a local folder or a Hub id."""

from pathlib import Path

import torch
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
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "auto": "auto"}
AUTO = "auto"  # --device and --dtype default: the best available device; the checkpoint's dtype on an accelerator


def resolve_device(device: str = AUTO) -> str:
    """The device to load onto: `"auto"` is the best available, CUDA, then MPS (Apple GPUs), then the CPU.

    Args:
        device (`str`, defaults to `"auto"`): `"auto"` or a torch device (`"cpu"`, `"cuda"`, `"cuda:1"`, `"mps"`),
            returned unchanged.
    """
    if device != AUTO:
        return device
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


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


def _check_exists(name_or_path: str) -> None:
    """Raises `FileNotFoundError` for a local-looking path that does not exist."""
    if looks_local(name_or_path) and not Path(name_or_path).expanduser().exists():
        raise FileNotFoundError(
            f"Model path {name_or_path!r} does not exist. Pass an existing folder with config.json and weights, "
            "or a Hub id such as 'Qwen/Qwen2.5-0.5B-Instruct'."
        )


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
        `FileNotFoundError`: a local path that does not exist.
        `ValueError`: an unknown dtype; a quantization that is unknown, cannot run on `device` or does not fit the
            model (checked on its config before any weight is read, see `hf_speculators.quantization`).
        `ImportError`: the quantization library is not installed.
        `OSError`: a Hub id that cannot be fetched (from transformers).
    """
    if dtype not in DTYPES:
        raise ValueError(f"Unknown dtype {dtype!r}: choose one of {sorted(DTYPES)}.")
    name_or_path = resolve_model_id(name_or_path)
    _check_exists(name_or_path)
    config = None
    if quantization is not None:
        config = quantization_config(quantization, device, DTYPES[dtype] if dtype != "auto" else None)
        with torch.device("meta"):  # the module structure, without weights, for the check
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name_or_path, revision=revision))
        check_quantizable(skeleton, quantization, device)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype], revision=revision,
                                                 quantization_config=config, device_map={"": device})
    return model.eval()


def load_tokenizer(name_or_path: str, revision: str | None = None):
    """Loads the tokenizer stored with a model (same arguments and errors as `load_model`)."""
    name_or_path = resolve_model_id(name_or_path)
    _check_exists(name_or_path)
    return AutoTokenizer.from_pretrained(name_or_path, revision=revision)
