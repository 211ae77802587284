"""Relaxed verification (typical acceptance, top-k with tolerance), its stats flag, the bench and the sweep."""

import importlib.util
import json
import math

import pytest
import torch
from speculative_helpers import assert_same_tokens, prompt_ids
from speculative_helpers import speculative_generate as speculative
from tiny_models import VOCAB_SIZE

import hf_speculators as hs
from hf_speculators.tools.bench import BenchSettings, named_methods, run_benchmark
from hf_speculators.tools.cli import main
from hf_speculators.tools.sweep import default_verifiers, plot_sweep, run_sweep, sweep_table
from hf_speculators.verifiers import resolve_verifier

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PROMPTS = ["abcabcabcab", "xyz.xyz.xy"]  # the tokenizer is character-level


@pytest.fixture
def target(zoo):
    return zoo.target("llama")


@pytest.fixture
def draft(zoo):
    return zoo.noisy_draft("llama")


def accepted(verifier, probs: list[float]) -> list[bool]:
    """Which of the tokens 0 .. len(probs) - 1 `verifier` accepts where the target's distribution is `probs`."""
    scores = torch.tensor(probs).log().expand(len(probs), -1)
    return verifier.accepts(torch.arange(len(probs)), scores).tolist()


# ---------------------------------------------------------------- what is accepted


@pytest.mark.parametrize(
    "probs, expected",
    [
        # H = 0.29 nats: 0.3 * exp(-H) = 0.22, so the bar is epsilon = 0.09: only the sure token passes
        ([0.94, 0.03, 0.02, 0.01], [True, False, False, False]),
        # H = 1.16: bar 0.09 (0.3 * exp(-H) = 0.094): 0.12 passes, 0.08 does not
        ([0.5, 0.3, 0.12, 0.08], [True, True, True, False]),
        # flat over 4 tokens, H = ln 4: the bar drops to 0.3 / 4 = 0.075 and every token passes
        ([0.25, 0.25, 0.25, 0.25], [True, True, True, True]),
    ],
)
def test_typical_acceptance(probs, expected):
    assert accepted(hs.TypicalVerifier(), probs) == expected


def test_typical_parameters():
    assert hs.TypicalVerifier().delta == pytest.approx(0.3)  # sqrt(0.09)
    # with a small delta the entropy bar decides: flat over 4 tokens, bar 0.05 * 0.25 = 0.0125 < p = 0.25
    assert accepted(hs.TypicalVerifier(epsilon=0.5, delta=0.05), [0.25] * 4) == [True] * 4
    # epsilon 0.3, delta sqrt(0.3) = 0.55: the bar is min(0.3, 0.55 * exp(-1.16) = 0.17), stricter than the default
    assert accepted(hs.TypicalVerifier(epsilon=0.3), [0.5, 0.3, 0.12, 0.08]) == [True, True, False, False]
    assert repr(hs.TypicalVerifier(0.04)) == "TypicalVerifier(epsilon=0.04, delta=0.2)"


@pytest.mark.parametrize(
    "top_k, tolerance, expected",
    [
        (1, 0.0, [True, False, False, False]),  # the speculators format's defaults: greedy
        (2, 1.0, [True, True, False, False]),  # log(0.5 / 0.3) = 0.51 <= 1; token 2 is third
        (3, 1.0, [True, True, False, False]),  # token 2 is in the top 3 but log(0.5 / 0.12) = 1.43 > 1
        (3, 1.5, [True, True, True, False]),
        (4, math.inf, [True, True, True, True]),
    ],
)
def test_top_k_acceptance(top_k, tolerance, expected):
    assert accepted(hs.TopKVerifier(top_k, tolerance), [0.5, 0.3, 0.12, 0.08]) == expected


