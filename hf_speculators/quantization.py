"""Quantization modes by name: which library quantizes each, through which transformers quantization config.

This module has one job: turn `"int8"`, `"nf4"`, `"int4"` or `"fp8"` into a transformers quantization config,
after checking that the mode can run on the device and that its library is installed, and make a quantized copy
of a loaded model with it. The quantization itself is done by the libraries, called by transformers'
`from_pretrained`; there is no quantization code here. As transformers does by default, the output embeddings
(the LM head) stay unquantized.

- `"int8"`: torchao, `TorchAoConfig(Int8WeightOnlyConfig())`: int8 weights with one scale per output row;
  activations in the model's dtype.
- `"nf4"`: bitsandbytes, `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
  bnb_4bit_compute_dtype=<the model's dtype>)`: 4-bit NormalFloat weights (QLoRA, Dettmers et al. 2023) in
  blocks of 64, two per byte. On CPUs with AVX512-BF16 bitsandbytes computes in bf16 whatever the compute dtype.
- `"int4"`: torchao, `TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))`:
  int4 weights with one scale per 32 inputs; activations in the model's dtype. torchao's CPU layout keeps one
  int4 value per byte, so on a CPU this mode saves no memory over `"int8"` (and is slower).
- `"fp8"`: torchao, `TorchAoConfig(Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))`: float8
  (e4m3) weights with one scale per output row and activations with one scale per token, on CUDA GPUs of compute
  capability >= 8.9 only, in bfloat16 (torchao's per-row float8 takes bfloat16 weights). Per token, not per tensor
  (torchao's default): a per-tensor activation scale is taken over every token of the forward, so a verify
  forward's logits depended on the draft tokens beside them and greedy speculative output differed from the same
  fp8 model's plain output on 6 of 8 prompts (H200, demo target, 64 new tokens; none were near-ties).

Why these libraries: each mode uses the library that runs it on a CPU and, among those, was fastest for a
one-token forward of the demo target (15.7M parameters, 100-token context, one thread; fp32: 5.95 ms):

- int8: torchao 4.8 ms, optimum-quanto 8.6 ms, bitsandbytes (LLM.int8(), Dettmers et al. 2022) 13.1 ms.
- nf4: bitsandbytes, 4.0 ms (NF4 is bitsandbytes' data type).
- int4: torchao 9.2 ms, optimum-quanto 11.8 ms (quanto packs two values per byte, 6.2 MiB less on the demo
  target). No x86 CPU kernel of either multiplies int4 weights directly: both dequantize first.
- fp8: optimum-quanto's float8 runs on a CPU but emulated (47 ms, 8x fp32), so fp8 is refused off a GPU of
  compute capability >= 8.9, where torchao's float8 matmuls are fast.

Precision of the speculative check (greedy speculative output equals the same quantized model's greedy output
when a (k+1)-token forward gives the same argmax as k+1 one-token forwards): torchao's int8 and int4 keep
activations in the model's dtype, so the two differ by the same float rounding as an unquantized model (1.7e-5
on the demo target's logits in fp32, 1.5e-5 unquantized). bitsandbytes' 4-bit CPU kernel computes each row
independently but in bf16, which magnifies those rounding differences (up to 2.6e-2 on the demo target's
logits): greedy outputs can then differ where the top two logits are closer than that (none of 380 positions
on the demo target did). bitsandbytes' LLM.int8() (not used here) also picks its outlier columns over the
whole batch, so its result for one token depends on the others: 4 of 391 argmaxes differed on the demo target.
"""

import copy
import importlib.util

import torch
from transformers import BitsAndBytesConfig, TorchAoConfig
from transformers.pytorch_utils import Conv1D

