"""Quantized drafts and targets: the mode -> library mapping, its errors, quantized self-drafts, quantized targets
with every drafter and verifier, loading quantized, and the bench and CLI options."""

import json

import pytest
import torch

torch.set_num_threads(1)

from transformers import BitsAndBytesConfig, TorchAoConfig  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

import hf_speculators as hs  # noqa: E402
from hf_speculators.tools import cli  # noqa: E402
from hf_speculators.tools.bench.timing import timed_modules  # noqa: E402
from hf_speculators import quantization as hq  # noqa: E402
from hf_speculators.loading import load_model  # noqa: E402
from hf_speculators.config.methods import make_drafter  # noqa: E402
from speculative_helpers import (  # noqa: E402
    PROMPTS,
    assert_cache_matches_sequence,
    assert_same_tokens,
    cache_kwargs,
    output_cache,
    plain_generate,
    prompt_ids,
    speculative_generate,
)
from tiny_models import ARCHS, build_model, build_tokenizer  # noqa: E402

CPU_MODES = ("int8", "nf4", "int4")
HIDDEN_SIZE = 64  # a multiple of INT4_GROUP_SIZE; the shared tiny models' 48 is not
# torchao converts torch.nn.Linear layers only: GPT-2's Conv1D layers are quantized by bitsandbytes (nf4) only
CASES = [(arch, mode) for arch in ARCHS for mode in CPU_MODES if arch != "gpt2" or mode == "nf4"]
TORCHAO_CASES = [(arch, mode) for arch, mode in CASES if hq.LIBRARIES[mode][0] == "torchao"]
PROMPT = "random"
K = 4


def full_precision(arch: str, hidden_size: int = HIDDEN_SIZE):
    return build_model(arch, hidden_size=hidden_size, num_layers=2, seed=1)


class QuantizedZoo:
    """Builds each full-precision model and quantized copy once per module and memoizes greedy references."""

    def __init__(self):
        self._models, self._references = {}, {}

    def model(self, arch: str, mode: str | None = None):
        """The tiny fp32 model of `arch`, or its quantized copy in `mode`."""
        if (arch, mode) not in self._models:
            full = self.model(arch) if mode is not None else None
            self._models[arch, mode] = full_precision(arch) if mode is None else hq.quantized_copy(full, mode)
        return self._models[arch, mode]

    def reference(self, arch: str, mode: str | None = None) -> torch.LongTensor:
        """Plain greedy `generate` of `model(arch, mode)` on the test prompt."""
        if (arch, mode) not in self._references:
            self._references[arch, mode] = plain_generate(self.model(arch, mode), prompt_ids(PROMPT))
        return self._references[arch, mode]


@pytest.fixture(scope="module")
def quantized_zoo() -> QuantizedZoo:
    return QuantizedZoo()


def quantized_layers(model) -> list[str]:
    """The names of the layers whose weight a quantization library replaced (torchao or bitsandbytes tensors)."""
    weights = {name: getattr(module, "weight", None) for name, module in model.named_modules()}
    return [name for name, weight in weights.items()
            if isinstance(weight, torch.Tensor) and type(weight) is not torch.nn.Parameter]


# ---------------------------------------------------------------- the mapping


def test_each_mode_has_its_librarys_config():
    int8, nf4, int4 = (hq.quantization_config(mode, "cpu", torch.float32) for mode in CPU_MODES)
    assert isinstance(int8, TorchAoConfig) and type(int8.quant_type).__name__ == "Int8WeightOnlyConfig"
    assert isinstance(nf4, BitsAndBytesConfig) and nf4.load_in_4bit and nf4.bnb_4bit_quant_type == "nf4"
    assert nf4.bnb_4bit_compute_dtype == torch.float32
    assert isinstance(int4, TorchAoConfig) and type(int4.quant_type).__name__ == "IntxWeightOnlyConfig"
    assert int4.quant_type.weight_dtype == torch.int4 and int4.quant_type.granularity.group_size == hq.INT4_GROUP_SIZE


