"""Tests of hf_speculators.tools.bench: prompt loading, records, summary and the exactness check."""

import copy
import dataclasses
import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from hf_speculators.prompts import PROMPT_SETS  # noqa: E402
from hf_speculators.tools import cli  # noqa: E402
from hf_speculators.tools.bench import run as bench_run  # noqa: E402
from hf_speculators.tools.bench import (  # noqa: E402
    DEFAULT_METHODS,
    BenchSettings,
    Prompt,
    exit_layer_methods,
    load_prompts,
    named_methods,
    run_benchmark,
    summarize,
)
from hf_speculators.tools.bench.batches import Batch  # noqa: E402
from hf_speculators.tools.bench.timing import TimedRun, timed_modules  # noqa: E402
from hf_speculators.config.registry import named_methods as speculative_methods  # noqa: E402
from speculative_helpers import prompt_ids, speculative_generate  # noqa: E402
from test_transformers_compat import DRAFT_CASES  # noqa: E402

WORDS = "the cat sat on a mat and dog ran to park with ball then".split()
PROMPTS = [
    Prompt("the cat sat on a mat and the cat sat on", "writing", 81),
    Prompt("dog ran to park with ball then dog ran to", "qa", 82),
]
K, NEW_TOKENS = 3, 8
RUN_METHODS = (*DEFAULT_METHODS, *exit_layer_methods())  # the self-draft methods: tests/test_quantization.py


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="[UNK]")


def tiny_llama(num_layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target():
    return tiny_llama(2, seed=0)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(1, seed=1)


SETTINGS = {field.name for field in dataclasses.fields(BenchSettings)}


def bench(target, draft, tokenizer, prompts=PROMPTS, methods=DEFAULT_METHODS, **kwargs):
    """`run_benchmark` of the named `methods`, the keywords split between `named_methods` and `BenchSettings`."""
    kwargs = {"max_new_tokens": NEW_TOKENS, "num_draft_tokens": K, **kwargs}
    settings = BenchSettings(**{name: value for name, value in kwargs.items() if name in SETTINGS})
    named = named_methods(methods, **{name: value for name, value in kwargs.items() if name not in SETTINGS})
    return run_benchmark(target, tokenizer, prompts, named, settings, draft=draft)


# ---------------------------------------------------------------- load_prompts


@pytest.mark.parametrize(
    "name, lines, expected",
    [
        ("spec_bench.jsonl", [{"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}],
         [Prompt("Write a poem.", "writing", 81)]),
        ("mt_bench.jsonl", [{"question_id": 1, "turns": ["Hi there."]}], [Prompt("Hi there.", "all", 1)]),
        ("human_eval.jsonl", [{"task_id": "HumanEval/0", "prompt": "def f():\n"}],
         [Prompt("def f():\n", "all", "HumanEval/0")]),
        ("prompts.txt", ["first prompt", "", "second prompt"], [Prompt("first prompt"), Prompt("second prompt")]),
    ],
)
def test_load_prompts_formats(tmp_path, name, lines, expected):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(x) if isinstance(x, dict) else x for x in lines) + "\n")
    assert load_prompts(path) == expected


@pytest.mark.parametrize("name, expected", [("q.jsonl.gz", Prompt("Hi.", "qa", 7)), ("q.txt.gz", Prompt("Hi."))])
def test_load_prompts_reads_gzip(tmp_path, name, expected):
    path = tmp_path / name
    line = json.dumps({"question_id": 7, "category": "qa", "turns": ["Hi."]}) if ".jsonl" in name else "Hi."
    path.write_bytes(gzip.compress(line.encode("utf-8") + b"\n"))
    assert load_prompts(path) == [expected]


def test_the_shipped_spec_bench_set_is_spec_bench():
    prompts = load_prompts("spec-bench")
    categories = {p.category: sum(q.category == p.category for q in prompts) for p in prompts}
    assert len(prompts) == 480 and len(categories) == 13
    assert {categories[c] for c in ("translation", "summarization", "qa", "math_reasoning", "rag")} == {80}
    assert prompts[0] == Prompt(prompts[0].text, "writing", 81)
    assert [p.category for p in load_prompts("spec-bench", limit=13)] == list(categories)



def test_the_shipped_prompt_set_keeps_its_licenses():
    folder = PROMPT_SETS["spec-bench"].parent
    assert "Apache License" in (folder / "LICENSE.spec-bench").read_text(encoding="utf-8")
    assert (folder / "LICENSE.gsm8k").read_text(encoding="utf-8").startswith("MIT License")
    notice = (folder / "README.md").read_text(encoding="utf-8")
    for source in ("MT-bench", "WMT14", "CNN/DailyMail", "Natural Questions", "GSM8K", "DPR", "CC BY-NC 4.0"):
        assert source in notice


def test_bench_and_sweep_default_to_spec_bench():
    parser = cli.build_parser()
    assert parser.parse_args(["bench"]).prompts == parser.parse_args(["sweep"]).prompts == "spec-bench"


def test_load_prompts_limit_keeps_file_order(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a\nb\nc\n")
    assert [p.text for p in load_prompts(path, limit=2)] == ["a", "b"]


def test_load_prompts_limit_covers_every_category(tmp_path):
    rows = [("w", "writing"), ("x", "writing"), ("y", "writing"), ("m", "math"), ("q", "qa"), ("r", "qa")]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [t], "category": c}) + "\n" for t, c in rows))
    assert [p.text for p in load_prompts(path, limit=4)] == ["w", "m", "q", "x"]
    assert [p.text for p in load_prompts(path)] == ["w", "x", "y", "m", "q", "r"]


