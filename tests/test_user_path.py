"""Tests of what a user meets first: device and dtype defaults, chat templates, repeated generate calls with a
speculative config, a quiet run, the presets table and export, and the benchmark figure."""

import copy
import gc
import gzip
import json
import logging
import shlex
import subprocess
import sys
import warnings
import weakref
from contextlib import contextmanager
from pathlib import Path

import huggingface_hub.utils
import pytest
import torch

torch.set_num_threads(1)

from transformers import GenerationConfig  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

import hf_speculators as hs  # noqa: E402
from hf_speculators import loading  # noqa: E402
from hf_speculators.config import build  # noqa: E402
from hf_speculators.tools import cli  # noqa: E402
from hf_speculators.tools.bench import BenchSettings, run_benchmark  # noqa: E402
from hf_speculators.prompts import encode_prompt, use_chat_template  # noqa: E402
from hf_speculators.decoding import BUILT_ATTRIBUTE  # noqa: E402
from hf_speculators.loading import load_model, load_tokenizer, resolve_device, resolve_dtype  # noqa: E402
from hf_speculators.onednn_linear import onednn_available  # noqa: E402
from hf_speculators.tools.bench import read_records  # noqa: E402
from hf_speculators.tools.plots import plot_benchmark  # noqa: E402
from hf_speculators.config.presets import bundled_presets, card_results  # noqa: E402
from hf_speculators.tools.quiet import quiet_third_party  # noqa: E402
from hf_speculators.config.vllm_export import to_vllm_with_notes  # noqa: E402
from speculative_helpers import transformers_warnings  # noqa: E402
from tiny_models import build_draft, build_target, build_tokenizer  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PACKAGE = Path(hs.__file__).resolve().parent
PROMPT = "def(x):return(x+1)*2;def(y):return(y"
NEW_TOKENS = 8
CHAT_TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, str]:
    """The tiny Llama target and draft saved with the character tokenizer (no chat template), and a copy of the
    target whose tokenizer has one."""
    root = tmp_path_factory.mktemp("user_path")
    paths = {name: str(root / name) for name in ("target", "draft", "chat-target")}
    for name, model in (("target", build_target("llama")), ("draft", build_draft("llama")),
                        ("chat-target", build_target("llama"))):
        model.save_pretrained(paths[name])
        tokenizer = build_tokenizer()
        tokenizer.chat_template = CHAT_TEMPLATE if name == "chat-target" else None
        tokenizer.save_pretrained(paths[name])
    return paths


@pytest.fixture(scope="module")
def tokenizer(saved):
    return load_tokenizer(saved["target"])


@pytest.fixture(scope="module")
def chat_tokenizer(saved):
    return load_tokenizer(saved["chat-target"])


@pytest.fixture
def target(saved):
    """A private enabled target: tests keep builds on it."""
    return hs.enable(load_model(saved["target"]))


def draft_config(saved, **settings) -> hs.SpeculativeConfig:
    return hs.SpeculativeConfig(method="draft-model", draft_model=saved["draft"], num_draft_tokens=3,
                                target_model=saved["target"], **settings)


def prompt_inputs(tokenizer):
    return tokenizer(PROMPT, return_tensors="pt")


# ---------------------------------------------------------------- device and dtype


@pytest.mark.parametrize("cuda, mps, expected", [(True, True, "cuda"), (False, True, "mps"), (False, False, "cpu")])
def test_auto_device_prefers_cuda_then_mps_then_cpu(monkeypatch, cuda, mps, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2 if cuda else 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert resolve_device("auto") == expected
    assert resolve_device("cpu") == "cpu"  # a chosen device stays, once checked
    if cuda:
        assert resolve_device("cuda:1") == "cuda:1"
    else:
        with pytest.raises(ValueError, match=r"device 'cuda:1' is not available: .* Use device 'cpu' or 'auto'"):
            resolve_device("cuda:1")


def test_auto_dtype_is_the_checkpoints_on_an_accelerator_and_float32_on_a_cpu():
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "cuda:1") == resolve_dtype("auto", "mps") == "auto"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match=r"Unknown dtype 'fp64': choose one of"):
        resolve_dtype("fp64", "cpu")


