"""The exactness and losslessness core on the device `pytest --device` names (the CPU by default, so these tests run
in every suite and cannot rot between GPU runs; `pytest tests/test_device.py --device cuda` on a GPU).

float32 greedy output must equal plain decoding's token for token, for every drafter, chains, trees and batches,
with TF32 off and SDPA pinned to its math kernel; a divergence fails with the logit margin between the two tokens.
bfloat16 runs the same comparison, where a divergence must be a near-tie (the two tokens' logits within a few
bfloat16 steps of each other): near-ties are counted (the test's `near_ties` property), other divergences fail.
"""

import pytest
import torch
from batch_helpers import PAD, laid_out, left_padded
from drafters_for_tests import WrongFirstTreeDrafter
from speculative_helpers import (
    DRAFTER_KINDS,
    MAX_NEW_TOKENS,
    PROMPTS,
    make_drafter,
    plain_generate,
    prompt_ids,
    speculative_generate,
)
from test_lossless import IDENTITY_CASES, one_step_output_distribution
from test_tree import STATIC_PATHS
from tiny_models import ARCHS, build_noisy_copy, build_target
from torch.nn.attention import SDPBackend, sdpa_kernel

import hf_speculators as hs

# A bfloat16 divergence is a near-tie when the two tokens' logits differ by at most this fraction of the largest
# logit's magnitude: 4 steps of bfloat16's 8-bit significand.
NEAR_TIE = 2.0**-5
TREE_SHAPES = {"static": STATIC_PATHS, "dynamic": hs.DynamicTree(depth=4, top_k=3, num_nodes=10)}


@pytest.fixture
def strict_fp32():
    """TF32 off and SDPA pinned to its math kernel for the test (both are no-ops on a CPU)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    with sdpa_kernel(SDPBackend.MATH):
        yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def divergence(model, actual: torch.LongTensor, expected: torch.LongTensor) -> tuple[int, float, float] | None:
    """Where two greedy outputs (shape `(length,)`) first differ: `(position, gap, scale)` with `gap` the difference
    of the two tokens' logits in one forward of the common prefix and `scale` the largest logit's magnitude; None
    when they agree."""
    length = min(len(actual), len(expected))
    differs = (actual[:length] != expected[:length]).nonzero()
    if len(differs) == 0:
        assert len(actual) == len(expected), "outputs of different lengths"
        return None
    position = int(differs[0])
    with torch.no_grad():
        logits = model(expected[None, :position]).logits[0, -1].float()
    gap = (logits[expected[position]] - logits[actual[position]]).abs().item()
    return position, gap, logits.abs().max().item()


def assert_identical(model, actual: torch.LongTensor, expected: torch.LongTensor) -> None:
    """Token-for-token equality; a failure names the first divergence and its logit margin."""
    found = divergence(model, actual.reshape(-1), expected.reshape(-1))
    assert found is None, "diverged at position {} (logit gap {:.3g}, largest logit {:.3g})".format(*found)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", DRAFTER_KINDS)
@pytest.mark.parametrize("num_draft_tokens", [1, 5])
def test_fp32_greedy_identity(device_zoo, strict_fp32, arch, kind, num_draft_tokens):
    reference = device_zoo.reference(arch, "repetitive")
    drafter = make_drafter(kind, num_draft_tokens, device_zoo, arch, reference=reference)
    input_ids = prompt_ids("repetitive").to(device_zoo.device)
    assert_identical(device_zoo.target(arch), speculative_generate(device_zoo.target(arch), input_ids, drafter),
                     reference)


@pytest.fixture(scope="module")
def eager_llama(device):
    """The tiny Llama target on `device` with eager attention (its tree masks then do not go through SDPA)."""
    model = build_target("llama").to(device)
    model.set_attn_implementation("eager")
    return model


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", TREE_SHAPES)
def test_fp32_tree_identity(device_zoo, strict_fp32, arch, shape):
    drafter = hs.TreeDrafter(device_zoo.noisy_draft(arch), TREE_SHAPES[shape])
    input_ids = prompt_ids("random").to(device_zoo.device)
    out = speculative_generate(device_zoo.target(arch), input_ids, drafter, return_dict_in_generate=True,
                               plain_floor=False)  # every step drafts: the floor reads the clock
    assert_identical(device_zoo.target(arch), out.sequences, device_zoo.reference(arch, "random"))
    assert out.speculative_stats.num_drafted_tokens > sum(out.speculative_stats.drafted_per_position)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("share_tokens", [False, True])
def test_fp32_tree_masks(device_zoo, eager_llama, strict_fp32, attention, share_tokens):
    """Accepted nodes are never the first siblings: the tree mask and the cache's gather both matter."""
    target = device_zoo.target("llama") if attention == "sdpa" else eager_llama
    reference = device_zoo.reference("llama", "random")
    drafter = WrongFirstTreeDrafter(reference, 3, share_tokens=share_tokens)
    assert_identical(target, speculative_generate(target, prompt_ids("random").to(device_zoo.device), drafter),
                     reference)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["prompt_lookup", "noisy_draft_model"])