def test_top_k_ties_count_as_inside():
    assert accepted(hs.TopKVerifier(top_k=1, accept_tolerance=0.0), [0.4, 0.4, 0.2]) == [True, True, False]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: hs.TypicalVerifier(epsilon=0), r"epsilon must be a number in \(0, 1\]"),
        (lambda: hs.TypicalVerifier(epsilon=1.5), r"epsilon must be a number in \(0, 1\]"),
        (lambda: hs.TypicalVerifier(epsilon=True), "epsilon must be"),
        (lambda: hs.TypicalVerifier(delta=0.0), "delta must be a number > 0"),
        (lambda: hs.TopKVerifier(top_k=0), "top_k must be an integer >= 1"),
        (lambda: hs.TopKVerifier(top_k=2.0), "top_k must be an integer >= 1"),
        (lambda: hs.TopKVerifier(accept_tolerance=-0.1), "accept_tolerance must be a number >= 0"),
        (lambda: hs.TopKVerifier(accept_tolerance=float("nan")), "accept_tolerance must be a number >= 0"),
    ],
)
def test_bad_parameters(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_registered_and_not_lossless():
    for name, cls in (("typical", hs.TypicalVerifier), ("top_k", hs.TopKVerifier)):
        assert hs.VERIFIERS[name] is cls and cls.lossless is False
        for do_sample in (False, True):
            assert isinstance(resolve_verifier(name, do_sample), cls)


# ---------------------------------------------------------------- on trees


def test_deepest_accepted_path_and_next_token():
    # nodes: 0 and 1 under the root, 2 under 0, 3 under 2
    draft = hs.Draft.from_lists([1, 2, 3, 0], [-1, -1, 0, 2], "cpu")
    probs = torch.full((5, 4), 0.02)
    probs[0, [1, 2]] = 0.47  # both root children are typical
    probs[1, 3] = 0.94  # after node 0: node 2's token is the sure one
    probs[3, 1] = 0.94  # after node 2: node 3's token (0) is not typical
    probs[2] = probs[4] = 0.25
    scores = probs.log()
    verifier = hs.TypicalVerifier()
    verdict = verifier(draft, scores, do_sample=False, generator=None)
    assert verdict.accepted_nodes.tolist() == [0, 2] and int(verdict.next_token) == 1  # argmax after node 2
    scores[3] = torch.tensor([-math.inf, 0.0, -math.inf, -math.inf])  # sampling: only token 1 is possible
    sampled = verifier(draft, scores, do_sample=True, generator=torch.Generator().manual_seed(0))
    assert sampled.accepted_nodes.tolist() == [0, 2] and int(sampled.next_token) == 1


# ---------------------------------------------------------------- through generate


@pytest.mark.parametrize("verifier", ["typical", "top_k", hs.TypicalVerifier(0.2), hs.TopKVerifier(2, 0.5)])
@pytest.mark.parametrize("do_sample", [False, True])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_relaxed_generation_is_marked_not_lossless(target, draft, verifier, do_sample, tree):
    drafter = hs.TreeDrafter(draft, hs.DynamicTree(depth=3, top_k=2, num_nodes=6)) if tree else \
        hs.DraftModelDrafter(draft, num_draft_tokens=3)
    out = speculative(target, prompt_ids("random"), drafter, max_new_tokens=12, verifier=verifier, do_sample=do_sample,
                      generator=torch.Generator().manual_seed(0), return_dict_in_generate=True)
    stats = out.speculative_stats
    assert stats.lossless is False and stats.verifier in ("typical", "top_k")
    assert out.sequences.shape[1] == prompt_ids("random").shape[1] + 12 and int(out.sequences.max()) < VOCAB_SIZE


def test_greedy_top_1_reproduces_greedy_but_stays_flagged(zoo, target, draft):
    out = speculative(target, prompt_ids("random"), hs.TreeDrafter(draft), verifier=hs.TopKVerifier(1, 0.0),
                      return_dict_in_generate=True)
    assert_same_tokens(out.sequences, zoo.reference("llama", "random"))
    assert out.speculative_stats.lossless is False


def test_relaxed_accepts_more_than_exact(target, draft):
    lengths = {}
    for name in ("exact", "typical"):
        out = speculative(target, prompt_ids("random"), hs.TreeDrafter(draft), verifier=name,
                          return_dict_in_generate=True)
        lengths[name] = out.speculative_stats.mean_acceptance_length
    assert lengths["typical"] >= lengths["exact"]


# ---------------------------------------------------------------- bench, CLI and sweep


def test_bench_records_relaxed_methods_as_not_exact(target, draft, tokenizer):
    methods = named_methods(["prompt-lookup-tree", "draft-model-tree"], num_draft_tokens=3, verification="typical",
                            tree_nodes=6)
    result = run_benchmark(target, tokenizer, PROMPTS, methods, BenchSettings(max_new_tokens=8, verbose=False),
                           draft=draft)
    assert result.ok  # differing outputs of relaxed methods are not mismatches
    relaxed = [r for r in result.records if r["method"] != "plain"]
    assert relaxed and all(not r["exact"] and r["lossless"] is False and r["verifier"] == "typical" for r in relaxed)
    assert {m["verification"] for m in result.records[0]["provenance"]["run"]["methods"].values()} == {"typical"}


def test_sweep(target, draft, tokenizer, tmp_path):
    verifiers = [hs.TypicalVerifier(0.09), hs.TopKVerifier(2, 1.0)]  # no exact: the sweep adds it, first
    drafter = hs.TreeDrafter(draft, hs.DynamicTree(depth=3, top_k=2, num_nodes=6))
    points = run_sweep(target, tokenizer, PROMPTS, drafter, verifiers,
                       BenchSettings(max_new_tokens=8, out_path=tmp_path / "s.jsonl"))
    assert [p.verifier for p in points] == ["ExactVerifier()", repr(verifiers[0]), repr(verifiers[1])]
    exact = points[0]
    assert exact.relative_log_likelihood == 0.0 and exact.identical_share == 1.0 and exact.log_likelihood < 0
    for point in points:
        assert point.mean_acceptance_length >= 1.0 and point.tokens_per_s > 0 and 0 <= point.identical_share <= 1
        assert point.relative_log_likelihood == pytest.approx(point.log_likelihood - exact.log_likelihood)
    records = [json.loads(line) for line in (tmp_path / "s.jsonl").read_text().splitlines()]
    assert len(records) == 3 * len(PROMPTS) and all(r["exact_tokens"] == 8 for r in records)
    table = sweep_table(points)
    assert "ExactVerifier()" in table and "TopKVerifier(top_k=2, accept_tolerance=1)" in table
    if HAS_MATPLOTLIB:
        plot_sweep(points, tmp_path / "sweep.png")
        assert (tmp_path / "sweep.png").stat().st_size > 0


def test_default_sweep_settings():
    names = [repr(v) for v in default_verifiers([0.09, (0.5, 2.0)], [(3, 1.0)])]
    assert names == ["ExactVerifier()", "TypicalVerifier(epsilon=0.09, delta=0.3)",
                     "TypicalVerifier(epsilon=0.5, delta=2)", "TopKVerifier(top_k=3, accept_tolerance=1)"]


@pytest.fixture
def model_dirs(target, draft, tokenizer, tmp_path):
    root = tmp_path
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return root


def test_cli_bench_and_sweep(model_dirs, capsys):
    common = ["--prompts", str(model_dirs / "prompts.txt"), "--model", str(model_dirs / "target"),
              "--draft", str(model_dirs / "draft"), "--max-new-tokens", "6", "--num-draft-tokens", "2"]
    out = str(model_dirs / "bench.jsonl")
    assert main(["bench", *common, "--methods", "draft-model-tree", "--verifier", "top_k", "--out", out]) == 0
    assert all(json.loads(line)["verifier"] in (None, "top_k") for line in open(out))
    sweep = ["sweep", *common, "--typical-settings", "0.09,0.5:2", "--top-k-settings", "2:1", "--tree-nodes", "4",
             "--out", str(model_dirs / "sweep.jsonl")]
    assert main(sweep + ["--no-plot"]) == 0
    table = capsys.readouterr().out
    assert "TypicalVerifier(epsilon=0.09" in table and "TypicalVerifier(epsilon=0.5, delta=2)" in table
    if not HAS_MATPLOTLIB:  # the sweep fails at once, before any model runs, and says how to install it
        assert main(sweep) == 2
        assert 'pip install "hf_speculators[plot]"' in capsys.readouterr().err


def test_cli_rejects_bad_sweep_settings(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--prompts", "p.txt", "--top-k-settings", "2-1"])
    assert "TOP_K:TOLERANCE pairs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sweep", "--prompts", "p.txt", "--typical-settings", "0.5:x"])
    assert "EPSILON or EPSILON:DELTA" in capsys.readouterr().err