@pytest.mark.parametrize(("arch", "mode"), CASES)
def test_quantized_copy_quantizes_the_layers_and_leaves_the_model_alone(quantized_zoo, arch, mode):
    full = quantized_zoo.model(arch)
    before = full(prompt_ids(PROMPT)).logits
    quantized = hq.quantized_copy(full, mode)
    head, layer_type = full.get_output_embeddings(), Conv1D if arch == "gpt2" else torch.nn.Linear
    expected = [name for name, module in full.named_modules() if isinstance(module, layer_type) and module is not head]
    assert quantized_layers(quantized) == expected and expected and quantized_layers(full) == []
    assert type(quantized.get_output_embeddings().weight) is torch.nn.Parameter  # the LM head stays as it is
    # the unquantized tensors are shared, not copied
    assert quantized.get_input_embeddings().weight.data_ptr() == full.get_input_embeddings().weight.data_ptr()
    assert torch.equal(full(prompt_ids(PROMPT)).logits, before)
    assert hq.quantization_settings(quantized)["quant_method"] == hq.LIBRARIES[mode][0]
    assert hq.quantization_settings(full) is None


@pytest.mark.parametrize("mode", CPU_MODES)
def test_loading_quantized_equals_the_in_memory_copy(tmp_path, mode):
    full = full_precision("llama")
    full.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), quantization=mode)
    assert quantized_layers(loaded) and loaded.dtype == torch.float32
    ids = prompt_ids(PROMPT)
    assert torch.equal(loaded(ids).logits, hq.quantized_copy(full, mode)(ids).logits)


# ---------------------------------------------------------------- errors, before any work


def test_an_unknown_mode_is_refused_everywhere(quantized_zoo, tmp_path):
    with pytest.raises(ValueError, match="Unknown quantization 'int3': choose one of int8, nf4, int4, fp8"):
        hs.DraftModelDrafter.from_target(quantized_zoo.model("llama"), "int3")
    with pytest.raises(ValueError, match="Unknown quantization 'int3'"):
        load_model(str(tmp_path), quantization="int3")


def test_fp8_needs_a_recent_cuda_gpu(quantized_zoo, tmp_path, monkeypatch):
    message = r"quantization='fp8' needs a CUDA GPU of compute capability >= 8\.9 .* the model is on cpu"
    with pytest.raises(ValueError, match=message):
        hs.DraftModelDrafter.from_target(quantized_zoo.model("llama"), "fp8")
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path), quantization="fp8")  # refused before the (empty) folder is read
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))  # an A100
    with pytest.raises(ValueError, match="the model is on cuda"):
        hq.check_quantization("fp8", "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))  # an H100
    assert isinstance(hq.quantization_config("fp8", "cuda", torch.bfloat16), TorchAoConfig)
    with pytest.raises(ValueError, match="needs bfloat16 weights; the model is asked in torch.float32"):
        hq.quantization_config("fp8", "cuda", torch.float32)


@pytest.mark.parametrize(("mode", "library"), [("int8", "torchao"), ("nf4", "bitsandbytes"), ("nf4", "accelerate")])
def test_a_missing_library_names_the_extra(quantized_zoo, monkeypatch, mode, library):
    find_spec = hq.importlib.util.find_spec
    monkeypatch.setattr(hq.importlib.util, "find_spec", lambda name: None if name == library else find_spec(name))
    with pytest.raises(ImportError, match=rf"needs {library} \(not installed here\): pip install "
                                          r'"hf_speculators\[quantization\]"'):
        hs.DraftModelDrafter.from_target(quantized_zoo.model("llama"), mode)


def test_a_quantized_model_is_not_quantized_again(quantized_zoo):
    with pytest.raises(ValueError, match="LlamaForCausalLM is quantized already .* needs a model in full precision"):
        hs.DraftModelDrafter.from_target(quantized_zoo.model("llama", "int8"), "int4")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_torchao_refuses_a_model_without_linear_layers(quantized_zoo, mode):
    with pytest.raises(ValueError, match=rf"quantization='{mode}' \(torchao\) would leave GPT2LMHeadModel "
                                         "unquantized: it converts Linear layers.* Use 'nf4'"):
        hs.DraftModelDrafter.from_target(quantized_zoo.model("gpt2"), mode)


def test_int4_needs_input_sizes_in_whole_groups(tmp_path):
    model = full_precision("llama", hidden_size=48)
    message = (r"quantization='int4' needs layers with input sizes that are multiples of 32 "
               r"\(torchao quantizes groups of 32 input features\); these layers of LlamaForCausalLM are not: "
               r"model\.layers\.0\.self_attn\.q_proj, .* Use 'int8' or 'nf4'")
    with pytest.raises(ValueError, match=message):
        hq.quantized_copy(model, "int4")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path), quantization="int4")
    assert quantized_layers(hq.quantized_copy(model, "int8"))  # int8 takes any size