@pytest.mark.parametrize(
    "name, content, limit, error, message",
    [
        ("missing.jsonl", None, None, FileNotFoundError, "not found"),
        ("empty.jsonl", "\n\n", None, ValueError, "has no prompts"),
        ("empty.txt", "", None, ValueError, "has no prompts"),
        ("other.jsonl", '{"text": "hello"}\n', None, ValueError, "unknown JSONL format"),
        ("empty_turns.jsonl", '{"turns": []}\n', None, ValueError, "unknown JSONL format"),
        ("list.jsonl", "[1, 2]\n", None, ValueError, "unknown JSONL format"),
        ("broken.jsonl", '{"prompt": \n', None, ValueError, "broken.jsonl:1: not JSON"),
        ("records.txt", '{"prompt": "hi"}\n', None, ValueError, "looks like JSON; name the file"),
        ("prompts.txt", "a\n", 0, ValueError, "limit must be a positive integer"),
    ],
)
def test_load_prompts_errors(tmp_path, name, content, limit, error, message):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(error, match=message):
        load_prompts(path, limit=limit)


# ---------------------------------------------------------------- run_benchmark: bad input


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"methods": ["plain", "jacobi"]}, r"Unknown benchmark methods \['jacobi'\]"),
        ({"methods": ["hybrid"], "baseline_ks": [3, 5]}, r"baseline_ks \(--baseline-k\) runs transformers' methods"),
        ({"methods": ["medusa"]}, "Method 'medusa' needs a draft head checkpoint: pass medusa_head="),
        ({"methods": ["eagle3-tree"]}, "Method 'eagle3-tree' needs a draft head checkpoint: pass eagle_head="),
        ({"methods": ["layer-skip"]}, r"Methods \['layer-skip'\] need an exit layer: pass exit_layer="),
        ({"prompts": []}, "No prompts"),
        ({"chat_template": True}, "has no chat template"),
        ({"max_prompt_tokens": 0}, "max_prompt_tokens must be an integer >= 1"),
        ({"num_draft_tokens": 0}, "num_draft_tokens must be an integer >= 1"),
    ],
)
def test_run_benchmark_rejects_bad_input(target, draft, tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        bench(target, draft, tokenizer, **{"verbose": False, **kwargs})


def test_run_benchmark_needs_draft_for_draft_methods(target, tokenizer):
    with pytest.raises(ValueError, match="need a draft model"):
        bench(target, None, tokenizer, methods=["draft-model"], verbose=False)


def test_run_benchmark_rejects_too_many_new_tokens(target, draft, tokenizer):
    with pytest.raises(ValueError, match="leaves no room for a prompt.*lower max_new_tokens"):
        bench(target, draft, tokenizer, max_new_tokens=64, verbose=False)


# ---------------------------------------------------------------- run_benchmark: end to end


@pytest.fixture(scope="module")
def run(target, draft, tokenizer, tmp_path_factory):
    out_path = tmp_path_factory.mktemp("bench") / "results.jsonl"
    result = bench(target, draft, tokenizer, out_path=out_path, verbose=False, methods=RUN_METHODS, exit_layer=1)
    return result, out_path


def test_every_method_reproduces_plain_greedy(run):
    result, _ = run
    assert result.ok and result.mismatches == []
    assert len(result.records) == len(PROMPTS) * len(RUN_METHODS)
    assert all(r["exact"] and r["identical_to_plain"] for r in result.records)


def test_jsonl_records(run, target):
    result, out_path = run
    lines = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert lines == json.loads(json.dumps(result.records))
    assert [(r["prompt_index"], r["method"]) for r in lines] == [(i, m) for i in range(2) for m in RUN_METHODS]
    for r in lines:
        assert r["question_id"] == PROMPTS[r["prompt_index"]].question_id
        assert r["category"] == PROMPTS[r["prompt_index"]].category
        assert r["new_tokens"] == NEW_TOKENS and r["seconds"] > 0 and not r["truncated"]
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["seconds"])
        assert 0 < r["forward_seconds"] < r["seconds"]
        has_stats = r["method"] in speculative_methods()
        assert (r["mean_acceptance_length"] is not None) == has_stats
        assert (r["lossless"] is True) if has_stats else r["lossless"] is None
    plain = [r for r in lines if r["method"] == "plain"]
    assert all(r["num_target_forwards"] == NEW_TOKENS for r in plain)
    provenance = lines[0]["provenance"]
    assert all(r["provenance"] == provenance for r in lines)
    assert provenance["transformers_version"] and provenance["torch_version"] and provenance["timestamp"]
    assert (provenance["device"], provenance["dtype"], provenance["num_threads"]) == ("cpu", "float32", 1)
    assert provenance["cpu_linear"] == "torch"  # a target nobody switched to oneDNN
    run = provenance["run"]
    assert run["settings"]["max_new_tokens"] == NEW_TOKENS and not run["settings"]["do_sample"]
    assert run["methods"]["hf-prompt-lookup"] == {"engine": "transformers", "method": "prompt-lookup",
                                                  "num_draft_tokens": K, "max_ngram_size": 2}
    assert run["methods"]["draft-model"]["num_draft_tokens"] == K
    assert provenance["assistant_config"] == {"num_assistant_tokens_schedule": "constant",
                                              "assistant_confidence_threshold": 0.0}