def test_cli_resolves_auto_once_for_every_model_command(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for argv in (["generate", "x"], ["bench", "--prompts", "p.txt"], ["sweep", "--prompts", "p.txt"]):
        args = cli.build_parser().parse_args(argv)
        assert (args.device, args.dtype) == ("auto", "auto")
        cli._placement(args)
        assert (args.device, args.dtype) == ("cuda", "auto")


def test_models_load_straight_onto_their_device(monkeypatch, saved):
    """from_pretrained places the weights (device_map): nothing is staged in CPU memory and moved afterwards."""
    calls = []

    class Loaded:
        def eval(self):
            return self

        def to(self, *args, **kwargs):
            raise AssertionError("the model was moved after loading")

    def from_pretrained(name, **kwargs):
        calls.append(kwargs)
        return Loaded()

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    load_model(saved["target"], "auto", "cuda:1")
    assert calls[0]["device_map"] == {"": "cuda:1"} and calls[0]["dtype"] == "auto"


# ---------------------------------------------------------------- chat template


def test_chat_is_on_when_the_tokenizer_has_a_template(tokenizer, chat_tokenizer):
    assert use_chat_template(chat_tokenizer, None) is True
    assert use_chat_template(tokenizer, None) is False
    assert use_chat_template(chat_tokenizer, False) is False


def test_the_chat_template_wraps_the_prompt_with_a_system_turn_and_a_generation_prompt(chat_tokenizer):
    ids = encode_prompt(chat_tokenizer, "hi", chat=True, system_prompt="be-brief").input_ids
    assert chat_tokenizer.decode(ids[0]) == "[system]be-brief[user]hi[assistant]"
    assert chat_tokenizer.decode(encode_prompt(chat_tokenizer, "hi", chat=False).input_ids[0]) == "hi"


@pytest.mark.parametrize("chat, system, message", [
    (True, None, r"chat_template=True \(--chat\) needs a chat template, and the tokenizer has no chat template"),
    (None, "be-brief", r"a system prompt \(--system\) needs a chat template"),
])
def test_chat_without_a_template_is_a_clear_error(tokenizer, chat, system, message):
    with pytest.raises(ValueError, match=message):
        use_chat_template(tokenizer, chat, system)


def test_a_system_prompt_with_no_chat_is_a_clear_error(chat_tokenizer):
    with pytest.raises(ValueError, match=r"A system prompt \(--system\) goes into the chat template: drop --no-chat"):
        use_chat_template(chat_tokenizer, False, "be-brief")


def test_the_benchmark_applies_the_template_by_default_when_asked_for_auto(saved, chat_tokenizer):
    target = load_model(saved["chat-target"])
    for system, expected in ((None, "[user]ab[assistant]"), ("s", "[system]s[user]ab[assistant]")):
        settings = BenchSettings(max_new_tokens=NEW_TOKENS, chat_template=None, system_prompt=system, verbose=False)
        result = run_benchmark(target, chat_tokenizer, ["ab"], {}, settings)
        assert result.records[0]["prompt_tokens"] == len(expected)
        assert result.records[0]["provenance"]["run"]["settings"]["chat_template"] is True


def test_cli_chat_on_a_tokenizer_without_a_template_fails_before_loading(saved, capsys, monkeypatch):
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: pytest.fail("loaded a model before the check"))
    for command in (["generate", PROMPT], ["bench", "--prompts", __file__], ["sweep", "--prompts", __file__]):
        assert cli.main([*command, "--model", saved["target"], "--draft", saved["draft"], "--chat"]) == 2
        assert "needs a chat template" in capsys.readouterr().err


# ---------------------------------------------------------------- drafter reuse across generate calls


def counting_loads(monkeypatch) -> list[str]:
    loads = []

    def counted(name, *args, **kwargs):
        loads.append(name)
        return load_model(name, *args, **kwargs)

    monkeypatch.setattr(build, "load_model", counted)
    return loads


