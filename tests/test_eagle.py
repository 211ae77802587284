"""EAGLE heads (EAGLE-3, EAGLE-1/2) from every checkpoint format: exact greedy output, first draft tokens equal to a
reference forward of the format's definition, lossless sampling with a reduced draft vocabulary, format detection,
the speculators round trip, and every error."""

import copy
import json
from pathlib import Path

import pytest
import torch
from eagle_heads import (
    AUX_LAYER_IDS,
    fit_lm_head,
    random_eagle,
    random_eagle3,
    reference_draft_ids,
    save_in_format,
)
from speculative_helpers import assert_same_tokens, output_cache, plain_generate, prompt_ids, speculative_generate
from tiny_models import VOCAB_SIZE, build_model
from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, StaticCache, StoppingCriteriaList
from transformers import TemperatureLogitsWarper, TopKLogitsWarper

import hf_speculators as hs
from hf_speculators.compiled import run_draft_head, run_draft_head_step
from hf_speculators.drafters.base import TargetNeeds
from hf_speculators.drafters.eagle import EagleDrafter
from hf_speculators.heads.eagle_formats import EAGLE_FORMATS, detect_eagle_format, load_eagle_head, save_eagle3_head
from hf_speculators.loading import DEMO_DIR, DEMO_TARGET, load_model, load_tokenizer
from hf_speculators.config.speculators_format import speculators_settings
from test_compiled import compile_config, frame_graphs, fresh_dynamo, unique_graphs
from test_lossless import chi_square, chi_square_critical