def test_run_leaves_global_state_alone(run, draft):
    assert torch.get_num_threads() == 1
    assert draft.generation_config.num_assistant_tokens is None
    assert draft.generation_config.assistant_confidence_threshold is None


def test_summary_and_table(run):
    result, _ = run
    assert list(result.summary) == ["qa", "writing", "all"]
    overall = result.summary["all"]
    assert list(overall) == list(RUN_METHODS)
    assert overall["plain"]["speedup"] == 1.0
    assert overall["plain"]["new_tokens"] == 2 * NEW_TOKENS and overall["plain"]["num_prompts"] == 2
    assert overall["hf-assisted"]["mean_acceptance_length"] is None
    assert overall["draft-model"]["mean_acceptance_length"] >= 1.0
    assert all(figures["identical_rate"] == 1.0 for figures in overall.values())
    table = result.table()
    assert all(method in table for method in RUN_METHODS) and "speedup vs plain" in table


def test_oracle_draft_is_fully_accepted_by_both_draft_methods(target, tokenizer, capsys):
    # the draft is the target itself: every draft token is accepted, k per step, if the settings are pinned
    result = bench(target, copy.deepcopy(target), tokenizer, methods=["hf-assisted", "draft-model"])
    assert result.ok
    overall = result.summary["all"]
    assert overall["draft-model"]["mean_acceptance_length"] == K + 1
    assert overall["draft-model"]["acceptance_rate_per_position"] == [1.0] * K
    # transformers' default (threshold 0.4, 20 tokens) would give other counts: 8 tokens in 2 steps of k + 1
    assert all(r["num_target_forwards"] == 2 for r in result.records if r["method"] == "hf-assisted")
    assert "mean acceptance length" in capsys.readouterr().out