def test_a_speculative_config_builds_its_drafter_once(saved, target, tokenizer, monkeypatch):
    loads = counting_loads(monkeypatch)
    config, inputs = draft_config(saved), prompt_inputs(tokenizer)
    plain = target.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    outputs = [target.generate(**inputs, speculative_config=config, max_new_tokens=NEW_TOKENS) for _ in range(3)]
    assert loads == [saved["draft"]]
    assert all(torch.equal(out, plain) for out in outputs)  # the reused drafter starts afresh on each call
    first = getattr(target, BUILT_ATTRIBUTE).drafter
    target.generate(**inputs, speculative_config=copy.deepcopy(config), max_new_tokens=NEW_TOKENS)  # equal settings
    assert getattr(target, BUILT_ATTRIBUTE).drafter is first and len(loads) == 1


def test_a_changed_config_tokenizer_or_model_rebuilds(saved, target, tokenizer, monkeypatch):
    loads = counting_loads(monkeypatch)
    config, inputs = draft_config(saved), prompt_inputs(tokenizer)
    target.generate(**inputs, speculative_config=config, max_new_tokens=NEW_TOKENS)
    first = getattr(target, BUILT_ATTRIBUTE).drafter
    config.num_draft_tokens = 2  # configs are mutable: the build follows the fields, not the object
    target.generate(**inputs, speculative_config=config, max_new_tokens=NEW_TOKENS)
    second = getattr(target, BUILT_ATTRIBUTE).drafter
    assert second is not first and second.num_draft_tokens == 2
    target.generate(**inputs, speculative_config=config, max_new_tokens=NEW_TOKENS, tokenizer=tokenizer)
    assert getattr(target, BUILT_ATTRIBUTE).drafter is not second
    other = hs.enable(load_model(saved["target"]))
    other.generate(**inputs, speculative_config=config, max_new_tokens=NEW_TOKENS)
    assert getattr(other, BUILT_ATTRIBUTE).drafter is not getattr(target, BUILT_ATTRIBUTE).drafter
    assert len(loads) == 4


@pytest.mark.parametrize("settings", [{"method": "draft-model"}, {"method": "layer-skip", "exit_layer": 1}])
def test_nothing_keeps_the_model_alive(saved, tokenizer, settings):
    """Layer skip's drafter holds the target itself: the build must not outlive the model either way."""
    model = hs.enable(load_model(saved["target"]))
    config = draft_config(saved).override(**settings) if settings["method"] == "draft-model" else \
        hs.SpeculativeConfig(num_draft_tokens=2, **settings)
    model.generate(**prompt_inputs(tokenizer), speculative_config=config, max_new_tokens=NEW_TOKENS)
    assert getattr(model, BUILT_ATTRIBUTE) is not None
    model_ref, drafter_ref = weakref.ref(model), weakref.ref(getattr(model, BUILT_ATTRIBUTE).drafter)
    del model
    gc.collect()
    assert model_ref() is None and drafter_ref() is None


# ---------------------------------------------------------------- a quiet run


@contextmanager
def warnings_from_our_code():
    """Collects the Python warnings attributed to a file of the hf_speculators package: ours, and third-party
    deprecation warnings whose stack level points at the call we made."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = []
        yield ours
    ours += [w for w in caught if Path(w.filename).resolve().is_relative_to(PACKAGE)]


def test_the_collectors_catch_what_they_look_for(saved):
    with warnings_from_our_code() as ours:
        hs.SpeculativeConfig.from_dict({"method": "prompt-lookup", "no_such_field": 1})
    assert any("no_such_field" in str(w.message) for w in ours)
    with transformers_warnings() as logged:
        transformers_logging.get_logger("transformers.generation.utils").warning_once("a warning")
    assert [r.getMessage() for r in logged] == ["a warning"]


@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning, FutureWarning])
def test_deprecation_warnings_attributed_to_our_modules_fail_the_suite(category):
    """pyproject.toml's filterwarnings: the whole suite runs with these as errors."""
    with pytest.raises(category):
        warnings.warn_explicit("deprecated", category, "decoding.py", 1, module="hf_speculators.decoding")
    with warnings.catch_warnings(record=True):  # a third-party module's own warning stays a warning
        warnings.warn_explicit("deprecated", category, "x.py", 1, module="torch.x")


