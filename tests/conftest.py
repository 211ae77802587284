"""Shared fixtures: tiny seeded fp32 models (Llama, Qwen2, GPT-NeoX, GPT-2), their drafts and reference outputs;
the `--device` option (`pytest --device cuda`) that runs `test_device.py` on an accelerator."""

import torch

# Before any model runs: on the 2-core shared test machines more threads make every forward much slower.
torch.set_num_threads(1)

import pytest  # noqa: E402

from speculative_helpers import plain_generate, prompt_ids  # noqa: E402
from tiny_models import build_draft, build_noisy_copy, build_target, build_tokenizer  # noqa: E402


def _hashable(value):
    return tuple(map(_hashable, value)) if isinstance(value, list) else value


class ModelZoo:
    """Builds each tiny model once per session and memoizes plain `generate` reference outputs.

    Tests must not modify these models (no `enable`, no weight changes); `fresh_target` gives a private copy.

    Args:
        device (`str`, *optional*, defaults to `"cpu"`): where the models and the reference outputs live.
    """

    def __init__(self, device: str = "cpu"):
        self.device = torch.device(device)
        self._targets, self._drafts, self._noisy_drafts, self._references = {}, {}, {}, {}

    def target(self, arch: str):
        if arch not in self._targets:
            self._targets[arch] = build_target(arch).to(self.device)
        return self._targets[arch]

    def draft(self, arch: str):
        if arch not in self._drafts:
            self._drafts[arch] = build_draft(arch).to(self.device)
        return self._drafts[arch]

    def noisy_draft(self, arch: str):
        if arch not in self._noisy_drafts:
            self._noisy_drafts[arch] = build_noisy_copy(arch).to(self.device)
        return self._noisy_drafts[arch]

    def reference(self, arch: str, prompt: str, **generate_kwargs) -> torch.LongTensor:
        """`sequences` `(1, length)` of plain greedy `generate` on prompt `prompt` with `generate_kwargs`."""
        key = (arch, prompt, tuple(sorted((k, _hashable(v)) for k, v in generate_kwargs.items())))
        if key not in self._references:
            input_ids = prompt_ids(prompt).to(self.device)
            self._references[key] = plain_generate(self.target(arch), input_ids, **generate_kwargs)
        return self._references[key]


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="where test_device.py runs the exactness core: cpu (default) or an accelerator (cuda)")


def pytest_configure(config):
    name = config.getoption("--device")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {name}: torch {torch.__version__} sees no CUDA device here")


@pytest.fixture(scope="session")
def device(request) -> str:
    """The `--device` option."""
    return request.config.getoption("--device")


@pytest.fixture(scope="session")
def zoo() -> ModelZoo:
    return ModelZoo()


@pytest.fixture(scope="session")
def device_zoo(device) -> ModelZoo:
    """The tiny models on `--device` (the CPU by default, then the same models as `zoo`)."""
    return ModelZoo(device)


@pytest.fixture
def fresh_target():
    """A private Llama target (same weights as `zoo.target("llama")`) that a test may `enable` or hook."""
    return build_target("llama")


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()