def test_mismatch_is_reported(target, draft, tokenizer, monkeypatch, capsys):
    make_kwargs = bench_run.generate_kwargs

    def broken_prompt_lookup(method, *args):
        kwargs = make_kwargs(method, *args)
        if method.engine == "hf_speculators" and method.config.method == "prompt-lookup":  # forbid every token but one: the output can no longer match plain greedy
            kwargs["suppress_tokens"] = [t for t in range(target.config.vocab_size) if t != 5]
        return kwargs

    monkeypatch.setattr(bench_run, "generate_kwargs", broken_prompt_lookup)
    result = bench(target, draft, tokenizer, methods=["prompt-lookup"])
    assert not result.ok
    assert [(r["method"], r["prompt_index"]) for r in result.mismatches] == [("prompt-lookup", 0), ("prompt-lookup", 1)]
    assert result.summary["all"]["prompt-lookup"]["identical_rate"] == 0.0
    assert "MISMATCH: prompt-lookup differs from plain greedy on prompt 0 (question_id=81" in capsys.readouterr().out


def test_long_prompts_keep_their_last_tokens(target, tokenizer):
    result = bench(target, None, tokenizer, prompts=["the cat sat on a mat"], methods=["prompt-lookup"],
                   max_prompt_tokens=3, verbose=False)
    assert all(r["truncated"] and r["prompt_tokens"] == 3 for r in result.records)
    assert result.records[0]["category"] == "all" and result.records[0]["question_id"] is None


def test_chat_template_wraps_the_prompt(target, tokenizer):
    chat_tokenizer = copy.deepcopy(tokenizer)
    chat_tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %} then{% endif %}"
    )
    result = bench(target, None, chat_tokenizer, prompts=["the cat"], methods=[], chat_template=True, verbose=False)
    assert result.records[0]["prompt_tokens"] == 3  # "the cat" + " then" from the template


def test_summarize_pools_totals():
    def record(category, method, tokens, seconds, accepted=None):
        keys = ("num_drafts", "num_accepted_tokens", "drafted_per_position", "accepted_per_position",
                "num_drafted_tokens", "draft_time")
        values = (2, accepted, [2, 1], [accepted, 0], 3, 0.03) if accepted is not None else (None,) * len(keys)
        return {"category": category, "method": method, "new_tokens": tokens, "seconds": seconds,
                "forward_seconds": 0.9 * seconds, "identical_to_plain": True, **dict(zip(keys, values))}

    records = [record("a", "plain", 10, 1.0), record("b", "plain", 30, 1.0),
               record("a", "prompt-lookup", 10, 0.5, accepted=2), record("b", "prompt-lookup", 30, 1.5, accepted=0)]
    summary = summarize(records)
    assert summary["all"]["plain"]["tokens_per_s"] == 20.0  # total tokens / total seconds, not a mean of rates
    assert summary["all"]["prompt-lookup"]["speedup"] == 1.0
    assert summary["a"]["prompt-lookup"]["speedup"] == 2.0
    assert summary["all"]["prompt-lookup"]["mean_acceptance_length"] == 1.5  # 1 + 2 accepted / 4 drafts
    assert summary["all"]["prompt-lookup"]["acceptance_rate_per_position"] == [0.5, 0.0]
    assert summary["all"]["plain"]["mean_acceptance_length"] is None
    assert summary["all"]["plain"]["outside_forwards"] == pytest.approx(0.1)
    # 0.06 s for 6 draft tokens = 0.01 s per draft token; plain takes 1 / 20 s per token
    assert summary["all"]["prompt-lookup"]["draft_cost_ratio"] == pytest.approx(0.2)
    assert summary["all"]["plain"]["draft_cost_ratio"] is None