def test_our_public_paths_cause_no_warning(saved, target, tokenizer):
    config, inputs = draft_config(saved), prompt_inputs(tokenizer)
    stop = GenerationConfig(stop_strings=["zz"], do_sample=False)  # replaced by a copy: the case that once warned
    with warnings_from_our_code() as ours, transformers_warnings() as logged:
        config.build(target, tokenizer)
        hs.enable(target).generate(**inputs, speculative_config=config, max_new_tokens=NEW_TOKENS)
        target.generate(**inputs, candidate_generator=hs.PromptLookupDrafter(), max_new_tokens=NEW_TOKENS,
                        generation_config=stop, tokenizer=tokenizer)
        target.generate(**inputs, custom_generate=hs.generate, candidate_generator=hs.DraftModelDrafter(
            build_draft("llama")), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert [str(w.message) for w in ours] == [] and [r.getMessage() for r in logged] == []


def quiet_state() -> tuple:
    return (logging.getLogger("torchao").level, transformers_logging.get_verbosity(),
            transformers_logging.is_progress_bar_enabled(), huggingface_hub.utils.are_progress_bars_disabled())


def test_quiet_hides_third_party_logs_and_loading_bars_and_restores_them():
    before = quiet_state()
    with quiet_third_party(verbose=True):
        assert quiet_state() == before
    with quiet_third_party():
        assert quiet_state() == (logging.ERROR, logging.ERROR, False, before[3])  # download bars keep their setting
    assert quiet_state() == before


def test_cli_generate_prints_nothing_on_stderr(saved):
    """A fresh process: torchao's messages come once per process, when transformers first imports it."""
    command = [sys.executable, "-m", "hf_speculators.tools.cli", "generate", PROMPT, "--model", saved["target"], "--draft",
               saved["draft"], "--max-new-tokens", str(NEW_TOKENS), "--threads", "1"]
    run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    assert run.stdout.count("device: cpu, dtype: float32") == 1 and "identical to plain greedy: yes" in run.stdout


# ---------------------------------------------------------------- presets table, card and export


def test_measured_figures_are_the_ones_the_cards_state():
    measured = 0
    for name, folder in bundled_presets().items():
        results = card_results(folder / "README.md")
        if results is None:
            continue
        measured += 1
        source = hs.SpeculativeConfig.from_pretrained(name).source
        assert f"{results['speedup']:.2f}x" in source and f"{results['mean_acceptance_length']:.2f}" in source
        assert results["hardware"] in source and results["command"].startswith("hf-speculators ")
    assert measured >= 5


def test_presets_show_prints_the_whole_card(capsys):
    assert cli.main(["presets", "show", "demo-prompt-lookup"]) == 0
    card = bundled_presets()["demo-prompt-lookup"] / "README.md"
    assert capsys.readouterr().out == card.read_text(encoding="utf-8")
    assert cli.main(["presets", "show", "no-such-preset"]) == 2
    assert "No bundled preset 'no-such-preset': choose one of demo-draft-model" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["demo-prompt-lookup", "demo-draft-model"])
def test_export_prints_the_vllm_command_and_python_call(name, capsys):
    assert cli.main(["export", name, "--to", "vllm"]) == 0
    out = capsys.readouterr().out
    config = hs.SpeculativeConfig.from_pretrained(name)
    target = loading.resolve_model_id(config.target_model)
    exported, notes = to_vllm_with_notes(config)
    (serve,) = [line for line in out.splitlines() if line.startswith("vllm serve ")]
    words = shlex.split(serve)
    assert words[:3] == ["vllm", "serve", target] and words[3] == "--speculative-config"
    assert json.loads(words[4]) == exported
    assert f"llm = LLM(model={target!r}, speculative_config={exported!r})" in out
    # a goodput schedule (demo-draft-model) has no vLLM equivalent: the output says what vLLM runs instead
    assert all(f"# note: {note}" in out for note in notes) and bool(notes) == (name == "demo-draft-model")


@pytest.mark.parametrize("name, message", [("demo-layer-skip", "method='layer-skip' has no vLLM equivalent"),
                                           ("demo-draft-model-typical", "verification='typical' is relaxed")])
