"""The `hf-speculators` command: `generate` streams speculative output and compares it with plain generate,
`bench` compares methods on a prompt set, `sweep` measures the fidelity/acceptance trade-off of the relaxed
verifiers, `plot` draws a saved bench run, `presets` lists the bundled presets, `export` prints the vLLM
command of one and `env` the versions and device facts a bug report needs. This module runs the commands; their
flags are `cli_parser`'s."""

import argparse
import sys
import traceback
from dataclasses import fields

import torch
from transformers import TextStreamer

from ..config import SpeculativeConfig, method_fields
from ..config.build import build_drafter
from ..config.methods import LOADED_DRAFT, method_config
from ..config.registry import checkpoint_methods, method_options
from ..config.presets import bundled_card, bundled_presets, card_results
from ..config.vllm_export import commands_text, export
from ..decoding import enable
from ..loading import DEMO_TARGET, load_model, load_tokenizer, resolve_device, resolve_dtype
from ..metrics import clock
from ..onednn_linear import with_cpu_linear
from ..prompts import encode_prompt, load_prompts, use_chat_template
from ..vllm_check.check import check_export
from ..vllm_check.client import require_vllm_python
from .bench import BenchSettings, draft_model_methods, named_methods, preset_methods, read_records, run_benchmark
from .bench.engines import compiled_kwargs
from .cli_parser import DEFAULT_GENERATE_SCHEDULE, DEMO_EAGLE3, DEMO_MEDUSA, command_parser
from .env import run_env
from .plots import plot_benchmark, pyplot
from .quiet import quiet_third_party
from .report import markdown_report
from .sweep import default_verifiers, plot_sweep, run_sweep, sweep_table

DEFAULT_HEADS = {"eagle_head": DEMO_EAGLE3, "medusa_head": DEMO_MEDUSA}  # the head checkpoints of the demo target
INTERRUPTED = 130  # the exit status of a command stopped by Ctrl-C (128 + SIGINT), as shells report it
# what bad input raises (a bad value, a missing or unreadable file, a device or Hub repo out of reach, a missing
# extra): exit status 2; anything else raised during a run is a failure, exit status 1
BAD_INPUT = (ValueError, TypeError, OSError, ImportError)


def _verifier(args) -> str | None:
    """`--verifier`, or its deprecated spelling `--verification` (with a warning)."""
    if args.verification_alias is not None:
        if args.verifier not in (None, args.verification_alias):
            raise ValueError("--verifier and its deprecated spelling --verification disagree: pass --verifier only.")
        print(f"hf-speculators {args.command}: warning: --verification is deprecated, use --verifier.", file=sys.stderr)
    return args.verifier or args.verification_alias


def _method_options(args) -> dict:
    """The named-method options of `hf_speculators.config.methods.method_config` that the command's flags give."""
    return {name: getattr(args, name, None) for name in ("num_draft_tokens", *method_options())}


def config_from_args(args) -> SpeculativeConfig:
    """The preset's config with every flag that was given applied over it (`SpeculativeConfig.override`).

    `--method NAME` (a named method, as for `bench` and `sweep`) replaces the preset's method by
    `method_config(NAME, ...)` with the drafter flags given, keeping the preset's draft model or head checkpoint
    where the new method takes one; `--draft` without `--method` over a preset whose method takes no draft model
    switches to `draft-model`. A checkpoint flag (`checkpoint_settings()`: `--eagle-head`...) names the head of its
    methods.
    """
    config = SpeculativeConfig.from_pretrained(args.preset)
    method = args.method
    if method is None and args.draft is not None and "draft_model" not in method_fields(config.method):
        method = "draft-model"  # --draft alone over a preset without a draft model (the default's)
    heads = checkpoint_methods()  # --eagle-head -> ("eagle3", "eagle"), ...
    given_head = next((name for name in heads if getattr(args, name) is not None), None)
    if method is None and given_head is not None:
        if config.method not in heads[given_head]:
            raise ValueError(f"--{given_head.replace('_', '-')} names the head of a {' or '.join(heads[given_head])} "
                             f"method, and the preset's method is {config.method!r}: pass --method as well.")
        config = config.override(draft_model=getattr(args, given_head))
    if method is not None:
        kept = config.draft_model if "draft_model" in method_fields(config.method) else None
        options = {name: value for name, value in _method_options(args).items() if value is not None}
        for name, methods in heads.items():
            options.setdefault(name, kept if config.method in methods else DEFAULT_HEADS.get(name))
        named = method_config(method, draft_model=args.draft or kept, **options)
        config = config.override(**named.to_dict())
    flags = {
        "verification": _verifier(args), "target_model": args.model, "draft_quantization": args.draft_quantization,
        "min_ngram_size": args.min_ngram_size, "num_draft_tokens_schedule": args.num_draft_tokens_schedule,
    }
    if method is None:  # the drafter flags apply to the preset's own method
        config_fields = {f.name for f in fields(SpeculativeConfig)}
        flags |= {name: value for name, value in _method_options(args).items() if name in config_fields}
        flags["draft_model"] = args.draft
        tree = {key: value for key, value in (("top_k", args.tree_top_k), ("num_nodes", args.tree_nodes))
                if value is not None}
        flags["tree"] = {**(config.tree or {}), **tree} if tree else None
    return config.override(**{name: value for name, value in flags.items() if value is not None})


