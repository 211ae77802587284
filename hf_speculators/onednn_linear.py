"""Linear layers on the CPU through oneDNN with prepacked weights, for the verify's few-row matrix products.

A speculative step's target forward multiplies `k + 1` rows (times the batch) by every weight matrix. On the CPU,
torch's float32 `linear` is a matrix-vector product for one row and a general matrix product from two rows on,
which at two to eight rows streams the weights less well: the demo target's 57 linear layers took 1.3-1.4x as long
for four rows as for one on an AVX-512 CPU (docs/benchmarks/compiled.md). oneDNN's inner product over a weight
reordered once into its blocked layout took less for four rows than torch's for one there, which is how vLLM's
CPU build runs its linear layers (`onednn_mm` over weights packed at load). torch ships both operations
(`torch.ops.mkldnn._reorder_linear_weight`, `torch.ops.mkldnn._linear_pointwise`, what inductor's weight freezing
uses for half-precision weights; for float32 it packs for MKL instead, which measured no faster here), so this
module only decides when to call them: `use_onednn_linear` switches a model's `torch.nn.Linear` layers over, and a
forward of one row, one that records gradients or runs under autocast, or one whose weight is no longer a float32
parameter on the CPU keeps torch's `linear`.

Under `torch.compile` the product is the custom operator `hf_speculators::onednn_linear`, opaque to inductor; the
packed weight is kept per parameter (weakly, repacked when the parameter is changed in place), not in the graph.
"""

import weakref

import torch
from torch.nn import functional as F

CPU_LINEAR_KERNELS = ("onednn", "torch")  # the command line's --cpu-linear: `use_onednn_linear`, or torch's linear
_PACKED: dict[int, tuple] = {}  # id(weight) -> (weak reference to it, (data pointer, version), packed weight)


def onednn_available() -> bool:
    """Whether this torch build has the oneDNN operations `use_onednn_linear` calls."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _packed(weight: torch.Tensor) -> torch.Tensor:
    """`weight` reordered for oneDNN, packed on first use and again after the parameter changed in place. Kept by
    the weight's id in a plain dict (a weak-keyed one took 1.7 microseconds a lookup against 0.3, 65 lookups a
    forward), with a weak reference that says the entry is this weight's; the entry goes when the weight does."""
    entry = _PACKED.get(id(weight))
    if entry is None or entry[0]() is not weight:
        weakref.finalize(weight, _PACKED.pop, id(weight), None)
        entry = None
    stamp = (weight.data_ptr(), weight._version)
    if entry is None or entry[1] != stamp:
        entry = (weakref.ref(weight), stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 4))
        _PACKED[id(weight)] = entry
    return entry[2]


def packed_linear(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(input, weight, bias)` through oneDNN's inner product over `weight` packed once.

    Args:
        input (`torch.FloatTensor` of shape `(..., in_features)`): on the CPU.
        weight (`torch.FloatTensor` of shape `(out_features, in_features)`): a parameter on the CPU, of `input`'s
            dtype.
        bias (`torch.FloatTensor` of shape `(out_features,)`, *optional*).

    Returns:
        `torch.FloatTensor` of shape `(..., out_features)`.
    """
    return torch.ops.mkldnn._linear_pointwise(input, _packed(weight), bias, "none", [], "")


# the same product as an operator inductor does not look into (it would lower `_linear_pointwise` only over a
# constant weight it packed itself); defined with a plain CPU kernel: `torch.library.custom_op`'s wrapper cost about
# 13 microseconds a call more
torch.library.define("hf_speculators::onednn_linear", "(Tensor input, Tensor weight, Tensor? bias) -> Tensor")
torch.library.impl("hf_speculators::onednn_linear", "cpu", packed_linear)


@torch.library.register_fake("hf_speculators::onednn_linear")
def _(input, weight, bias):
    return input.new_empty(*input.shape[:-1], weight.shape[0])


class OneDNNLinear(torch.nn.Linear):
    """A `torch.nn.Linear` whose forward of two rows or more, without gradients, runs `packed_linear`.

    `use_onednn_linear` turns a model's `nn.Linear` layers into this class in place (their parameters, hooks and
    state dict unchanged); a one-row input (a plain decoding step) keeps torch's `linear`, as does a forward that
    records gradients or runs under autocast, a float32 input's only, and one whose weight is no longer a plain
    float32 parameter on the CPU (the model moved, cast or quantized since).
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = input.numel() // max(input.shape[-1], 1)
        if (rows < 2 or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu") or input.dtype != torch.float32
                or not _plain_float32_cpu(self.weight)):
            return F.linear(input, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return torch.ops.hf_speculators.onednn_linear(input, self.weight, self.bias)
        return packed_linear(input, self.weight, self.bias)  # eagerly, without the dispatcher's round trip


def _plain_float32_cpu(weight) -> bool:
    """A float32 parameter on the CPU holding a plain tensor (torchao's quantized weights are tensor subclasses in
    `nn.Linear` layers that still say float32)."""
    return type(weight) is torch.nn.Parameter and weight.device.type == "cpu" and weight.dtype == torch.float32


def use_onednn_linear(model: torch.nn.Module) -> int:
    """Runs `model`'s float32 `torch.nn.Linear` layers on the CPU through oneDNN with prepacked weights.

    Every module whose type is exactly `torch.nn.Linear` (not a bitsandbytes, LoRA or other subclass) with a
    float32 weight on the CPU (a plain parameter: not torchao's quantized tensors) becomes a `OneDNNLinear` in
    place; each weight is packed on its first multi-row forward. Outputs differ from torch's `linear` by float32
    rounding only (another summation order). Nothing changes where this torch build has no oneDNN, or for layers
    on other devices or of other dtypes. The product is oneDNN's inner product as vLLM's CPU build runs it
    (`onednn_mm` over weights packed at load).

    Args:
        model (`torch.nn.Module`): e.g. a `PreTrainedModel` loaded on the CPU, or a draft model or head.

    Returns:
        `int`: how many layers now run through oneDNN (0 where none qualifies).
    """
    if not onednn_available():
        return 0
    count = 0
    for module in model.modules():
        if type(module) in (torch.nn.Linear, OneDNNLinear) and _plain_float32_cpu(module.weight):
            module.__class__ = OneDNNLinear
            count += 1
    return count


def runs_onednn_linear(model: torch.nn.Module) -> bool:
    """Whether any of `model`'s linear layers runs through oneDNN (`use_onednn_linear` switched it over)."""
    return any(isinstance(module, OneDNNLinear) for module in model.modules())


def with_cpu_linear(model: torch.nn.Module, kernel: str) -> torch.nn.Module:
    """`model`, its linear layers switched by `use_onednn_linear` if `kernel` (one of `CPU_LINEAR_KERNELS`, the
    command line's `--cpu-linear`) is `"onednn"`, left as they are for `"torch"`."""
    if kernel == "onednn":
        use_onednn_linear(model)
    return model


def cpu_linear_kernel(model: torch.nn.Module) -> str:
    """The `CPU_LINEAR_KERNELS` name of what `model`'s linear layers run, as records state it."""
    return "onednn" if runs_onednn_linear(model) else "torch"