def test_nf4_on_a_cpu_needs_sizes_that_bitsandbytes_cpu_kernel_takes():
    model = full_precision("llama", hidden_size=32)  # inputs of 32: bitsandbytes' CPU kernel packs blocks of 64
    message = (r"quantization='nf4' needs layers with input sizes that are multiples of 64 and output sizes of 32 "
               r"\(bitsandbytes' CPU kernel .*Use 'int8' or 'int4'")
    with pytest.raises(ValueError, match=message):
        hq.quantized_copy(model, "nf4")
    hq.check_quantizable(model, "nf4", "cuda")  # not on a GPU


def test_drafter_arguments_are_checked_before_the_copy(quantized_zoo, monkeypatch):
    def no_copy(model, quantization):
        raise AssertionError("quantized before the drafter's arguments were checked")

    monkeypatch.setattr(hs.drafters.draft_model, "quantized_copy", no_copy)
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1, got 0"):
        hs.DraftModelDrafter.from_target(quantized_zoo.model("llama"), "int8", num_draft_tokens=0)
    with pytest.raises(ValueError, match="DynamicTree depth must be an integer >= 1"):
        hs.TreeDrafter.from_target(quantized_zoo.model("llama"), "int8", tree={"depth": 0})


# ---------------------------------------------------------------- exactness


@pytest.mark.parametrize(("arch", "mode"), CASES)
def test_quantized_self_draft_reproduces_full_precision_greedy(quantized_zoo, arch, mode):
    drafter = hs.DraftModelDrafter.from_target(quantized_zoo.model(arch), mode, num_draft_tokens=K)
    assert quantized_layers(drafter.draft_model) and drafter.num_draft_tokens == K
    out = speculative_generate(quantized_zoo.model(arch), prompt_ids(PROMPT), drafter, return_dict_in_generate=True,
                               plain_floor=False)  # every step drafts: the floor could stop a slow start's drafts
    assert_same_tokens(out.sequences, quantized_zoo.reference(arch))
    assert_cache_matches_sequence(out)
    assert out.speculative_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("mode", CPU_MODES)
def test_a_quantized_self_draft_tree(quantized_zoo, mode):
    tree = hs.DynamicTree(depth=K, top_k=2, num_nodes=6)
    drafter = hs.TreeDrafter.from_target(quantized_zoo.model("qwen2"), mode, tree=tree)
    assert quantized_layers(drafter.draft_model) and drafter.tree is tree
    out = speculative_generate(quantized_zoo.model("qwen2"), prompt_ids(PROMPT), drafter)
    assert_same_tokens(out, quantized_zoo.reference("qwen2"))


def drafter_for_quantized_target(kind: str, quantized_zoo, arch: str) -> hs.Drafter:
    """A drafter for `model(arch, mode)`; the draft models are the full-precision model it was quantized from."""
    if kind == "prompt_lookup":
        return hs.PromptLookupDrafter(num_draft_tokens=K)
    if kind == "prompt_lookup_tree":
        return hs.PromptLookupDrafter(num_draft_tokens=K, num_candidates=3)
    if kind == "draft_model":
        return hs.DraftModelDrafter(quantized_zoo.model(arch), num_draft_tokens=K)
    return hs.TreeDrafter(quantized_zoo.model(arch), hs.DynamicTree(depth=K, top_k=2, num_nodes=6))


@pytest.mark.parametrize("kind", ["prompt_lookup", "prompt_lookup_tree", "draft_model", "tree"])
@pytest.mark.parametrize(("arch", "mode"), CASES)
def test_a_quantized_target_reproduces_its_own_greedy_output(quantized_zoo, arch, mode, kind):
    target = quantized_zoo.model(arch, mode)
    drafter = drafter_for_quantized_target(kind, quantized_zoo, arch)
    # without the plain-speed floor, whose clock-based plain steps could leave no draft to reject
    out = speculative_generate(target, prompt_ids(PROMPT), drafter, return_dict_in_generate=True, plain_floor=False)
    assert_same_tokens(out.sequences, quantized_zoo.reference(arch, mode))
    assert_cache_matches_sequence(out)
    stats = out.speculative_stats
    assert stats.num_drafted_tokens > stats.num_accepted_tokens  # some draft tokens were rejected and rolled back


