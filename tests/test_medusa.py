"""Medusa heads: exact greedy output (chain and tree), the first draft token against a reference computation, lossless
sampling, checkpoint formats (Medusa v0.1 safetensors and .pt, version 2) and every error."""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from speculative_helpers import (
    assert_cache_matches_sequence,
    assert_same_tokens,
    plain_generate,
    prompt_ids,
    recording_forward_lengths,
    speculative_generate,
)
from test_lossless import chi_square, chi_square_critical
from transformers import (
    GenerationConfig,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import hf_speculators as hs
from hf_speculators.drafters.medusa import MC_SIM_7B_63, MedusaDrafter
from hf_speculators.heads.medusa import MedusaHeads
from hf_speculators.heads.medusa_formats import (
    MEDUSA_V1,
    MEDUSA_V2,
    detect_medusa_format,
    read_medusa_heads,
    save_medusa_heads,
)
from hf_speculators.loading import DEMO_IDS

FORMATS = {"v0.1-safetensors": (True, "safetensors"), "v0.1-pt": (True, "pt"), "v2": (False, "safetensors")}
NUM_HEADS, TRAIN_STEPS, NUM_RUNS = 5, 60, 500
WEIGHT_FILE = {"safetensors": "medusa_lm_head.safetensors", "pt": "medusa_lm_head.pt"}


def train_heads(target, own_lm_heads: bool) -> MedusaHeads:
    """Medusa heads fitted to the target's greedy continuation of the test prompt, its first 12 tokens only: head i
    at t to the token t + i + 2. Drafts are then accepted early in the tests' generations and rejected later (random
    heads are almost never accepted; these tiny random targets follow no pattern a head could learn in general)."""
    torch.manual_seed(0)
    lm_weight = target.get_output_embeddings().weight.detach()
    heads = MedusaHeads(lm_weight.shape[1], NUM_HEADS, 1, lm_weight.shape[0] if own_lm_heads else None)
    if own_lm_heads:  # Medusa's initialisation: each head starts as the target's LM head
        for head in heads.heads:
            head[-1].weight.data.copy_(lm_weight)
    sequences = target.generate(prompt_ids("random"), do_sample=False, max_new_tokens=12)
    with torch.no_grad():
        hidden = target(sequences, output_hidden_states=True).hidden_states[-1]
    optimizer = torch.optim.Adam(heads.parameters(), lr=1e-2)
    for _ in range(TRAIN_STEPS):
        logits = heads(hidden, lambda x: F.linear(x, lm_weight))
        loss = sum(F.cross_entropy(logits[i, :, : -(i + 2)].flatten(0, 1), sequences[:, i + 2 :].flatten())
                   for i in range(NUM_HEADS))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return heads.requires_grad_(False)


class MedusaFolders:
    """Trained heads per (architecture, own LM heads), saved once per format."""

    def __init__(self, zoo, root):
        self.zoo, self.root, self._heads, self._folders = zoo, root, {}, {}

    def heads(self, arch: str, own_lm_heads: bool) -> MedusaHeads:
        if (arch, own_lm_heads) not in self._heads:
            self._heads[arch, own_lm_heads] = train_heads(self.zoo.target(arch), own_lm_heads)
        return self._heads[arch, own_lm_heads]

    def folder(self, arch: str, fmt: str):
        if (arch, fmt) not in self._folders:
            own_lm_heads, weights = FORMATS[fmt]
            self._folders[arch, fmt] = save_medusa_heads(self.heads(arch, own_lm_heads), self.root / f"{arch}-{fmt}",
                                                         weights=weights)
        return self._folders[arch, fmt]


@pytest.fixture(scope="module")
def medusa(zoo, tmp_path_factory) -> MedusaFolders:
    return MedusaFolders(zoo, tmp_path_factory.mktemp("medusa"))


def recorded(drafter: MedusaDrafter) -> list:
    """Makes `drafter` keep `(committed length, draft)` of every step; returns that list."""
    steps, propose = [], drafter.propose

    def recording(state, input_ids, max_tokens, rows):
        drafts = propose(state, input_ids, max_tokens, rows)
        steps.extend((ids.shape[1], draft) for ids, draft in zip(input_ids, drafts))
        return drafts

    drafter.propose = recording
    return steps


def run_exact(zoo, medusa, arch, fmt, tree, k):
    drafter = MedusaDrafter.from_pretrained(str(medusa.folder(arch, fmt)), num_draft_tokens=k, tree=tree)
    output = speculative_generate(zoo.target(arch), prompt_ids("random"), drafter, return_dict_in_generate=True,
                                  plain_floor=False)  # every step drafts: the floor reads the clock
    assert_same_tokens(output.sequences, zoo.reference(arch, "random"))
    assert_cache_matches_sequence(output)
    return output, drafter


# ---------------------------------------------------------------- exactness


# every format on Llama; one format each on Qwen2 and Qwen3
CASES = [("llama", fmt) for fmt in FORMATS] + [("qwen2", "v0.1-pt"), ("qwen3", "v2")]
SHAPES = {"chain": lambda k: (None, k), "medusa": lambda k: ("medusa", min(k, 4)),
          "dynamic": lambda k: (hs.DynamicTree(depth=k, top_k=2, num_nodes=2 * k + 2), k)}


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("arch, fmt", CASES)
def test_greedy_output_is_the_targets(zoo, medusa, arch, fmt, shape, k):
    tree, num_draft_tokens = SHAPES[shape](k)
    stats = run_exact(zoo, medusa, arch, fmt, tree, num_draft_tokens)[0].speculative_stats
    assert 0 < stats.num_accepted_tokens < stats.num_drafted_tokens  # accepted and rejected drafts both occur


@pytest.mark.parametrize("tree", [None, "medusa"], ids=["chain", "tree"])
def test_greedy_output_with_a_processor_reading_the_sequence_is_the_targets(zoo, medusa, tree):
    """A repetition penalty: the drafts and the verification see each path's tokens."""
    drafter = MedusaDrafter.from_pretrained(str(medusa.folder("llama", "v2")), tree=tree, num_draft_tokens=3)
    output = speculative_generate(zoo.target("llama"), prompt_ids("repetitive"), drafter, repetition_penalty=1.5)
    assert_same_tokens(output, zoo.reference("llama", "repetitive", repetition_penalty=1.5))


def test_a_tree_of_paths_is_exact(zoo, medusa):
    output, drafter = run_exact(zoo, medusa, "llama", "v2", [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)], None)
    assert drafter.num_draft_tokens == drafter.tree.depth == 3
    assert 0 < output.speculative_stats.num_accepted_tokens