def _timed_generate(model, inputs, **kwargs) -> tuple[torch.Tensor | object, float]:
    start = clock(model.device)
    output = model.generate(**inputs, **kwargs)
    return output, clock(model.device) - start


def _placement(args) -> None:
    """Resolves `--device auto` and `--dtype auto` in place (see `resolve_device` and `resolve_dtype`)."""
    args.device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, args.device)


def _print_placement(model) -> None:
    print(f"device: {model.device}, dtype: {str(model.dtype).removeprefix('torch.')}")


def run_generate(args) -> int:
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: pass the text to continue, e.g. hf-speculators generate "
                         "\"def fibonacci(n):\"")
    config = config_from_args(args)
    target_name = config.target_model or DEMO_TARGET
    tokenizer = load_tokenizer(target_name)
    chat = use_chat_template(tokenizer, args.chat, args.system)
    target = enable(with_cpu_linear(load_model(target_name, args.dtype, args.device, quantization=args.quantization),
                                    args.cpu_linear))
    _print_placement(target)
    drafter, verifier = config.build(target, tokenizer)
    inputs = encode_prompt(tokenizer, args.prompt, chat, args.system).to(target.device)
    if inputs["input_ids"].shape[1] == 0:
        raise ValueError(f"the prompt {args.prompt!r} tokenizes to no tokens: pass some text.")
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    sampling = sampling if args.do_sample else dict(do_sample=False)
    common = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id, **sampling,
                  **(compiled_kwargs(target) if args.compile else {}))
    speculative = dict(candidate_generator=drafter, verifier=verifier, tokenizer=tokenizer,
                       num_draft_tokens_schedule=config.num_draft_tokens_schedule or DEFAULT_GENERATE_SCHEDULE,
                       return_dict_in_generate=True)
    for options in ({}, speculative):  # warm-up, untimed
        target.generate(**inputs, **{**common, "max_new_tokens": 4}, **options)

    torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, skip_prompt=True)
    try:
        out, seconds = _timed_generate(target, inputs, **common, **speculative, streamer=streamer)
    except KeyboardInterrupt:
        streamer.end()  # prints the text it holds back until a word ends
        print("\nhf-speculators generate: interrupted; the text above is what was generated.", file=sys.stderr)
        return INTERRUPTED
    torch.manual_seed(args.seed)
    plain, plain_seconds = _timed_generate(target, inputs, **common)
    _report(out, seconds, plain, plain_seconds, inputs["input_ids"].shape[1], args.do_sample)
    return 0


def _load_models(args, needs_draft: bool):
    """`(target, draft)` as the command's model options say; `draft` is `None` unless `needs_draft`."""
    if args.draft_quantization is not None and not needs_draft:
        raise ValueError("--draft-quantization quantizes the draft model, and no method chosen uses one.")
    target = with_cpu_linear(load_model(args.model, args.dtype, args.device, quantization=args.quantization),
                             args.cpu_linear)
    _print_placement(target)
    if not needs_draft:
        return target, None
    # switched here too for the baselines that run it without `build_drafter` (transformers' assisted decoding)
    return target, with_cpu_linear(load_model(args.draft, args.dtype, args.device,
                                              quantization=args.draft_quantization), args.cpu_linear)


def _bench_settings(args) -> BenchSettings:
    return BenchSettings(max_new_tokens=args.max_new_tokens, batch_size=getattr(args, "batch_size", 1),
                         do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                         seed=args.seed, chat_template=args.chat, system_prompt=args.system,
                         num_threads=args.threads, out_path=args.out, resume=args.resume,
                         compile=getattr(args, "compile", False))


def _interrupted(args) -> int:
    """Says where the records of an interrupted `bench` or `sweep` are and how to continue; its exit status."""
    print(f"hf-speculators {args.command}: interrupted; the records measured so far are in {args.out}: rerun the same "
          "command with --resume to continue.", file=sys.stderr)
    return INTERRUPTED