@pytest.mark.parametrize(("arch", "mode"), [case for case in CASES if case[0] != "gpt2"])
def test_a_quantized_target_with_a_quantized_draft(quantized_zoo, arch, mode):
    """A separate quantized draft: a copy of the same model in another mode drafts for the quantized target."""
    other = "int8" if mode != "int8" else "nf4"
    drafter = hs.DraftModelDrafter(quantized_zoo.model(arch, other), num_draft_tokens=K)
    out = speculative_generate(quantized_zoo.model(arch, mode), prompt_ids(PROMPT), drafter)
    assert_same_tokens(out, quantized_zoo.reference(arch, mode))


@pytest.mark.parametrize(("arch", "mode"), CASES)
def test_a_multi_token_forward_gives_the_one_token_argmaxes(quantized_zoo, arch, mode):
    """What the exactness rests on: verifying k+1 tokens in one forward picks the argmax that k+1 one-token
    forwards pick. torchao's modes keep activations in float32 and differ by float32 rounding only."""
    model, ids = quantized_zoo.model(arch, mode), torch.tensor([list(PROMPTS["random"]) * 3])
    with torch.no_grad():
        cache = output_cache(model(ids[:, :18]))
        multi = model(ids[:, 18:], position_ids=torch.arange(18, 24)[None], **cache_kwargs(model, cache)).logits[0]
        cache.crop(-6)
        single = torch.cat([model(ids[:, [i]], position_ids=torch.tensor([[i]]), **cache_kwargs(model, cache)).logits[0]
                            for i in range(18, 24)])
    assert torch.equal(multi.argmax(-1), single.argmax(-1))
    if hq.LIBRARIES[mode][0] == "torchao":
        torch.testing.assert_close(multi, single, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["draft_model", "tree"])
@pytest.mark.parametrize("mode", CPU_MODES)
def test_rejection_sampling_runs_on_a_quantized_target(quantized_zoo, mode, kind):
    target = quantized_zoo.model("qwen2", mode)
    drafter = drafter_for_quantized_target(kind, quantized_zoo, "qwen2")
    out = speculative_generate(target, prompt_ids(PROMPT), drafter, do_sample=True, return_dict_in_generate=True,
                               generator=torch.Generator().manual_seed(0), max_new_tokens=16)
    assert out.sequences.shape[1] == len(PROMPTS[PROMPT]) + 16 and out.speculative_stats.lossless
    assert_cache_matches_sequence(out)


@pytest.mark.parametrize("mode", CPU_MODES)
def test_rejection_sampling_runs_with_a_quantized_self_draft(quantized_zoo, mode):
    target = quantized_zoo.model("llama")
    drafter = hs.DraftModelDrafter.from_target(target, mode, num_draft_tokens=K)
    out = speculative_generate(target, prompt_ids(PROMPT), drafter, do_sample=True, return_dict_in_generate=True,
                               generator=torch.Generator().manual_seed(0), max_new_tokens=16)
    assert out.speculative_stats.verifier == "rejection" and out.speculative_stats.lossless
    assert out.speculative_stats.num_accepted_tokens > 0 and out.sequences.shape[1] == len(PROMPTS[PROMPT]) + 16


# ---------------------------------------------------------------- methods, bench and command line


def test_self_draft_methods_need_the_target(quantized_zoo):
    with pytest.raises(ValueError, match="drafts with a quantized copy of the target: pass the target model"):
        make_drafter("self-draft-int8")
    drafter = make_drafter("self-draft-int4", target=quantized_zoo.model("llama"), num_draft_tokens=3)
    assert isinstance(drafter, hs.DraftModelDrafter) and drafter.num_draft_tokens == 3
    assert hq.quantization_settings(drafter.draft_model)["quant_type"]["default"]["_type"] == "IntxWeightOnlyConfig"