QUANTIZATIONS = ("int8", "nf4", "int4", "fp8")
# mode -> the modules it imports (transformers needs accelerate to load bitsandbytes models)
LIBRARIES = {"int8": ("torchao",), "nf4": ("bitsandbytes", "accelerate"), "int4": ("torchao",), "fp8": ("torchao",)}
INT4_GROUP_SIZE = 32  # input features per int4 scale (gpt-fast uses 32 to 256)
# mode -> (devices, input and output sizes each quantized layer needs multiples of, why)
LAYER_MULTIPLES = {
    "int4": (("cpu", "cuda"), INT4_GROUP_SIZE, 1, f"torchao quantizes groups of {INT4_GROUP_SIZE} input features"),
    "nf4": (("cpu",), 64, 32, "bitsandbytes' CPU kernel takes blocks of 64 inputs and tiles of 32 outputs"),
}
FP8_MIN_CAPABILITY = (8, 9)  # CUDA compute capability of the first GPUs with float8 tensor cores (Ada, Hopper)
INSTALL_HINT = 'pip install "hf_speculators[quantization]"'


def check_quantization(quantization: str, device: str | torch.device = "cpu") -> None:
    """Raises unless `quantization` names a mode that can run on `device` with its library installed.

    Raises:
        `ValueError`: an unknown mode, or `"fp8"` on anything but a CUDA GPU of compute capability >= 8.9.
        `ImportError`: the mode's library is not installed (naming the extra that installs it).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"Unknown quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}.")
    device = torch.device(device)
    if quantization == "fp8" and not _has_float8_gpu(device):
        raise ValueError(
            f"quantization='fp8' needs a CUDA GPU of compute capability >= {FP8_MIN_CAPABILITY[0]}."
            f"{FP8_MIN_CAPABILITY[1]} (Ada, Hopper or newer), where torchao's float8 matmuls run; the model is on "
            f"{device}. Use a GPU that has them, or 'int8', 'nf4' or 'int4', which also run on a CPU."
        )
    missing = [name for name in LIBRARIES[quantization] if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"quantization={quantization!r} needs {' and '.join(missing)} (not installed here): {INSTALL_HINT}"
        )


def _has_float8_gpu(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY)


def quantization_config(quantization: str, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """The transformers quantization config of a mode (see the module docstring for what each mode is).

    Args:
        quantization (`str`): one of `QUANTIZATIONS`: `"int8"`, `"nf4"`, `"int4"` or `"fp8"`.
        device (`str` or `torch.device`, defaults to `"cpu"`): where the quantized model will run.
        dtype (`torch.dtype`, *optional*): the model's dtype: `"nf4"`'s compute dtype (default float32); `"fp8"`
            needs `torch.bfloat16` (or `None`: the checkpoint's own dtype, checked by torchao).

    Returns:
        `BitsAndBytesConfig` (`"nf4"`) or `TorchAoConfig` (the others), for `from_pretrained(quantization_config=)`.

    Raises:
        `ValueError`: `"fp8"` with a `dtype` other than bfloat16; see also `check_quantization`.
        `ImportError`: see `check_quantization`.
    """
    check_quantization(quantization, device)
    if quantization == "fp8" and dtype not in (None, torch.bfloat16):
        raise ValueError(f"quantization='fp8' scales activations per token (torchao's PerRow), which needs bfloat16 "
                         f"weights; the model is asked in {dtype}. Load it with dtype='bfloat16' (--dtype bfloat16).")
    if quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Int8WeightOnlyConfig,
        IntxWeightOnlyConfig,
        PerGroup,
        PerRow,
    )

    if quantization == "int8":
        return TorchAoConfig(Int8WeightOnlyConfig())
    if quantization == "int4":
        return TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(INT4_GROUP_SIZE)))
    return TorchAoConfig(Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))


def check_quantizable(model, quantization: str, device: str | torch.device = "cpu") -> None:
    """Raises `ValueError` unless `model`'s layers can be quantized in mode `quantization` to run on `device`.

    `model` may be a skeleton on the meta device: only its config and module structure are read.

    Raises:
        `ValueError`: the model is quantized already; it has no layer the mode's library converts (torchao converts
            `torch.nn.Linear` layers, bitsandbytes also GPT-2's `Conv1D`; the LM head is left as it is); or a
            layer's sizes are not multiples of what the mode needs (`LAYER_MULTIPLES`: `"int4"`, 32 inputs;
            `"nf4"` on a CPU, 64 inputs and 32 outputs).
    """
    name = type(model).__name__
    if getattr(model.config, "quantization_config", None) is not None:
        raise ValueError(
            f"{name} is quantized already (its config has a quantization_config); quantization={quantization!r} "
            "needs a model in full precision (float32, bfloat16 or float16)."
        )
    library = LIBRARIES[quantization][0]
    layer_types = (torch.nn.Linear, Conv1D) if library == "bitsandbytes" else (torch.nn.Linear,)
    head = model.get_output_embeddings()
    layers = {n: m for n, m in model.named_modules() if isinstance(m, layer_types) and m is not head}
    if not layers:
        raise ValueError(
            f"quantization={quantization!r} ({library}) would leave {name} unquantized: it converts "
            f"{' and '.join(t.__name__ for t in layer_types)} layers, and {name} has none besides its LM head. "
            "Use 'nf4' (bitsandbytes also converts GPT-2's Conv1D layers) or no quantization."
        )
    _check_sizes(name, layers, quantization, torch.device(device))


def _check_sizes(name: str, layers: dict, quantization: str, device: torch.device) -> None:
    """Raises `ValueError` when a layer's sizes are not multiples of what `LAYER_MULTIPLES` asks on `device`."""
    devices, inputs, outputs, why = LAYER_MULTIPLES.get(quantization, ((), 1, 1, ""))
    uneven = [n for n, m in layers.items() if _sizes(m)[0] % inputs or _sizes(m)[1] % outputs]
    if device.type in devices and uneven:
        others = [mode for mode in ("int8", "nf4", "int4") if mode != quantization]
        sizes = f"input sizes that are multiples of {inputs}" + (f" and output sizes of {outputs}" * (outputs > 1))
        raise ValueError(
            f"quantization={quantization!r} needs layers with {sizes} ({why}); these layers of {name} are not: "
            f"{', '.join(uneven[:4])}{' ...' if len(uneven) > 4 else ''}. Use {' or '.join(map(repr, others))}."
        )