def _comma_list(text: str) -> list[str]:
    """The non-empty items of a comma-separated flag value, stripped."""
    return [item.strip() for item in text.split(",") if item.strip()]


def run_bench(args) -> int:
    names = _comma_list(args.methods)
    if args.compare_eager and not args.compile:
        raise ValueError("--compare-eager runs our methods eagerly beside their compiled runs: pass --compile too.")
    if args.draft_vocab_size is not None and args.draft_vocab is None:
        raise ValueError("--draft-vocab-size takes the first ids of a token ranking: pass --draft-vocab as well.")
    options = {**_method_options(args), "num_draft_tokens": args.num_draft_tokens or 5}
    methods = named_methods(names, variants=args.variants, baseline_ks=args.baseline_k,
                            compare_floor=args.compare_floor, compare_eager=args.compare_eager,
                            verification=_verifier(args),
                            num_draft_tokens_schedule=args.num_draft_tokens_schedule, **options)
    presets = preset_methods(_comma_list(args.presets or ""), args.model, compare_floor=args.compare_floor,
                             compare_eager=args.compare_eager)
    if set(presets) & set(methods):
        raise ValueError(f"--presets and --methods both run {sorted(set(presets) & set(methods))}: name each once.")
    methods |= presets
    settings = _bench_settings(args)
    prompts = load_prompts(args.prompts, args.limit)
    tokenizer = load_tokenizer(args.model)
    use_chat_template(tokenizer, args.chat, args.system)  # fails before any model loads
    if args.plot is not None:
        pyplot()  # fail before the run, not after it, when matplotlib is missing
    target, draft = _load_models(args, any(m in draft_model_methods() for m in names))
    draft_tokenizer = None if draft is None else load_tokenizer(args.draft)
    try:
        result = run_benchmark(target, tokenizer, prompts, methods, settings, draft=draft,
                               draft_tokenizer=draft_tokenizer)
    except KeyboardInterrupt:
        return _interrupted(args)
    print(f"records: {args.out}")
    if args.plot is not None:
        plot_benchmark(result.records, args.plot)
        print(f"plot: {args.plot}")
    return 0 if result.ok else 1