def test_the_medusa_tree_is_mc_sim_7b_63_within_the_heads():
    drafter = MedusaDrafter(MedusaHeads(8, 3), tree="medusa")
    assert len(MC_SIM_7B_63) == 63 and max(map(len, MC_SIM_7B_63)) == 4
    assert drafter.tree.paths == [p for p in MC_SIM_7B_63 if len(p) <= 3] and drafter.num_draft_tokens == 3
    assert MedusaDrafter(MedusaHeads(8, 5), tree="mc_sim_7b_63").tree.depth == 4


# ---------------------------------------------------------------- the draft against a reference computation


def reference_head0(folder, fmt, target, hidden):
    """Head 0's argmax from the checkpoint file, as Medusa defines it: `lm_head(x + SiLU(W x + b))`."""
    own_lm_heads, weights = FORMATS[fmt]
    path = folder / WEIGHT_FILE[weights]
    state = load_file(str(path)) if weights == "safetensors" else torch.load(path, weights_only=True)
    block = hidden + F.silu(hidden @ state["0.0.linear.weight"].T + state["0.0.linear.bias"])
    lm_weight = state["0.1.weight"] if own_lm_heads else target.get_output_embeddings().weight
    return (block @ lm_weight.T).argmax(-1)


@pytest.mark.parametrize("tree", [None, "medusa"], ids=["chain", "tree"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_first_draft_token_is_head0_on_the_newest_final_hidden_state(zoo, medusa, fmt, tree):
    target = zoo.target("qwen2")
    drafter = MedusaDrafter.from_pretrained(str(medusa.folder("qwen2", fmt)), num_draft_tokens=3, tree=tree)
    steps = recorded(drafter)
    output = speculative_generate(target, prompt_ids("random"), drafter)
    with torch.no_grad():
        hidden = target(output, output_hidden_states=True).hidden_states[-1][0]  # after the final norm
        expected = reference_head0(medusa.folder("qwen2", fmt), fmt, target, hidden)
    drafted = {n: int(draft.token_ids[0]) for n, draft in steps}
    assert len(drafted) > 5
    # at n committed tokens the newest feature is position n - 2; position n - 3 would differ somewhere
    assert drafted == {n: int(expected[n - 2]) for n in drafted}
    assert drafted != {n: int(expected[n - 3]) for n in drafted}


# ---------------------------------------------------------------- sampling


def test_sampled_chains_are_lossless(zoo, medusa):
    """First two tokens of `hs.generate` with sampled Medusa chains (top-3, temperature 0.8): the target's law."""
    model, prompt = zoo.target("llama"), prompt_ids("random")
    warpers = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(3)])

    def target_distribution(input_ids):
        return torch.softmax(warpers(input_ids, model(input_ids).logits[:, -1].float()), dim=-1)[0]

    with torch.no_grad():
        first = target_distribution(prompt)
        support = first.nonzero().flatten().tolist()
        joint = torch.stack([first[t] * target_distribution(torch.cat([prompt, torch.tensor([[t]])], -1))
                             for t in support])
    drafter = MedusaDrafter(medusa.heads("llama", True), num_draft_tokens=2)
    config = GenerationConfig(do_sample=True, max_length=prompt.shape[1] + 2, top_k=3, temperature=0.8, num_beams=1,
                              num_return_sequences=1, output_scores=False, output_logits=False,
                              return_dict_in_generate=True)
    stopping = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + 2)])
    generator = torch.Generator().manual_seed(0)
    counts, accepted = torch.zeros_like(joint), 0
    for _ in range(NUM_RUNS):
        out = hs.generate(model, prompt, logits_processor=warpers, stopping_criteria=stopping, generation_config=config,
                          candidate_generator=drafter, generator=generator)
        first_token, second_token = out.sequences[0, -2:].tolist()
        counts[support.index(first_token), second_token] += 1
        accepted += out.speculative_stats.num_accepted_tokens
    assert 0 < accepted < NUM_RUNS * 2  # drafts accepted and rejected
    assert chi_square(counts, joint) / chi_square_critical(int((joint > 0).sum()) - 1) < 1


