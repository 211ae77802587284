"""Shared fixtures: tiny seeded fp32 models (Llama, Qwen2, GPT-NeoX, GPT-2), their drafts and reference outputs."""

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
    """

    def __init__(self):
        self._targets, self._drafts, self._noisy_drafts, self._references = {}, {}, {}, {}

    def target(self, arch: str):
        if arch not in self._targets:
            self._targets[arch] = build_target(arch)
        return self._targets[arch]

    def draft(self, arch: str):
        if arch not in self._drafts:
            self._drafts[arch] = build_draft(arch)
        return self._drafts[arch]

    def noisy_draft(self, arch: str):
        if arch not in self._noisy_drafts:
            self._noisy_drafts[arch] = build_noisy_copy(arch)
        return self._noisy_drafts[arch]

    def reference(self, arch: str, prompt: str, **generate_kwargs) -> torch.LongTensor:
        """`sequences` `(1, length)` of plain greedy `generate` on prompt `prompt` with `generate_kwargs`."""
        key = (arch, prompt, tuple(sorted((k, _hashable(v)) for k, v in generate_kwargs.items())))
        if key not in self._references:
            self._references[key] = plain_generate(self.target(arch), prompt_ids(prompt), **generate_kwargs)
        return self._references[key]


@pytest.fixture(scope="session")
def zoo() -> ModelZoo:
    return ModelZoo()


@pytest.fixture
def fresh_target():
    """A private Llama target (same weights as `zoo.target("llama")`) that a test may `enable` or hook."""
    return build_target("llama")


@pytest.fixture(scope="session")
def tokenizer():
    return build_tokenizer()