def run_sweep_command(args) -> int:
    if not args.no_plot:
        pyplot()  # fail before the sweep, not after it, when matplotlib is missing
    verifiers = default_verifiers(args.typical_settings, args.top_k_settings)
    config = method_config(args.method, draft_model=LOADED_DRAFT, **_method_options(args))
    settings = _bench_settings(args)
    prompts = load_prompts(args.prompts, args.limit)
    tokenizer = load_tokenizer(args.model)
    use_chat_template(tokenizer, args.chat, args.system)
    target, draft = _load_models(args, args.method in draft_model_methods())
    loaded = {} if draft is None else {"draft_model": draft, "draft_tokenizer": load_tokenizer(args.draft)}
    drafter = build_drafter(config, target, tokenizer, **loaded)
    try:
        points = run_sweep(target, tokenizer, prompts, drafter, verifiers, settings)
    except KeyboardInterrupt:
        return _interrupted(args)
    print(sweep_table(points))
    print(f"records: {args.out}")
    if not args.no_plot:
        plot_sweep(points, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _speedup(results: dict | None) -> str:
    """The measured speedup of a card's results block, naming its baseline unless it is plain greedy decoding."""
    if not results:
        return "-"
    baseline = results.get("baseline")
    return f"{results['speedup']:.2f}x" + (f" vs {baseline}" if baseline else "")


def run_presets(args) -> int:
    rows = [("name", "method", "target", "speedup", "measured on")]
    for name, folder in bundled_presets().items():
        config = SpeculativeConfig.from_pretrained(str(folder))
        results = card_results(folder / "README.md")
        rows.append((name, config.method, config.target_model or "-", _speedup(results),
                     results["hardware"] if results else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    print("\nspeedup: tokens/s over plain greedy decoding unless another baseline is named (the relaxed presets: "
          "over exact verification with the same draft); hf-speculators presets show NAME prints a card with its "
          "settings, sources and the command that measured it")
    return 0


def run_presets_show(args) -> int:
    print(bundled_card(args.name).read_text(encoding="utf-8"), end="")
    return 0


def run_export(args) -> int:
    for flag, value in (("--vllm-python", args.vllm_python), ("--prompts", args.prompts)):
        if value is not None and not args.check:
            raise ValueError(f"{flag} applies to --check (serving the export in vLLM): add --check, or drop it.")
    config = SpeculativeConfig.from_pretrained(args.name)
    if args.check:
        require_vllm_python(args.vllm_python)  # before exporting: a missing environment is bad input
    exported, notes = export(config, args.out)
    print(commands_text(config, exported, notes))
    if not args.check:
        return 0
    result = check_export(config, exported, args.vllm_python, prompts=args.prompts or "spec-bench")
    source = args.prompts or "Spec-Bench"
    print(f"\n--- vLLM check (greedy, fp32, {result.num_prompts} prompts of {source})\n{result.report()}")
    return 0 if result.identical else 1


def run_plot(args) -> int:
    plot_benchmark(read_records(args.records), args.out)
    print(f"plot: {args.out}")
    return 0


def run_report(args) -> int:
    print(markdown_report(read_records(args.records)), end="")
    return 0


def _report(out, seconds: float, plain: torch.Tensor, plain_seconds: float, prompt_length: int, sampled: bool) -> None:
    stats = out.speculative_stats
    new_tokens = out.sequences.shape[1] - prompt_length
    plain_tokens = plain.shape[1] - prompt_length
    speed, plain_speed = new_tokens / seconds, plain_tokens / plain_seconds
    if sampled:
        identical = "n/a (sampling: " + ("lossless in distribution, not token for token)" if stats.lossless else
                                         "relaxed verification, not the target's distribution)")
    elif torch.equal(out.sequences, plain):
        identical = "yes"
    else:
        relaxed = "no (relaxed verification keeps tokens that are not the target's argmax)"
        identical = "NO" if stats.lossless else relaxed
    print(f"\n---\ndrafter: {stats.drafter}; verifier: {stats.verifier} ({'lossless' if stats.lossless else 'relaxed'})")
    print(f"speculative: {new_tokens} tokens in {seconds:.2f} s = {speed:.1f} tokens/s")
    print(f"plain generate(): {plain_tokens} tokens in {plain_seconds:.2f} s = {plain_speed:.1f} tokens/s")
    print(f"speedup: {speed / plain_speed:.2f}x")
    print(f"mean acceptance length: {stats.mean_acceptance_length:.2f} tokens per draft "
          f"(acceptance rate {stats.acceptance_rate:.2f}, {stats.num_target_forwards} target forwards)")
    print(f"identical to plain greedy: {identical}")
    lengths = ", ".join(f"{k}: {n}" for k, n in enumerate(stats.draft_lengths) if n)
    print(f"draft lengths (tokens asked: steps): {lengths}; {stats.num_steps_without_draft} steps without a draft")


def _fail(args, error: BaseException, status: int) -> int:
    """Prints `error` as one line on stderr (its traceback first with `--verbose`) and returns `status`."""
    if getattr(args, "verbose", False):
        traceback.print_exception(error)
    message = " ".join(str(error).split()) or type(error).__name__
    if status == 2:
        print(f"hf-speculators {args.command}: error: {message}", file=sys.stderr)
    else:
        hint = "" if getattr(args, "verbose", False) else " (--verbose shows the traceback)"
        print(f"hf-speculators {args.command}: failed: {type(error).__name__}: {message}{hint}", file=sys.stderr)
    return status


def build_parser() -> argparse.ArgumentParser:
    """The `hf-speculators` parser (`cli_parser.command_parser`), each command bound to its function here."""
    return command_parser({
        "generate": run_generate, "bench": run_bench, "sweep": run_sweep_command, "plot": run_plot,
        "report": run_report, "presets": run_presets, "presets show": run_presets_show, "export": run_export,
        "env": run_env,
    })


def main(argv: list[str] | None = None) -> int:
    """Runs the `hf-speculators` command.

    Returns:
        `int`: the exit status: 0 on success; 1 for a failure during the run (a bench mismatch, or an error raised
        by a model or library while running); 2 for bad input (a bad flag value, a missing or unreadable file, a
        device or Hub repo that cannot be reached), reported as one line on stderr; 130 when interrupted (Ctrl-C),
        after keeping what was measured. With `--verbose` an error also prints its traceback.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "threads", None) is not None:  # `presets` has no --threads
            torch.set_num_threads(args.threads)
        if hasattr(args, "device"):  # the commands that load models
            _placement(args)
        with quiet_third_party(getattr(args, "verbose", False)):
            return args.run(args)
    except KeyboardInterrupt:
        print(f"hf-speculators {args.command}: interrupted.", file=sys.stderr)
        return INTERRUPTED
    except BAD_INPUT as error:
        return _fail(args, error, 2)
    except Exception as error:  # a failure during the run: a library or model error
        return _fail(args, error, 1)


if __name__ == "__main__":
    sys.exit(main())