def test_sampled_chain_returns_the_processed_distributions(zoo, medusa):
    drafter = MedusaDrafter(medusa.heads("llama", False), num_draft_tokens=3)
    steps = recorded(drafter)
    speculative_generate(zoo.target("llama"), prompt_ids("random"), drafter, do_sample=True, top_k=5,
                         generator=torch.Generator().manual_seed(0))
    for _, draft in steps:
        assert draft.draft_probs is not None and draft.draft_probs.shape == (draft.num_nodes, 96)
        assert ((draft.draft_probs > 0).sum(-1) <= 5).all()  # top-k applied to the draft's scores too
        assert (draft.draft_probs[torch.arange(draft.num_nodes), draft.token_ids] > 0).all()


def test_heads_of_another_dtype_are_copied_never_changed(zoo, medusa):
    """Heads the user passed stay as they are: the drafter runs a converted copy on a float64 target."""
    import copy

    target = copy.deepcopy(zoo.target("llama")).double()
    heads = medusa.heads("llama", False)
    drafter = MedusaDrafter(heads, num_draft_tokens=3, tree="medusa")
    output = speculative_generate(target, prompt_ids("random"), drafter)
    assert_same_tokens(output, plain_generate(target, prompt_ids("random")))
    assert {parameter.dtype for parameter in heads.parameters()} == {torch.float32}
    assert [next(converted.parameters()).dtype for converted in drafter._converted.values()] == [torch.float64]


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", FORMATS)
def test_save_and_load_round_trip(medusa, fmt):
    own_lm_heads, weights = FORMATS[fmt]
    heads, folder = medusa.heads("llama", own_lm_heads), medusa.folder("llama", fmt)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", WEIGHT_FILE[weights]]
    assert detect_medusa_format(folder) == (MEDUSA_V1 if own_lm_heads else MEDUSA_V2)
    loaded = read_medusa_heads(folder)
    assert (loaded.num_heads, loaded.num_layers, loaded.hidden_size, loaded.vocab_size) == (
        NUM_HEADS, 1, 48, 96 if own_lm_heads else None)
    for name, tensor in heads.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)