def test_the_compiled_lead_kept_divides_the_compiled_lead_by_the_eager_one():
    records = [{"category": "all", "method": method, "new_tokens": 60, "seconds": seconds, "forward_seconds": None,
                "identical_to_plain": True, "num_drafts": None}
               for method, seconds in (("plain", 3.0), ("plain-compiled", 2.0), ("hybrid", 1.5), ("hybrid[eager]", 1.0))]
    figures = summarize(records)["all"]
    # compiled lead 2.0 / 1.5, eager lead 3.0 / 1.0: it keeps (4 / 3) / 3 of it
    assert figures["hybrid"]["lead_kept"] == pytest.approx(4 / 9)
    assert figures["hybrid[eager]"]["lead_kept"] is None and figures["plain"]["lead_kept"] is None


def test_summaries_add_the_best_k_per_category_and_the_floors_share_of_plain_steps():
    def record(category, method, seconds, floor_steps=None):
        stats = {"num_drafts": None} if floor_steps is None else {
            "num_drafts": 1, "num_accepted_tokens": 1, "drafted_per_position": [1], "accepted_per_position": [1],
            "num_drafted_tokens": 1, "draft_time": 0.0, "draft_lengths": [floor_steps, 10 - floor_steps],
            "num_floor_steps": floor_steps}
        return {"category": category, "method": method, "new_tokens": 10, "seconds": seconds, "forward_seconds": 0.0,
                "identical_to_plain": True, **stats}

    records = [record("a", "plain", 1.0), record("b", "plain", 1.0),
               record("a", "hf-prompt-lookup[k=3]", 0.5), record("b", "hf-prompt-lookup[k=3]", 1.0),
               record("a", "hf-prompt-lookup[k=8]", 0.8), record("b", "hf-prompt-lookup[k=8]", 0.4),
               record("a", "hybrid", 0.5, floor_steps=0), record("b", "hybrid", 1.0, floor_steps=5)]
    summary = summarize(records)
    assert summary["a"]["hf-prompt-lookup[best k]"]["best_k"] == 3
    assert summary["b"]["hf-prompt-lookup[best k]"]["best_k"] == 8
    assert summary["b"]["hf-prompt-lookup[best k]"]["speedup"] == 2.5
    assert summary["b"]["hybrid"]["floor_share"] == 0.5 and summary["all"]["hybrid"]["floor_share"] == 0.25
    assert "hybrid[best k]" not in summary["all"]  # one length only


def test_the_hybrids_held_model_steps_are_summarized_and_shown_only_for_a_hybrid():
    from hf_speculators.tools.bench.summaries import BenchmarkResult

    def record(method, figures=None):
        stats = {"num_drafts": None} if figures is None else {
            "num_drafts": 1, "num_accepted_tokens": 1, "drafted_per_position": [1], "accepted_per_position": [1],
            "num_drafted_tokens": 1, "draft_time": 0.0, "draft_lengths": [0, 1], "drafter_stats": figures}
        return {"category": "a", "method": method, "new_tokens": 10, "seconds": 1.0, "forward_seconds": 0.0,
                "identical_to_plain": True, **stats}

    hybrid = [{"model": {"steps": 6, "held_steps": 2}}, {"model": {"steps": 0, "held_steps": 0}}, {}]  # {}: a row
    records = [record("plain"), record("draft-model", {})] + [record("hybrid", figures) for figures in hybrid]
    summary = summarize(records)
    assert summary["all"]["hybrid"]["model_held_share"] == 0.25
    assert summary["all"]["draft-model"]["model_held_share"] is None
    title = "share of the hybrid's model row-steps its floor held back"
    assert title in BenchmarkResult(records, summary, []).table()
    assert title not in BenchmarkResult(records[:2], summarize(records[:2]), []).table()


