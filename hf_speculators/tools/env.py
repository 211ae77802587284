"""`hf-speculators env`: the versions and device facts a bug report needs, as `transformers env` prints them."""

import importlib.metadata
import os
import platform

import torch

# what a run of ours depends on: the core dependencies, then the optional ones (extras, the exports' engines)
CORE_PACKAGES = ("hf_speculators", "torch", "transformers", "accelerate", "huggingface_hub", "tokenizers",
                 "safetensors", "PyYAML", "tqdm")
OPTIONAL_PACKAGES = ("torchao", "bitsandbytes", "datasets", "matplotlib", "mkdocs", "speculators", "vllm")
PROBED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def package_version(name: str) -> str:
    """The installed version of the distribution `name`, or `"not installed"`."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _runs_matmul(device: str, dtype: torch.dtype) -> bool:
    """Whether a small matmul in `dtype` runs on `device` (a probe: some devices lack half-precision kernels)."""
    try:
        ones = torch.ones(4, 4, dtype=dtype, device=device)
        return bool((ones @ ones)[0, 0] == 4)
    except (RuntimeError, TypeError):
        return False


def device_facts() -> dict[str, str]:
    """The device `--device auto` picks (CUDA, then MPS, then the CPU), what it is, and which dtypes run on it."""
    if torch.cuda.is_available():
        device = "cuda"
        major, minor = torch.cuda.get_device_capability(0)
        described = (f"cuda: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} (compute capability "
                     f"{major}.{minor}), CUDA {torch.version.cuda}")
    elif torch.backends.mps.is_available():
        device, described = "mps", "mps (Apple GPU)"
    else:
        device = "cpu"
        described = (f"cpu: {os.cpu_count()} cores ({torch.get_num_threads()} torch threads), "
                     f"{torch.backends.cpu.get_cpu_capability()} kernels")
    dtypes = ", ".join(str(dtype).removeprefix("torch.") for dtype in PROBED_DTYPES if _runs_matmul(device, dtype))
    return {"Device": described, "Dtypes that run there": dtypes}


def environment() -> dict[str, str]:
    """Python, the platform, every package in `CORE_PACKAGES` and `OPTIONAL_PACKAGES` with its version, and the
    device (`device_facts`), in the order printed."""
    facts = {"Python": platform.python_version(), "Platform": platform.platform()}
    facts |= {name: package_version(name) for name in CORE_PACKAGES + OPTIONAL_PACKAGES}
    return facts | device_facts()


def run_env(args) -> int:
    """Prints `environment()` as a Markdown list, ready to paste into a bug report."""
    print("Copy and paste this into your bug report:\n")
    for name, value in environment().items():
        print(f"- {name}: {value}")
    return 0