def test_round_trip_in_float16_with_two_layers(tmp_path):
    heads = MedusaHeads(8, 2, num_layers=2, vocab_size=10)
    for parameter in heads.parameters():
        parameter.data.normal_()
    save_medusa_heads(heads, tmp_path, dtype=torch.float16, base_model_name_or_path="org/target")
    assert load_file(str(tmp_path / "medusa_lm_head.safetensors"))["1.2.weight"].dtype == torch.float16
    assert read_medusa_heads(tmp_path).num_layers == 2
    torch.testing.assert_close(read_medusa_heads(tmp_path).heads[1][2].weight, heads.heads[1][2].weight.half().float())
    assert "org/target" in (tmp_path / "config.json").read_text()


def test_heads_are_counted_from_the_weights_not_the_config(tmp_path):
    """medusa-vicuna-7b-v1.3's config says 2 heads while its weights hold 5."""
    save_medusa_heads(MedusaHeads(8, 5, vocab_size=10), tmp_path, weights="pt")
    (tmp_path / "config.json").write_text('{"medusa_num_heads": 2, "medusa_num_layers": 1}')
    with pytest.warns(UserWarning, match="config.json says medusa_num_heads=2, the weights hold 5; using 5"):
        heads = read_medusa_heads(tmp_path)
    assert heads.num_heads == 5 and MedusaDrafter(heads).num_draft_tokens == 5


def test_detection(tmp_path):
    assert detect_medusa_format(tmp_path) is None  # empty
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    save_file({"0.0.linear.weight": torch.zeros(8, 8)}, str(tmp_path / "medusa_lm_head.safetensors"))
    assert detect_medusa_format(tmp_path) is None  # not a Medusa config
    (tmp_path / "config.json").write_text('{"medusa_num_heads": 1, "version": "2"}')
    assert detect_medusa_format(tmp_path) == MEDUSA_V2
    (tmp_path / "config.json").write_text('{"medusa_num_heads": 1}')
    assert detect_medusa_format(tmp_path) == MEDUSA_V1


def test_from_pretrained_reads_a_folder_and_the_demo_id(medusa):
    drafter = MedusaDrafter.from_pretrained(str(medusa.folder("llama", "v2")), tree="medusa", num_draft_tokens=2)
    assert drafter.tree.depth == 4 and drafter.num_draft_tokens == 2 and not drafter.heads.has_lm_heads
    assert repr(drafter).startswith("MedusaDrafter(num_heads=5, num_draft_tokens=2, tree=StaticTree(")
    demo = MedusaDrafter.from_pretrained("hf_speculators/demo-medusa")  # shipped in the package: v0.1, float16
    assert detect_medusa_format(DEMO_IDS["hf_speculators/demo-medusa"]) == MEDUSA_V1
    assert (demo.heads.num_heads, demo.heads.hidden_size, demo.heads.vocab_size, demo.num_draft_tokens) == (
        3, 384, 4096, 3)


# ---------------------------------------------------------------- errors


def _write(folder, config: str, state: dict):
    (folder / "config.json").write_text(config)
    save_file(state, str(folder / "medusa_lm_head.safetensors"))
    return folder