def test_compare_floor_runs_the_other_side_of_each_methods_default():
    """Prompt lookup runs with the loop's floor by default, so also without it; the hybrid, which has a floor of its
    own and runs without the loop's by default, also with it."""
    chosen = named_methods(["prompt-lookup", "hybrid"], compare_floor=True, draft_model="d", variants=[(3, "goodput")])
    floors = {label: m.plain_floor for label, m in chosen.items()}
    assert floors == {"prompt-lookup[goodput,k<=3]": None, "prompt-lookup[goodput,k<=3][no floor]": False,
                      "hybrid[goodput,k<=3]": None, "hybrid[goodput,k<=3][loop floor]": True}
    assert chosen["hybrid[goodput,k<=3][loop floor]"].config == chosen["hybrid[goodput,k<=3]"].config


def test_variants_run_each_method_side_by_side_against_one_plain_baseline(target, draft, tokenizer):
    result = bench(target, draft, tokenizer, methods=["hf-prompt-lookup", "draft-model"], verbose=False,
                   variants=[(1, "constant"), (3, "constant"), (3, "goodput"), (2, "heuristic")])
    names = ["plain", "hf-prompt-lookup[k=1]", "hf-prompt-lookup[k=3]", "draft-model[k=1]", "draft-model[k=3]",
             "draft-model[goodput,k<=3]", "draft-model[heuristic,k=2]"]
    # transformers' method: once per constant variant; each method run at several constant k: its best k too
    assert list(result.summary["all"]) == names + ["hf-prompt-lookup[best k]", "draft-model[best k]"]
    assert result.ok and len(result.records) == len(names) * len(PROMPTS)
    by_name = {r["method"]: r for r in result.records if r["prompt_index"] == 0}
    assert len(by_name["draft-model[k=1]"]["draft_lengths"]) == 2  # asked for 0 or 1 tokens
    assert by_name["plain"]["draft_lengths"] is None
    assert all(r["num_steps_without_draft"] is not None for r in result.records if r["method"].startswith("draft"))
    assert result.summary["all"]["draft-model[k=3]"]["mean_draft_length"] <= 3
    methods = result.records[0]["provenance"]["run"]["methods"]
    assert methods["draft-model[goodput,k<=3]"]["num_draft_tokens_schedule"] == "goodput"
    assert methods["hf-prompt-lookup[k=3]"]["num_draft_tokens"] == 3


@pytest.mark.parametrize(("variants", "message"), [([(0, "constant")], "num_draft_tokens must be an integer >= 1"),
                                                   ([(3, "adaptive")], "num_draft_tokens_schedule must be one of")])
def test_bad_variants_raise_before_any_run(target, draft, tokenizer, variants, message):
    with pytest.raises(ValueError, match=message):
        bench(target, draft, tokenizer, methods=["draft-model"], verbose=False, variants=variants)


def test_cli_variants_parse():
    args = cli.build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--variants", "1,2,goodput:6"])
    assert args.variants == [(1, "constant"), (2, "constant"), (6, "goodput")]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["bench", "--prompts", "p.jsonl", "--variants", "goodput:x"])


# ---------------------------------------------------------------- half precision: near-ties apart from mismatches


@pytest.mark.parametrize("dtype, tied, expected", [(torch.bfloat16, True, "near-tie"), (torch.bfloat16, False, "mismatch"),
                                                    (torch.float32, True, "mismatch")])