ARCHS = ("llama", "qwen2", "qwen3")
# one head per (format, target family), varying the options each format has
HEADS = {
    "speculators-eagle3": {
        "llama": lambda: random_eagle3(1, draft_vocab_size=64, norm_before_fc=True, norm_output=True, num_layers=2),
        "qwen2": lambda: random_eagle3(2, norm_before_residual=True, own_embeddings=True),
        "qwen3": lambda: random_eagle3(3, draft_vocab_size=48, model_type="qwen3", fc_norm=True),
    },
    "safeailab-eagle3": {arch: (lambda seed=seed: random_eagle3(seed, draft_vocab_size=64, rope_theta=None))
                         for seed, arch in enumerate(ARCHS, 4)},
    "safeailab-eagle": {
        "llama": lambda: random_eagle(7, fc_bias=True),
        "qwen2": lambda: random_eagle(8, fc_bias=False, qkv_bias=True),
        "qwen3": lambda: random_eagle(9, fc_bias=False),
    },
    "speculators-eagle": {arch: (lambda seed=seed: random_eagle(seed, fc_bias=seed % 2 == 0))
                          for seed, arch in enumerate(ARCHS, 10)},
}
STATIC_PATHS = [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


@pytest.fixture(scope="module")
def targets():
    """4-layer fp32 targets (the test heads read the inputs of layers 0, 2 and 3)."""
    return {arch: build_model(arch, num_layers=4, seed=1) for arch in ARCHS}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folders = {}

    def folder(arch: str, fmt: str):
        if (arch, fmt) not in folders:
            folders[arch, fmt] = save_in_format(HEADS[fmt][arch](), tmp_path_factory.mktemp(fmt), fmt)
        return folders[arch, fmt]

    return folder


class RecordingEagle(EagleDrafter):
    """Keeps the first draft token of each step, by committed length (one sequence)."""

    def propose(self, state, input_ids, max_tokens, rows):
        drafts = super().propose(state, input_ids, max_tokens, rows)
        for ids, draft in zip(input_ids, drafts):
            if draft.num_nodes:
                self.first_tokens[ids.shape[1]] = int(draft.token_ids[0])
        return drafts


def run(target, folder, prompt="random", generate_kwargs=None, **drafter_kwargs):
    drafter = RecordingEagle.from_pretrained(str(folder), **drafter_kwargs)
    drafter.first_tokens = {}
    out = speculative_generate(target, prompt_ids(prompt), drafter, return_dict_in_generate=True,
                               plain_floor=False,  # every step drafts: the floor reads the clock
                               **generate_kwargs or {})
    return out, drafter


def check_first_drafts(drafter, folder, fmt, target, sequences):
    """The first draft token at committed length n is the reference head's guess after the pair (f_{n-2}, x_{n-1})."""
    expected = reference_draft_ids(folder, fmt, target, sequences)
    assert len(drafter.first_tokens) > 5
    assert drafter.first_tokens == {n: expected[n - 2] for n in drafter.first_tokens}


@pytest.mark.parametrize("shape", ["chain-1", "chain-3", "chain-5", "tree"])
@pytest.mark.parametrize("fmt", EAGLE_FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_output_is_the_targets_and_first_drafts_follow_the_format(targets, saved, arch, fmt, shape):
    target, folder = targets[arch], saved(arch, fmt)
    if shape == "tree":  # EAGLE-2's dynamic tree for EAGLE-3 heads, a static tree for EAGLE-1/2 heads
        tree = hs.DynamicTree(depth=3, top_k=2, num_nodes=6) if fmt.endswith("eagle3") else STATIC_PATHS
        out, drafter = run(target, folder, tree=tree)
    else:
        out, drafter = run(target, folder, num_draft_tokens=int(shape.split("-")[1]))
    assert_same_tokens(out.sequences, plain_generate(target, prompt_ids("random")))
    check_first_drafts(drafter, folder, fmt, target, out.sequences)


def test_default_feature_layers_are_2_half_and_minus_3_in_that_order(targets, tmp_path):
    """On 4 layers the default ids [2, 2, 1] are not ascending: the features must still come in their order."""
    target = targets["llama"]
    folder = save_in_format(random_eagle3(20, aux_layer_ids=None), tmp_path, "speculators-eagle3")
    assert json.loads((folder / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] is None
    out, drafter = run(target, folder, num_draft_tokens=3)
    assert drafter.target_needs(target) == TargetNeeds(layer_ids=(2, 2, 1), final_norm=False)
    assert_same_tokens(out.sequences, plain_generate(target, prompt_ids("random")))
    check_first_drafts(drafter, folder, "speculators-eagle3", target, out.sequences)


@pytest.fixture(scope="module")
def fitted(targets, tmp_path_factory):
    """A head whose first draft token is often right on the test prompts: accepted and rejected drafts occur."""
    target = targets["llama"]
    sequences = [plain_generate(target, prompt_ids(prompt)) for prompt in ("random", "repetitive")]
    head = fit_lm_head(random_eagle3(30, draft_vocab_size=64), target, sequences)
    return save_in_format(head, tmp_path_factory.mktemp("fitted"), "speculators-eagle3")


@pytest.mark.parametrize("tree", [None, hs.DynamicTree(depth=3, top_k=2, num_nodes=6), STATIC_PATHS])
@pytest.mark.parametrize("prompt", ["random", "repetitive"])
def test_a_partly_right_head_is_accepted_and_stays_exact(targets, fitted, prompt, tree):
    out, drafter = run(targets["llama"], fitted, prompt, num_draft_tokens=3, tree=tree)
    assert_same_tokens(out.sequences, plain_generate(targets["llama"], prompt_ids(prompt)))
    stats = out.speculative_stats
    assert 0 < stats.num_accepted_tokens < stats.num_drafted_tokens
    check_first_drafts(drafter, fitted, "speculators-eagle3", targets["llama"], out.sequences)


def test_a_one_token_prompt_drafts_from_the_second_step(targets, fitted):
    out, drafter = run(targets["llama"], fitted, "one_token", num_draft_tokens=3)
    assert_same_tokens(out.sequences, plain_generate(targets["llama"], prompt_ids("one_token")))
    assert min(drafter.first_tokens) == 2


@pytest.mark.parametrize("tree", [None, hs.DynamicTree(depth=2, top_k=2, num_nodes=4)], ids=["chain", "tree"])
def test_sampling_with_a_reduced_draft_vocabulary_is_lossless(targets, fitted, tree):
    """First two tokens of `hs.generate` under temperature and top-k: distributed as the target's, though the draft
    vocabulary (64 of 96 ids) misses part of the target's support."""
    model, prompt = targets["llama"], prompt_ids("random")
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(3)])

    def target_distribution(input_ids):
        return torch.softmax(warpers(input_ids, model(input_ids).logits[:, -1].float()), dim=-1)[0]

    drafter = EagleDrafter.from_pretrained(str(fitted), num_draft_tokens=2, tree=tree)
    draft_vocab = set((torch.arange(64) + drafter.head.d2t).tolist())
    with torch.no_grad():
        first = target_distribution(prompt)
        support = first.nonzero().flatten().tolist()
        joint = torch.stack([first[token] * target_distribution(torch.cat([prompt, torch.tensor([[token]])], -1))
                             for token in support])
        assert set((joint > 0).nonzero()[:, 1].tolist()) - draft_vocab  # some of the support is never drafted
    config = GenerationConfig(do_sample=True, max_length=prompt.shape[1] + 2, top_k=3, temperature=0.8, num_beams=1,
                              num_return_sequences=1, output_scores=False, output_logits=False,
                              return_dict_in_generate=False)
    stopping = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + 2)])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros_like(joint)
    for _ in range(600):
        out = hs.generate(model, prompt, logits_processor=warpers, stopping_criteria=stopping,
                          generation_config=config, candidate_generator=drafter, generator=generator)
        first_token, second_token = out[0, -2:].tolist()
        counts[support.index(first_token), second_token] += 1
    statistic = chi_square(counts, joint) / chi_square_critical(int((joint > 0).sum()) - 1)
    assert statistic < 1