def test_reader_errors(tmp_path):
    with pytest.raises(ValueError, match="is not a Medusa heads checkpoint: it needs a config.json with medusa_num"):
        read_medusa_heads(tmp_path)
    block = {"0.0.linear.weight": torch.zeros(8, 8), "0.0.linear.bias": torch.zeros(8)}
    _write(tmp_path, '{"medusa_num_heads": 1}', {**block, "medusa_head.0.0.linear.bias": torch.zeros(8)})
    with pytest.raises(ValueError, match=r"not Medusa head weights: .* got \['medusa_head.0.0.linear.bias'\]"):
        read_medusa_heads(tmp_path)
    _write(tmp_path, '{"medusa_num_heads": 1}', block)
    with pytest.raises(ValueError, match="config.json's version is None but the weights lack per-head LM heads"):
        read_medusa_heads(tmp_path)
    _write(tmp_path, '{"medusa_num_heads": 1, "version": "2"}', {**block, "0.1.weight": torch.zeros(10, 8)})
    with pytest.raises(ValueError, match="config.json's version is '2' but the weights hold per-head LM heads"):
        read_medusa_heads(tmp_path)
    _write(tmp_path, '{"medusa_num_heads": 2}', {**block, "0.1.weight": torch.zeros(10, 8),
                                                 "1.0.linear.weight": torch.zeros(8, 8)})
    with pytest.raises(ValueError, match=r"not a complete Medusa head list: (?s:.*)Missing key"):
        read_medusa_heads(tmp_path)


def test_a_pickle_with_code_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"medusa_num_heads": 1}')
    torch.save({"0.0.linear.weight": GenerationConfig()}, tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="not a plain tensor checkpoint, refused without running its code"):
        read_medusa_heads(tmp_path)


def test_from_pretrained_of_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        MedusaDrafter.from_pretrained(str(tmp_path / "missing"))


def test_writer_errors(tmp_path):
    with pytest.raises(ValueError, match="weights must be 'safetensors', or 'pt' for heads with their own LM heads"):
        save_medusa_heads(MedusaHeads(8, 1), tmp_path, weights="pt")
    with pytest.raises(ValueError, match="got 'bin'"):
        save_medusa_heads(MedusaHeads(8, 1, vocab_size=10), tmp_path, weights="bin")


def test_heads_errors():
    with pytest.raises(ValueError, match="MedusaHeads num_heads must be an integer >= 1, got 0"):
        MedusaHeads(8, 0)
    with pytest.raises(ValueError, match="MedusaHeads vocab_size must be an integer >= 1, got 0"):
        MedusaHeads(8, 1, vocab_size=0)
    with pytest.raises(ValueError, match="end with the target's LM head: pass lm_head="):
        MedusaHeads(8, 1)(torch.zeros(8))


def test_drafter_errors():
    heads = MedusaHeads(8, 3)
    with pytest.raises(ValueError, match="MedusaDrafter takes MedusaHeads .* got str"):
        MedusaDrafter("FasterDecoding/medusa-vicuna-7b-v1.3")
    with pytest.raises(ValueError, match=r"num_draft_tokens=4 is more than the 3 tokens these Medusa heads draft "
                                         r"\(their number\)"):
        MedusaDrafter(heads, num_draft_tokens=4)
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1, got 0"):
        MedusaDrafter(heads, num_draft_tokens=0)
    with pytest.raises(ValueError, match="The tree is 5 tokens deep but there are 3 Medusa heads"):
        MedusaDrafter(heads, tree=hs.DynamicTree(depth=5))
    with pytest.raises(ValueError, match="Unknown Medusa tree 'vicuna'"):
        MedusaDrafter(heads, tree="vicuna")
    with pytest.raises(RuntimeError, match="only hf_speculators.generate records"):
        MedusaDrafter(heads).get_candidates(prompt_ids("random"))


@pytest.mark.parametrize("heads, message", [
    (MedusaHeads(32, 2), "The Medusa heads have hidden_size 32 but the target's hidden size is 48"),
    (MedusaHeads(48, 2, vocab_size=100), "The Medusa heads have vocab_size 100 but the target's vocabulary has 96"),
])
def test_heads_for_another_target_fail_before_generation(zoo, heads, message):
    target = zoo.target("llama")
    with pytest.raises(ValueError, match=message), recording_forward_lengths(target) as lengths:
        speculative_generate(target, prompt_ids("random"), MedusaDrafter(heads))
    assert lengths == []  # no target forward ran