def _sizes(layer) -> tuple[int, int]:
    """`(input features, output features)` of a `torch.nn.Linear` or a GPT-2 `Conv1D` layer."""
    return (layer.nx, layer.nf) if isinstance(layer, Conv1D) else (layer.in_features, layer.out_features)


def quantized_copy(model, quantization: str):
    """A quantized copy of a loaded full-precision causal LM, in eval mode, on the model's device and in its dtype.

    Built in memory: transformers' `from_pretrained(None, config=..., state_dict=model.state_dict(),
    quantization_config=...)` quantizes the model's own tensors as it would a checkpoint's, with no Hub round trip
    and no copy on disk. The tensors that stay unquantized (embeddings, norms, the LM head) are shared with
    `model`, not copied, so the copy adds only its quantized layers to memory; `model` is left unchanged.

    Args:
        model (`PreTrainedModel`): a causal LM in full precision.
        quantization (`str`): one of `QUANTIZATIONS`.

    Raises:
        `ValueError`, `ImportError`: before any work, see `check_quantization` and `check_quantizable`.
    """
    config = quantization_config(quantization, model.device, model.dtype)
    check_quantizable(model, quantization, model.device)
    quantized = type(model).from_pretrained(
        None, config=copy.deepcopy(model.config), state_dict=model.state_dict(), quantization_config=config,
        dtype=model.dtype, device_map={"": model.device},
    )
    return quantized.eval()


def quantization_settings(model) -> dict | None:
    """The quantization config of a loaded model as a dict (`None` when it is not quantized), for records."""
    config = getattr(model.config, "quantization_config", None)
    return None if config is None else config.to_dict()