def test_sampled_chain_drafts_carry_zero_probability_outside_the_draft_vocabulary(targets, fitted):
    drafter = EagleDrafter.from_pretrained(str(fitted), num_draft_tokens=3)
    drafts = []
    original = drafter.propose
    drafter.propose = lambda *args: drafts.extend(original(*args)) or drafts[-1:]
    speculative_generate(targets["llama"], prompt_ids("random"), drafter, do_sample=True, top_k=0,
                         generator=torch.Generator().manual_seed(0))
    outside = torch.ones(VOCAB_SIZE, dtype=torch.bool)
    outside[torch.arange(64) + drafter.head.d2t] = False
    probs = torch.cat([draft.draft_probs for draft in drafts])
    assert probs[:, outside].sum() == 0 and torch.allclose(probs.sum(-1), torch.ones(len(probs)))


# ---------------------------------------------------------------- the head on the target's device and dtype


def test_a_head_of_another_dtype_is_copied_never_changed(targets, fitted):
    """A head the user passed stays as it is: the drafter runs a converted copy, made once per (device, dtype)."""
    target = copy.deepcopy(targets["llama"]).double()
    head = load_eagle_head(fitted)
    drafter = EagleDrafter(head, num_draft_tokens=3)
    for _ in range(2):
        out = speculative_generate(target, prompt_ids("random"), drafter, return_dict_in_generate=True)
        assert_same_tokens(out.sequences, plain_generate(target, prompt_ids("random")))
    assert out.speculative_stats.num_accepted_tokens > 0
    assert {parameter.dtype for parameter in head.parameters()} == {torch.float32}
    converted = drafter.module_for(torch.device("cpu"), torch.float64)
    assert converted is not head and {parameter.dtype for parameter in converted.parameters()} == {torch.float64}
    assert list(drafter._converted.values()) == [converted]  # one copy, reused by the second call


def test_a_dtype_change_converts_the_config_built_head_without_reloading(targets, fitted, monkeypatch):
    """`speculative_config=` builds the drafter once; on a target moved to another dtype the same drafter serves
    (its own head moved in place), nothing is read from disk again."""
    import hf_speculators.drafters.eagle as eagle_module

    loads, load = [], eagle_module.load_eagle_head
    monkeypatch.setattr(eagle_module, "load_eagle_head", lambda folder: loads.append(folder) or load(folder))
    target = copy.deepcopy(targets["llama"])
    config = hs.SpeculativeConfig(method="eagle3", draft_model=str(fitted), num_draft_tokens=3)
    outputs = []
    for dtype in (torch.float32, torch.float64):
        target.to(dtype)
        outputs.append(target.generate(prompt_ids("random"), custom_generate=hs.generate, speculative_config=config,
                                       do_sample=False, max_new_tokens=24))
        assert_same_tokens(outputs[-1], plain_generate(target, prompt_ids("random")))
    assert len(loads) == 1
    head = target._hf_speculators_built.drafter.head
    assert {parameter.dtype for parameter in head.parameters()} == {torch.float64}


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", EAGLE_FORMATS)
def test_the_format_is_detected_from_the_files(saved, fmt):
    assert detect_eagle_format(saved("llama", fmt)) == fmt