def test_export_of_a_config_vllm_cannot_run_is_a_clear_error(name, message, capsys):
    assert cli.main(["export", name, "--to", "vllm"]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------- the benchmark figure


def test_bench_plot_and_plot_draw_the_records(saved, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{PROMPT}\n{PROMPT[::-1]}\n", encoding="utf-8")
    records, first, second = tmp_path / "bench.jsonl", tmp_path / "bench.png", tmp_path / "again" / "plot.png"
    assert cli.main(["bench", "--prompts", str(prompts), "--model", saved["target"], "--draft", saved["draft"],
                     "--methods", "prompt-lookup,draft-model", "--max-new-tokens", str(NEW_TOKENS), "--out",
                     str(records), "--plot", str(first), "--cpu-linear", "torch"]) == 0
    assert read_records(records)[0]["provenance"]["cpu_linear"] == "torch"
    assert cli.main(["plot", str(records), "--out", str(second)]) == 0
    for path in (first, second):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot: {second}" in capsys.readouterr().out
    assert len(read_records(records)) == 2 * 3  # two prompts, plain and two methods
    packed = tmp_path / "records.jsonl.gz"
    packed.write_bytes(gzip.compress(records.read_bytes()))
    assert read_records(packed) == read_records(records)  # records kept gzip-compressed read the same


def test_bench_runs_a_preset_as_generate_does_and_refuses_one_made_for_another_target(saved, tmp_path, capsys):
    card = draft_config(saved).override(num_draft_tokens=2).save_pretrained(tmp_path / "tiny-draft-k2")
    prompts, records = tmp_path / "prompts.txt", tmp_path / "bench.jsonl"
    prompts.write_text(f"{PROMPT}\n", encoding="utf-8")
    command = ["bench", "--prompts", str(prompts), "--max-new-tokens", str(NEW_TOKENS), "--out", str(records),
               "--methods", "plain", "--presets", str(card.parent)]
    assert cli.main([*command, "--model", saved["target"]]) == 0
    ran = {record["method"]: record for record in read_records(records)}
    assert set(ran) == {"plain", "tiny-draft-k2"}  # labelled by the card's folder
    assert "num_draft_tokens=2" in ran["tiny-draft-k2"]["drafter"] and ran["tiny-draft-k2"]["identical_to_plain"]
    assert ran["plain"]["provenance"]["cpu_linear"] == ("onednn" if onednn_available() else "torch")  # the default
    capsys.readouterr()
    assert cli.main([*command, "--model", saved["chat-target"]]) == 2
    assert f"was made for target_model={saved['target']!r}" in capsys.readouterr().err
    clash = draft_config(saved).save_pretrained(tmp_path / "draft-model").parent
    assert cli.main([*command[:-4], "--methods", "draft-model", "--presets", str(clash), "--model", saved["target"]]) == 2
    assert "--presets and --methods both run ['draft-model']" in capsys.readouterr().err


def test_plot_benchmark_takes_records_in_memory(tmp_path):
    record = {"method": "plain", "category": "all", "new_tokens": 4, "seconds": 1.0, "num_drafts": None,
              "forward_seconds": 0.5, "identical_to_plain": True, "draft_time": None}
    fast = {**record, "method": "prompt-lookup", "seconds": 0.5, "num_drafts": 2, "num_accepted_tokens": 2,
            "drafted_per_position": [2], "accepted_per_position": [2], "num_drafted_tokens": 2, "draft_time": 0.1}
    plot_benchmark([record, fast], tmp_path / "figure.svg")
    assert (tmp_path / "figure.svg").read_text(encoding="utf-8").lstrip().startswith("<?xml")


@pytest.mark.parametrize("text, message", [
    ("not json\n", r"records.jsonl:1: not JSON"),
    ('{"verifier": "ExactVerifier()", "new_tokens": 3}\n', r"records.jsonl:1: not a benchmark record"),
    ("\n", r"records.jsonl holds no records"),
])
def test_bad_records_files_are_clear_errors(tmp_path, text, message):
    path = tmp_path / "records.jsonl"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_records(path)
    with pytest.raises(FileNotFoundError, match=r"Records file .* not found: pass the JSONL file of a run"):
        read_records(tmp_path / "missing.jsonl")