def test_fp32_batch_rows(device_zoo, strict_fp32, arch, kind):
    """Each row of a left-padded batch is its own plain greedy output."""
    names = ("random", "one_token", "repetitive")
    input_ids, attention_mask = (t.to(device_zoo.device) for t in left_padded([PROMPTS[n] for n in names]))
    out = device_zoo.target(arch).generate(
        input_ids, attention_mask=attention_mask, custom_generate=hs.generate, do_sample=False, pad_token_id=PAD,
        candidate_generator=make_drafter(kind, 3, device_zoo, arch), max_new_tokens=MAX_NEW_TOKENS)
    expected = laid_out([PROMPTS[n] for n in names], [device_zoo.reference(arch, n)[0].tolist() for n in names])
    assert out.tolist() == expected.tolist()


@pytest.mark.parametrize("case", ["random_0", "draft_misses_tokens", "target_misses_tokens"])
def test_rejection_identity(device, case):
    """The rejection step's output distribution equals the target's, in float64 on the device."""
    target_probs, draft_probs = (p.to(device) for p in IDENTITY_CASES[case])
    torch.testing.assert_close(one_step_output_distribution(target_probs, draft_probs), target_probs, rtol=0,
                               atol=1e-12)


def test_seeded_sampling_is_reproducible(device_zoo):
    target = device_zoo.target("llama")
    input_ids = prompt_ids("random").to(device_zoo.device)
    runs = [speculative_generate(target, input_ids, make_drafter("noisy_draft_model", 3, device_zoo, "llama"),
                                 do_sample=True, generator=torch.Generator(device_zoo.device).manual_seed(7))
            for _ in range(2)]
    assert torch.equal(*runs)


@pytest.fixture(scope="module")
def bf16_models(device):
    """Per architecture, the tiny target and its noisy draft in bfloat16 on `device`."""
    return {arch: (build_target(arch).to(device, torch.bfloat16), build_noisy_copy(arch).to(device, torch.bfloat16))
            for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["prompt_lookup", "noisy_draft_model", "tree"])
@pytest.mark.parametrize("num_draft_tokens", [2, 5])
def test_bf16_divergences_are_near_ties(bf16_models, device, record_property, arch, kind, num_draft_tokens):
    """Chains and trees (their masks through SDPA's unpinned kernels) in bfloat16 against plain bfloat16 decoding."""
    target, draft = bf16_models[arch]
    drafters = {"prompt_lookup": lambda: hs.PromptLookupDrafter(num_draft_tokens),
                "noisy_draft_model": lambda: hs.DraftModelDrafter(draft, num_draft_tokens=num_draft_tokens),
                "tree": lambda: hs.TreeDrafter(draft, hs.DynamicTree(depth=num_draft_tokens, top_k=2, num_nodes=8))}
    drafter = drafters[kind]()
    input_ids = prompt_ids("repetitive").to(device)
    expected = plain_generate(target, input_ids)[0]
    found = divergence(target, speculative_generate(target, input_ids, drafter)[0], expected)
    if found is not None:
        position, gap, scale = found
        assert gap <= NEAR_TIE * scale, f"a real mismatch at {position}: logit gap {gap:.3g}, largest logit {scale:.3g}"
    record_property("near_ties", int(found is not None))
