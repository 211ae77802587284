"""Linear layers through oneDNN with prepacked weights (`use_onednn_linear`): which layers switch, the same products
as torch's `linear` eagerly and compiled, repacking after an in-place change, and speculative decoding on them exact."""

import pytest
import torch
from torch.nn import functional as F

import hf_speculators as hs
from hf_speculators.config import SpeculativeConfig
from hf_speculators.config.build import build_drafter
from hf_speculators.config.methods import LOADED_DRAFT
from hf_speculators.onednn_linear import _PACKED, OneDNNLinear, onednn_available, runs_onednn_linear
from hf_speculators.quantization import quantized_copy
from speculative_helpers import plain_generate, prompt_ids, speculative_generate
from tiny_models import build_noisy_copy, build_target

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")


class Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(16, 40), torch.nn.Linear(40, 16, bias=False)
        self.half = torch.nn.Linear(16, 16).to(torch.bfloat16)
        self.sub = type("Sub", (torch.nn.Linear,), {})(16, 16)  # a subclass (as a quantized or LoRA layer) stays

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def test_switches_plain_float32_linear_layers_only():
    layers = Layers()
    keys = list(layers.state_dict())
    assert hs.use_onednn_linear(layers) == 2 and hs.use_onednn_linear(layers) == 2
    assert [type(m) is OneDNNLinear for m in (layers.up, layers.down, layers.half, layers.sub)] == [1, 1, 0, 0]
    assert runs_onednn_linear(layers) and not runs_onednn_linear(Layers())
    assert list(layers.state_dict()) == keys


@torch.no_grad()
def test_products_match_torch_and_follow_in_place_changes():
    layers, reference = Layers(), Layers()
    hs.use_onednn_linear(layers)
    x = torch.randn(2, 4, 16)
    assert id(layers.up.weight) not in _PACKED
    torch.testing.assert_close(layers(x[:1, :1]), reference(x[:1, :1]))  # one row: torch's linear, nothing packed
    assert id(layers.up.weight) not in _PACKED
    torch.testing.assert_close(layers(x), reference(x), rtol=1e-5, atol=1e-6)
    assert id(layers.up.weight) in _PACKED and id(layers.down.weight) in _PACKED
    layers.down.weight.mul_(2)
    torch.testing.assert_close(layers(x), 2 * reference(x), rtol=1e-5, atol=1e-6)  # repacked, not the stale copy
    key = id(layers.down.weight)
    del layers
    assert key not in _PACKED  # freed with its weight


@torch.no_grad()
def test_layers_cast_since_or_under_autocast_keep_torch_linear():
    layers = Layers()
    hs.use_onednn_linear(layers)
    layers.up.to(torch.float64)  # cast after the switch
    x = torch.randn(4, 16, dtype=torch.float64)
    torch.testing.assert_close(layers.up(x), F.linear(x, layers.up.weight, layers.up.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layers.down(torch.randn(4, 40)).dtype == torch.bfloat16  # autocast's cast, as torch's linear does
    assert id(layers.up.weight) not in _PACKED and id(layers.down.weight) not in _PACKED


def test_gradients_keep_torch_linear():
    layers = Layers()
    hs.use_onednn_linear(layers)
    layers(torch.randn(3, 16)).sum().backward()
    assert layers.up.weight.grad is not None and id(layers.up.weight) not in _PACKED


@torch.no_grad()
def test_compiles_as_one_graph_with_the_same_products():
    layers, reference = Layers(), Layers()
    hs.use_onednn_linear(layers)
    compiled = torch.compile(layers, fullgraph=True)  # inductor: the product stays an operator of its own
    x = torch.randn(4, 16)
    torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-6)
    layers.up.weight.mul_(-1)
    reference.up.weight.mul_(-1)
    torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-6)


def test_quantized_layers_stay():
    """torchao's quantized weights live in `nn.Linear` layers and say float32: they keep their own forward."""
    pytest.importorskip("torchao")
    quantized = quantized_copy(build_target("llama"), "int8")
    assert hs.use_onednn_linear(quantized) == 1
    assert [name for name, m in quantized.named_modules() if isinstance(m, OneDNNLinear)] == ["lm_head"]
    with torch.no_grad():
        assert quantized(prompt_ids("repetitive")).logits.isfinite().all()


def test_draft_model_follows_the_target_and_decoding_stays_exact(fresh_target):
    """A target switched to oneDNN: the drafter built for it switches its draft model too, and speculative greedy
    decoding (multi-row verify forwards through oneDNN) is token for token plain greedy decoding."""
    hs.use_onednn_linear(fresh_target)
    draft = build_noisy_copy("llama")
    config = SpeculativeConfig(method="draft-model", draft_model=LOADED_DRAFT, num_draft_tokens=3)
    drafter = build_drafter(config, fresh_target, draft_model=draft)
    assert runs_onednn_linear(draft)
    ids = prompt_ids("repetitive")
    out = speculative_generate(fresh_target, ids, drafter, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain_generate(fresh_target, ids))
    assert out.speculative_stats.num_accepted_tokens > 0 and id(fresh_target.lm_head.weight) in _PACKED