def test_a_speculators_checkpoint_round_trips(tmp_path):
    head = random_eagle3(40, draft_vocab_size=64, norm_before_residual=True, num_layers=2)
    folder = save_eagle3_head(head, tmp_path, verifier_name_or_path="org/target",
                              verifier_architectures=["LlamaForCausalLM"], num_draft_tokens=4, dtype=torch.float16)
    loaded = load_eagle_head(folder)
    assert loaded.flags == head.flags and loaded.aux_layer_ids == AUX_LAYER_IDS
    assert loaded.config.rope_parameters["rope_theta"] == 500.0 and loaded.config.num_hidden_layers == 2
    for name, tensor in head.state_dict().items():
        stored = tensor.half().to(tensor.dtype) if tensor.is_floating_point() else tensor
        torch.testing.assert_close(loaded.state_dict()[name], stored)
    config = json.loads((folder / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {"name_or_path": "org/target",
                                                        "architectures": ["LlamaForCausalLM"]}
    assert speculators_settings(config, str(folder))["num_draft_tokens"] == 4
    from safetensors.torch import load_file
    tensors = load_file(str(folder / "model.safetensors"))
    assert tensors["fc.weight"].dtype == torch.float16 and tensors["d2t"].dtype == torch.long
    assert tensors["t2d"].sum() == 64 and tensors["t2d"][torch.arange(64) + tensors["d2t"]].all()


# ---------------------------------------------------------------- errors


def _save(tmp_path, head, fmt="speculators-eagle3", **config_changes):
    folder = save_in_format(head, tmp_path, fmt)
    config = json.loads((folder / "config.json").read_text())
    for key, value in config_changes.items():
        target = config["transformer_layer_config"] if key == "model_type" or key == "layer_types" else config
        target[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("head", "message"), [
    (lambda: random_eagle3(aux_layer_ids=[0, 2, 4]),
     r"eagle_aux_hidden_state_layer_ids \[0, 2, 4\] are outside this target's decoder layers 0..3"),
    (lambda: random_eagle3(target_hidden_size=64),
     "reads target features of target_hidden_size=64 .* this target's hidden_size is 48"),
])
def test_a_head_that_does_not_fit_the_target_fails_before_generation(targets, head, message):
    with pytest.raises(ValueError, match=message):
        speculative_generate(targets["llama"], prompt_ids("random"), EagleDrafter(head()))


def test_default_feature_layers_beyond_a_shallow_target_fail(zoo):
    with pytest.raises(ValueError, match=r"ids \[2, 1, -1\] are outside this target's decoder layers 0..1"):
        speculative_generate(zoo.target("llama"), prompt_ids("random"), EagleDrafter(random_eagle3(aux_layer_ids=None)))


def test_a_head_of_another_vocabulary_fails(targets):
    head = random_eagle3()
    head.vocab_size = 128
    with pytest.raises(ValueError, match="vocab_size is 128 and the target scores 96 tokens"):
        speculative_generate(targets["llama"], prompt_ids("random"), EagleDrafter(head))


def test_a_head_without_embeddings_of_its_width_fails(targets):
    from transformers import LlamaConfig

    from hf_speculators.heads.eagle import Eagle3Head

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB_SIZE)
    head = Eagle3Head(config, aux_layer_ids=AUX_LAYER_IDS, target_hidden_size=48)
    with pytest.raises(ValueError, match="no embed_tokens and the target's embeddings are 48 wide"):
        speculative_generate(targets["llama"], prompt_ids("random"), EagleDrafter(head))


def test_d2t_past_the_vocabulary_fails(targets):
    head = random_eagle3(draft_vocab_size=64)
    head.d2t[-1] = 40
    with pytest.raises(ValueError, match="d2t maps draft ids past the target's 96 tokens"):
        speculative_generate(targets["llama"], prompt_ids("random"), EagleDrafter(head))


def test_a_static_tree_wider_than_the_draft_vocabulary_fails(targets):
    with pytest.raises(ValueError, match="child rank 70 of a 64-token draft vocabulary"):
        speculative_generate(targets["llama"], prompt_ids("random"),
                             EagleDrafter(random_eagle3(draft_vocab_size=64), tree=[(0,), (70,)]))


def test_get_candidates_refuses():
    with pytest.raises(RuntimeError, match="only hf_speculators.generate records"):
        EagleDrafter(random_eagle3()).get_candidates(prompt_ids("random"))


@pytest.mark.parametrize(("fmt", "changes", "message"), [
    ("speculators-eagle3", {"norm_before_fc": True, "fc_norm": True}, "norm_before_fc and fc_norm are both set"),
    ("speculators-eagle3", {"norm_output": "yes"}, "norm_output='yes' must be true or false"),
    ("speculators-eagle3", {"model_type": "gemma"},
     r"transformer_layer_config.model_type='gemma' is not supported; use one of \['llama', 'qwen3'\]"),
    ("speculators-eagle3", {"layer_types": ["sliding_attention"]}, "transformer_layer_config.layer_types has sliding"),
    ("speculators-eagle3", {"speculators_model_type": "mtp"}, "speculators_model_type='mtp' is not an EAGLE head"),
    ("speculators-eagle", {"layernorms": True}, "layernorms=true .* is not supported"),
    ("speculators-eagle3", {"draft_vocab_size": 32},
     r"misshapen \['d2t \(64,\) \(expected \(32,\)\)', 'lm_head.weight \(64, 48\) \(expected \(32, 48\)\)'\]"),
])
def test_a_malformed_checkpoint_fails_naming_the_field(tmp_path, fmt, changes, message):
    head = random_eagle3(draft_vocab_size=64) if fmt.endswith("eagle3") else random_eagle()
    with pytest.raises(ValueError, match=message):
        load_eagle_head(_save(tmp_path, head, fmt, **changes))


def test_missing_tensors_are_named(tmp_path):
    folder = save_in_format(random_eagle(), tmp_path, "safeailab-eagle")
    state = torch.load(folder / "pytorch_model.bin", weights_only=True)
    del state["layers.0.mlp.up_proj.weight"]
    torch.save(state, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"missing \['layers.0.mlp.up_proj.weight'\], unexpected \[\]"):
        load_eagle_head(folder)


def test_files_of_no_known_format_fail(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    from safetensors.torch import save_file
    save_file({"weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="not an EAGLE checkpoint of a known format"):
        detect_eagle_format(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_eagle_head(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        EagleDrafter.from_pretrained(str(tmp_path / "absent"))


# ---------------------------------------------------------------- the demo head

DEMO_EAGLE3 = (Path(DEMO_DIR) / "eagle3" / "config.json").is_file() and (Path(DEMO_TARGET) / "config.json").is_file()


@pytest.mark.skipif(not DEMO_EAGLE3, reason="the demo weights (hf_speculators/demo/{target,eagle3}) are not there")
@pytest.mark.parametrize("tree", [None, hs.DynamicTree(depth=4, top_k=3, num_nodes=12)], ids=["chain", "tree"])
def test_the_demo_head_drafts_for_the_demo_target(tree):
    target, tokenizer = load_model("hf_speculators/demo-target"), load_tokenizer("hf_speculators/demo-target")
    prompt = tokenizer("Question: Tom has 3 apples and buys 5 more. How many apples", return_tensors="pt").input_ids
    drafter = EagleDrafter.from_pretrained("hf_speculators/demo-eagle3", num_draft_tokens=3, tree=tree)
    out = speculative_generate(target, prompt, drafter, max_new_tokens=32, return_dict_in_generate=True)
    assert_same_tokens(out.sequences, plain_generate(target, prompt, max_new_tokens=32))
    assert out.speculative_stats.num_accepted_tokens > 0


def test_compiled_steps_keep_eagle3_exact(targets, fitted):
    """EAGLE-3 over a static cache with the compile switch on: the target's steps compile, their features coming from
    the compiled forward's `output_hidden_states` (`target.TargetForward`), and so do the head's forwards over a
    static head cache (`compiled.run_draft_head`). Exact, a static cache returned, each first draft token the head's
    guess from the true features, the same drafts as over the dynamic cache; three graphs (the target's k + 1 slots,
    the head's catch-up of k + 1 pairs, its one-node chain step), none more for other prompt lengths (a one-token
    prompt; the prompt fed partly eagerly), the goodput schedule's draft lengths or another drafter of the head."""
    fresh_dynamo()
    dynamic, _ = run(targets["llama"], fitted, "repetitive", num_draft_tokens=3)
    settings = dict(cache_implementation="static", compile_config=compile_config("eager"))
    out, drafter = run(targets["llama"], fitted, "repetitive", settings, num_draft_tokens=3)
    assert_same_tokens(out.sequences, plain_generate(targets["llama"], prompt_ids("repetitive")))
    assert isinstance(output_cache(out), StaticCache)
    assert unique_graphs() == 3  # eager heads: 1
    assert frame_graphs(run_draft_head, run_draft_head_step) == [1, 1]  # a frame each
    check_first_drafts(drafter, fitted, "speculators-eagle3", targets["llama"], out.sequences)
    stats, reference = out.speculative_stats, dynamic.speculative_stats
    assert 0 < stats.num_accepted_tokens == reference.num_accepted_tokens
    assert stats.num_drafted_tokens == reference.num_drafted_tokens
    for prompt in ("one_token", "random"):
        out, drafter = run(targets["llama"], fitted, prompt, {**settings, "num_draft_tokens_schedule": "goodput"},
                           num_draft_tokens=3)
        assert_same_tokens(out.sequences, plain_generate(targets["llama"], prompt_ids(prompt)))
    check_first_drafts(drafter, fitted, "speculators-eagle3", targets["llama"], out.sequences)
    assert unique_graphs() == 3