def test_a_first_divergence_at_a_near_tie_is_not_a_mismatch_in_half_precision(dtype, tied, expected):
    model = tiny_llama(2, seed=0).to(dtype)
    prompt = torch.tensor([[5, 6, 7]])
    logits = model(prompt).logits[0, -1]
    best, second = logits.float().topk(2).indices.tolist()
    if tied:  # the second-best token's output row made the best's: their logits tie exactly
        with torch.no_grad():
            model.lm_head.weight[second] = model.lm_head.weight[best]
    batch = Batch([0], prompt, None, [3], [False])
    plain = TimedRun(torch.tensor([best, 9]), 1.0, 2, 0.5, None)
    other = TimedRun(torch.tensor([second, 9]), 1.0, 2, 0.5, None)
    assert bench_run._divergence(model, batch, 0, other, plain, exact=True) == expected
    assert bench_run._divergence(model, batch, 0, plain, plain, exact=True) is None
    assert bench_run._divergence(model, batch, 0, other, plain, exact=False) is None


@pytest.mark.parametrize("case", DRAFT_CASES)
def test_the_bench_times_every_drafters_draft_forwards(zoo, case):
    """`timed_modules` holds what each drafter runs outside the target's forward (`Drafter.draft_modules`): the
    bench once missed MTP's, DFlash's and the hybrid's draft forwards (it looked for a few attribute names)."""
    target, drafter = DRAFT_CASES[case](zoo)
    modules, depth, outside = timed_modules(target, {"candidate_generator": drafter}), [0], []

    def enter(module, args):
        depth[0] += module is target
        outside.append(depth[0] == 0 and module is not target)

    def leave(module, args, output):
        depth[0] -= module is target

    hooks = [h for m in modules for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        speculative_generate(target, prompt_ids("random"), drafter, max_new_tokens=8)
    finally:
        for hook in hooks:
            hook.remove()
    assert modules[0] is target
    assert any(outside) == (case != "prompt_lookup")


def test_the_warm_up_leaves_no_cross_call_memory(target, draft, tokenizer):
    """The warm-up runs the first prompt: suffix decoding must not then draft that prompt from its own output."""
    keys = ("num_accepted_tokens", "draft_lengths")
    remembered, memoryless = (
        bench(target, draft, tokenizer, prompts=PROMPTS[:1], methods=["suffix"], **extra).records[-1]
        for extra in ({}, {"max_cached_requests": 0}))
    assert remembered["method"] == "suffix"
    assert {key: remembered[key] for key in keys} == {key: memoryless[key] for key in keys}


def test_compile_runs_every_method_compiled_beside_plain_compiled(target, draft, tokenizer, monkeypatch):
    """`compile=True`: plain-compiled and every method get the static cache and the compile config (dynamo's
    "eager" backend here: graphs captured as under inductor, in seconds), plain stays eager, outputs stay exact;
    our warm-up calls run inside `Drafter.memory_kept`, the timed ones outside, and no timed call compiles a graph
    (the warm-up runs the batch itself until nothing compiles: on random tokens, the draft model's greedy chain
    compiled in a timed call)."""
    from contextlib import contextmanager

    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    from hf_speculators.drafters.base import Drafter
    from hf_speculators.tools.bench import engines

    def eager_backend(model):
        kwargs = engines.compiled_kwargs(model)
        config = CompileConfig(backend="eager", mode=None)
        config._compile_all_devices = kwargs["compile_config"]._compile_all_devices
        return {**kwargs, "compile_config": config}

    calls, timed = [], bench_run.timed_generate  # per generate call: (one of ours, with a static cache)
    kept, inside = [], [False]  # per call of ours: inside `memory_kept`
    warming, warm_up, warmed = [False], bench_run._compiled_warm_up, []  # the batches the warm-up calls ran
    timed_calls = []  # per timed call: (graphs it compiled, whether a warm-up call ran its batch)

    def warm(*args):
        warming[0] = True
        warm_up(*args)
        warming[0] = False

    def recorded(target, batch, kwargs, settings):
        calls.append(("candidate_generator" in kwargs, kwargs.get("cache_implementation") == "static"))
        kept.extend(inside if calls[-1][0] else [])
        if warming[0]:
            warmed.append(batch.input_ids)
            return timed(target, batch, kwargs, settings)
        graphs = counters["stats"]["unique_graphs"]
        run = timed(target, batch, kwargs, settings)
        timed_calls.append((counters["stats"]["unique_graphs"] - graphs,
                            any(torch.equal(ids, batch.input_ids) for ids in warmed)))
        return run

    @contextmanager
    def memory_kept(self):
        inside[0] = True
        yield
        inside[0] = False

    monkeypatch.setattr(Drafter, "memory_kept", memory_kept)
    monkeypatch.setattr(bench_run, "compiled_kwargs", eager_backend)
    monkeypatch.setattr(bench_run, "timed_generate", recorded)
    monkeypatch.setattr(bench_run, "_compiled_warm_up", warm)
    torch._dynamo.reset()
    result = bench(target, draft, tokenizer, verbose=False, methods=["draft-model", "hf-assisted"], compile=True,
                   compare_eager=True)
    assert {(True, True), (True, False)} <= set(calls)  # draft-model compiled and draft-model[eager]
    assert kept.count(True) >= kept.count(False) > 0  # warm-up calls before each timed one
    assert timed_calls and set(timed_calls) == {(0, True)}  # warmed up on its own batch, nothing compiled while timed
    assert result.ok and all(r["identical_to_plain"] for r in result.records)
    baselines = ["hf-assisted"] if bench_run.STATIC_ASSISTED else []  # 5.23: skipped, with its reason
    assert list(result.summary["all"]) == ["plain", "plain-compiled", *baselines, "draft-model", "draft-model[eager]"]
    assert bench_run.STATIC_ASSISTED or "hf-assisted" in result.skipped
    assert result.summary["all"]["plain-compiled"]["speedup_vs_compiled"] == pytest.approx(1.0)
    assert all(r["forward_seconds"] is None for r in result.records)  # no hooks in compiled forwards
    assert counters["stats"]["unique_graphs"] >= 2  # plain-compiled's graph and our step graph
    assert result.summary["all"]["draft-model"]["lead_kept"] > 0
    assert result.summary["all"]["plain-compiled"]["lead_kept"] is None  # it has no eager counterpart
    assert "speedup vs plain-compiled" in result.table() and "compiled lead kept" in result.table()


def test_held_out_prompts_are_three_kinds_of_text_the_bench_reads(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("held_out_prompts", EXAMPLES / "held_out_prompts.py")
    held_out = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(held_out)
    out = tmp_path / "held_out.jsonl"
    monkeypatch.setattr(sys, "argv", ["held_out_prompts.py", "--out", str(out), "--per-kind", "3"])
    held_out.main()
    prompts = load_prompts(out)
    assert [p.category for p in prompts] == ["code"] * 3 + ["docs"] * 3 + ["readme"] * 3
    assert all(len(p.text) >= held_out.MIN_CHARS // 3 for p in prompts)
    assert any(p.text.startswith(("def ", "    def ", "async def ")) for p in prompts if p.category == "code")
    assert held_out.held_out_records(3, 0) == held_out.held_out_records(3, 0)  # seeded


def test_records_named_gz_are_written_gzip_compressed_and_resumed(tmp_path):
    from hf_speculators.tools.bench.records import RecordWriter, read_records

    run = {"methods": ["prompt-lookup"], "skipped_methods": []}
    record = lambda i, method: {"batch_index": i, "batch_rows": 1, "method": method, "category": "c",  # noqa: E731
                                "new_tokens": 4, "seconds": 0.1, "provenance": {"run": run}}
    path = tmp_path / "run.jsonl.gz"
    with RecordWriter(path, run, resume=False) as writer:
        for r in (record(0, "plain"), record(0, "prompt-lookup"), record(1, "plain")):
            writer.write(r)
    assert gzip.decompress(path.read_bytes())  # a gzip file, as its name says
    assert [r["method"] for r in read_records(path)] == ["plain", "prompt-lookup", "plain"]
    path.write_bytes(path.read_bytes() + gzip.compress(b'{"cut')[:12])  # a member a killed process left
    with RecordWriter(path, run, resume=True) as writer:
        assert [(r["batch_index"], r["method"]) for r in writer.done] == [(0, "plain"), (0, "prompt-lookup")]
    assert len(read_records(path)) == 2