def test_a_config_without_draft_model_drafts_with_a_quantized_copy_of_the_target(quantized_zoo):
    config = hs.SpeculativeConfig(method="draft-model", draft_quantization="int8", num_draft_tokens=2)
    assert config.is_self_draft and config.to_dict() == {"method": "draft-model", "num_draft_tokens": 2,
                                                         "draft_quantization": "int8"}
    drafter, _ = config.build(quantized_zoo.model("llama"))
    assert isinstance(drafter, hs.DraftModelDrafter) and drafter.num_draft_tokens == 2
    assert drafter.draft_model is not quantized_zoo.model("llama")
    assert hq.quantization_settings(drafter.draft_model)["quant_type"]["default"]["_type"] == "Int8WeightOnlyConfig"


def test_bench_times_the_draft_model_each_method_runs(quantized_zoo):
    self_draft = make_drafter("self-draft-int8", target=quantized_zoo.model("llama"))
    target = assistant = quantized_zoo.model("llama")
    assert timed_modules(target, {"candidate_generator": self_draft}) == [target, self_draft.draft_model]
    assert timed_modules(target, {"assistant_model": assistant}) == [target, assistant]
    assert timed_modules(target, {"candidate_generator": hs.PromptLookupDrafter()}) == [target]
    assert timed_modules(target, {}) == [target]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama target saved with the character-level tokenizer, and a prompts file."""
    root = tmp_path_factory.mktemp("quantized")
    full_precision("llama").save_pretrained(root / "model")
    build_tokenizer().save_pretrained(root / "model")
    (root / "prompts.txt").write_text("abcabcabc\nhello hello\n")
    return root


def bench_command(model_dir, *options) -> list[str]:
    return ["bench", "--prompts", str(model_dir / "prompts.txt"), "--model", str(model_dir / "model"),
            "--draft", str(model_dir / "model"), "--max-new-tokens", "8", "--num-draft-tokens", "3",
            "--out", str(model_dir / "bench.jsonl"), *options]


def test_cli_bench_self_draft_methods(model_dir, capsys):
    methods = ",".join(f"self-draft-{mode}" for mode in CPU_MODES)
    assert cli.main(bench_command(model_dir, "--methods", methods)) == 0
    records = [json.loads(line) for line in open(model_dir / "bench.jsonl")]
    assert {r["method"] for r in records} == {"plain", *methods.split(",")}
    assert all(r["identical_to_plain"] and r["exact"] for r in records)
    assert all(r["acceptance_rate"] > 0 for r in records if r["method"] != "plain")
    assert records[0]["provenance"]["target_quantization"] is None
    assert "self-draft-nf4" in capsys.readouterr().out


def test_cli_bench_quantized_target_and_draft(model_dir):
    options = ("--methods", "draft-model,draft-model-tree", "--quantization", "int8", "--draft-quantization", "nf4")
    assert cli.main(bench_command(model_dir, *options)) == 0
    records = [json.loads(line) for line in open(model_dir / "bench.jsonl")]
    assert all(r["identical_to_plain"] for r in records)
    provenance = records[0]["provenance"]
    assert provenance["target_quantization"]["quant_method"] == "torchao"
    assert provenance["draft_quantization"]["bnb_4bit_quant_type"] == "nf4"


def test_cli_bench_errors(model_dir, capsys):
    assert cli.main(bench_command(model_dir, "--methods", "prompt-lookup", "--draft-quantization", "int8")) == 2
    assert "--draft-quantization quantizes the draft model, and no method chosen uses one" in capsys.readouterr().err
    assert cli.main(bench_command(model_dir, "--methods", "self-draft-fp8")) == 2
    assert "needs a CUDA GPU of compute capability >= 8.9" in capsys.readouterr().err
    assert cli.main(bench_command(model_dir, "--methods", "self-draft-int8", "--quantization", "int8")) == 2
    assert "is quantized already" in capsys.readouterr().err


def test_cli_generate_quantized_target_and_draft(model_dir, capsys):
    model = str(model_dir / "model")
    command = ["generate", "abcabc", "--model", model, "--draft", model, "--method", "draft-model",
               "--quantization", "nf4", "--draft-quantization", "int4", "--max-new-tokens", "8", "--threads", "1"]
    assert cli.main(command) == 0
    assert "identical to plain greedy: yes" in capsys.readouterr().out
