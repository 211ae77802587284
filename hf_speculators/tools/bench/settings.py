"""The benchmark's settings: the method names it knows, a method to run (`BenchMethod`), how every method runs
(`BenchSettings`) and the methods of the command line's names (`named_methods`) and presets (`preset_methods`)."""

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from ...config import SpeculativeConfig
from ...config import methods as speculative_methods
from ...config.build import made_for_another_target
from ...config.methods import LOADED_DRAFT
from ...config.registry import METHOD_SPECS, checkpoint_of
from ...config.registry import named_methods as registry_methods
from ...loading import looks_local
from ...schedules import check_schedule

DEFAULT_METHODS = ("plain", "hf-prompt-lookup", "prompt-lookup", "prompt-lookup-tree", "hf-assisted", "draft-model",
                   "draft-model-tree")


def bench_methods() -> tuple[str, ...]:
    """Every method the benchmark knows, in its canonical order: `"plain"`, then per `MethodSpec` its transformers
    baselines and its named methods. Those beyond `DEFAULT_METHODS` run when asked for only: the model-free methods
    beyond prompt lookup, the exit-layer ones (they need exit_layer=), the self-draft ones (a quantization library;
    "self-draft-fp8" a GPU) and those that draft with a checkpoint made for the target."""
    return ("plain", *(name for spec in METHOD_SPECS.values() for name in (*spec.baselines, *spec.variants)))


def transformers_methods() -> dict[str, str]:
    """transformers' own methods, run as baselines: name -> the config method they correspond to."""
    return {baseline: spec.name for spec in METHOD_SPECS.values() for baseline in spec.baselines}


def baseline_of(method: "BenchMethod"):
    """The `Baseline` (of its config method's `MethodSpec`) that a transformers `BenchMethod` runs."""
    baselines = list(METHOD_SPECS[method.config.method].baselines.values())
    return next((b for b in baselines if b.universal == method.universal), baselines[0])


def _spec_of(method: str):
    """The `(MethodSpec, Variant or None)` of a named method or a baseline."""
    if method in transformers_methods():
        return METHOD_SPECS[transformers_methods()[method]], None
    return registry_methods()[method]


def exit_layer_methods() -> tuple[str, ...]:
    """The benchmark's methods that need `exit_layer`."""
    return tuple(m for m in bench_methods()[1:] if "exit_layer" in _spec_of(m)[0].required)


def draft_model_methods() -> tuple[str, ...]:
    """The benchmark's methods that draft with the loaded `--draft` model, baselines first."""
    return (*(m for m in transformers_methods() if _spec_of(m)[0].loads == "draft-model"),
            *speculative_methods.draft_model_methods())


ENGINES = ("hf_speculators", "transformers")
NO_FLOOR = "[no floor]"  # the label suffix of a method run without the plain-speed floor (`compare_floor`)
LOOP_FLOOR = "[loop floor]"  # ... of a method whose drafter has a floor of its own, run with the loop's as well
EAGER = "[eager]"  # the label suffix of a method run eagerly in a compiled run (`compare_eager`)


@dataclass(frozen=True)
class BenchMethod:
    """A method to benchmark: a `SpeculativeConfig`, run either by hf_speculators (`custom_generate`) or by
    transformers' own assisted generation (`transformers_methods()`, e.g. `"hf-assisted"`).

    Attributes:
        config (`SpeculativeConfig`): the drafter, its settings, the verification and the draft-length schedule. For
            `engine="transformers"`, a method with a `Baseline` in its `MethodSpec` (which says the `generate`
            keywords, e.g. `assistant_model`, and whether `num_draft_tokens` is pinned, constant, in the assistant).
        engine (`str`, defaults to `"hf_speculators"`): `"hf_speculators"` or `"transformers"`.
        universal (`bool`, defaults to `False`): with `engine="transformers"` and `"draft-model"`, transformers'
            universal assisted generation (a draft of another tokenizer: `tokenizer=` and `assistant_tokenizer=`
            passed; string-level exact matching when greedy, token-level intersection when sampling).
        plain_floor (`bool`, *optional*): with `engine="hf_speculators"`, `generate(plain_floor=...)`: whether
            the plain-speed floor holds rows plain while their drafts lose (`hf_speculators.floor`; default:
            `generate`'s, on under greedy decoding only).
        eager (`bool`, defaults to `False`): in a compiled run (`BenchSettings.compile`), run this method eagerly all
            the same, so that its eager lead over plain is measured beside its compiled lead (`compare_eager`).

    Raises:
        `ValueError`: an unknown engine, or a transformers method it has no equivalent for.
    """

    config: SpeculativeConfig
    engine: str = "hf_speculators"
    universal: bool = False
    plain_floor: bool | None = None
    eager: bool = False

    def __post_init__(self):
        if not isinstance(self.config, SpeculativeConfig):
            raise TypeError(f"BenchMethod.config must be a SpeculativeConfig, got {type(self.config).__name__}.")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {self.engine!r}.")
        keywords = set(transformers_methods().values())  # the config methods transformers can run
        if self.engine == "transformers" and self.config.method not in keywords:
            raise ValueError(f"transformers' assisted generation has no method {self.config.method!r}: choose one of "
                             f"{sorted(keywords)}.")


@dataclass(frozen=True)
class BenchSettings:
    """How `run_benchmark` runs every method: lengths, sampling, prompts, threads and where records go.

    Args:
        max_new_tokens (`int`, defaults to 128): tokens to generate per call (fewer if EOS comes first), >= 1.
        max_prompt_tokens (`int`, defaults to 1024): longer prompts keep their last tokens (lowered further so that
            prompt plus `max_new_tokens` fit the models' `max_position_embeddings`); recorded as `truncated`.
        batch_size (`int`, defaults to 1): prompts per generate call (see `run_benchmark`), >= 1.
        do_sample (`bool`, defaults to `False`): sample instead of greedy decoding, every method alike. Under
            sampling no output is compared token for token (records have `exact=False`): speed and acceptance are
            what is measured.
        temperature (`float`, defaults to 1.0), top_p (`float`, defaults to 1.0), top_k (`int`, defaults to 0: off):
            the sampling warpers, as for `generate` (> 0, in (0, 1], >= 0).
        seed (`int`, defaults to 0): `torch.manual_seed(seed)` before every generate call, so that every method of
            a prompt starts from the same random state.
        chat_template (`bool`, *optional*, defaults to `False`): wrap each prompt as a user turn with the
            tokenizer's chat template (`add_generation_prompt=True`); `None`: when the tokenizer has one.
        system_prompt (`str`, *optional*): a system turn before each prompt (needs the chat template).
        num_threads (`int`, *optional*, defaults to 1): torch CPU threads during the run (restored afterwards);
            `None` leaves the setting alone.
        verbose (`bool`, defaults to `True`): a tqdm progress bar, and the summary table and any mismatches printed.
        out_path (`str` or `Path`, *optional*): JSONL file of the records, each written (and flushed) as soon as it
            is measured, so that an interrupted run leaves a valid file of everything measured so far.
        resume (`bool`, defaults to `False`): continue the run recorded in `out_path` (same methods, settings and
            prompts): batches whose records are all there are kept and skipped, a batch cut short is run again.
        compile (`bool`, defaults to `False`): run every method compiled (`engines.compiled_kwargs`: a static cache
            and `torch.compile`, as transformers users switch it on), beside `"plain"` (eager: the exactness
            reference) and `"plain-compiled"` (transformers' plain decoding, compiled the same way: the baseline of
            `speedup_vs_compiled`). The warm-up call of each method compiles it.

    Raises:
        `ValueError`: a value out of range or of the wrong type, naming the field.
    """

    max_new_tokens: int = 128
    max_prompt_tokens: int = 1024
    batch_size: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    chat_template: bool | None = False
    system_prompt: str | None = None
    num_threads: int | None = 1
    verbose: bool = True
    out_path: str | Path | None = None
    resume: bool = False
    compile: bool = False

    def __post_init__(self):
        for name in ("max_new_tokens", "max_prompt_tokens", "batch_size", "num_threads"):
            value = getattr(self, name)
            if (value is not None or name != "num_threads") and not _is_int(value, low=1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if not _is_int(self.top_k, low=0) or not _is_int(self.seed, low=0):
            raise ValueError(f"top_k and seed must be integers >= 0, got {self.top_k!r} and {self.seed!r}.")
        if not _is_number(self.temperature) or not self.temperature > 0:
            raise ValueError(f"temperature must be a number > 0, got {self.temperature!r}.")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}.")
        for name in ("do_sample", "verbose", "resume", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}.")
        if self.resume and self.out_path is None:
            raise ValueError("resume=True continues the records of out_path: set out_path as well.")

    def sampling(self) -> dict:
        """The `generate` keywords of the decoding mode: greedy, or sampling with its warpers."""
        if not self.do_sample:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}

    def recorded(self) -> dict:
        """The settings that define the measurements (those a resumed run must share), for the provenance."""
        return {name: value for name, value in asdict(self).items() if name not in ("verbose", "out_path", "resume")}


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def named_methods(
    names: Sequence[str],
    *,
    variants: Sequence[tuple[int, str]] | None = None,
    baseline_ks: Sequence[int] | None = None,
    compare_floor: bool = False,
    compare_eager: bool = False,
    num_draft_tokens: int = 5,
    max_ngram_size: int = 2,
    verification: str | None = None,
    num_draft_tokens_schedule: str | None = None,
    draft_model: str | None = None,
    **options,
) -> dict[str, BenchMethod]:
    """The benchmark methods of the command line's names: `"plain"` (skipped: `run_benchmark` always runs it),
    transformers' baselines (`transformers_methods()`) and the named methods (`config.registry.named_methods()`).

    Args:
        names (`Sequence[str]`): method names from `bench_methods()`, run in that canonical order.
        variants (`Sequence[tuple[int, str]]`, *optional*): `(num_draft_tokens, schedule)` pairs: each of our methods
            then runs once per pair, named by `variant_label` (e.g. `draft-model[k=3]`); transformers' baselines run
            once per constant pair (`hf-prompt-lookup[k=3]`), or with `num_draft_tokens` when there is none.
        baseline_ks (`Sequence[int]`, *optional*): transformers' baselines run once per k given here instead
            (`hf-prompt-lookup[k=8]`), whatever `variants` says; the summaries add each one's best k.
        compare_floor (`bool`, defaults to `False`): each of our methods also runs without the plain-speed floor,
            labelled `<label>[no floor]`; one whose drafter has a floor of its own (`Drafter.has_own_floor`: the
            hybrid), which runs without the loop's by default, runs with it as well, labelled `<label>[loop floor]`.
        compare_eager (`bool`, defaults to `False`): each of our methods also runs eagerly in a compiled run,
            labelled `<label>[eager]` (the summaries' `lead_kept`).
        num_draft_tokens (`int`, defaults to 5): draft tokens per step (k), the same for every method.
        max_ngram_size (`int`, defaults to 2, transformers' default): longest n-gram of both prompt lookups.
        verification (`str`, *optional*): our methods' verifier (a key of `VERIFIERS`); default: exact for greedy
            decoding, rejection when sampling.
        num_draft_tokens_schedule (`str`, *optional*): our methods' draft-length schedule (default `"constant"`).
        draft_model (`str`, *optional*): the draft model's name or path (`run_benchmark(draft=...)` passes the loaded
            one); default `"<loaded draft model>"`.
        **options: the other arguments of `hf_speculators.config.methods.method_config` (`method_options()`:
            `exit_layer`, `tree_top_k`, `eagle_head`...).

    Returns:
        `dict[str, BenchMethod]`: benchmark label -> method.

    Raises:
        `ValueError`: an unknown name (listing `bench_methods()`), `baseline_ks` without a transformers method, an
            exit-layer method without `exit_layer`, a head method without its checkpoint, or settings a config refuses
            (naming the field).
    """
    known = bench_methods()
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise ValueError(f"Unknown benchmark methods {unknown}; choose from {', '.join(known)}.")
    if baseline_ks and not set(names) & set(transformers_methods()):
        raise ValueError(f"baseline_ks (--baseline-k) runs transformers' methods once per k, but the methods name none "
                         f"of them: add one ({', '.join(transformers_methods())}) or drop it.")
    draft_model = draft_model or LOADED_DRAFT
    needs_exit = [m for m in names if m != "plain" and "exit_layer" in _spec_of(m)[0].required]
    if needs_exit and options.get("exit_layer") is None:
        raise ValueError(f"Methods {needs_exit} need an exit layer: pass exit_layer= or drop them from methods.")
    for method in (m for m in names if m != "plain"):
        spec, variant = _spec_of(method)
        option = getattr(spec.checkpoint if variant is None else checkpoint_of(spec, variant), "name", "draft_model")
        if option != "draft_model" and options.get(option) is None:
            raise ValueError(f"Method {method!r} needs a draft head checkpoint: pass {option}= or drop it from methods.")
    chosen = {}
    for method in (m for m in known if m in names and m != "plain"):
        if method in transformers_methods():
            baseline_variants = [(k, "constant") for k in baseline_ks] if baseline_ks else variants
            for label, k in _baseline_variants(method, num_draft_tokens, baseline_variants):
                config = _transformers_config(method, k, max_ngram_size, draft_model, options)
                universal = METHOD_SPECS[config.method].baselines[method].universal
                chosen[label] = BenchMethod(config, engine="transformers", universal=universal)
            continue
        for label, k, schedule in _variants(method, num_draft_tokens, num_draft_tokens_schedule, variants):
            config = speculative_methods.method_config(method, draft_model=draft_model, num_draft_tokens=k,
                                                       max_ngram_size=max_ngram_size, **options)
            extra = {"verification": verification, "num_draft_tokens_schedule": schedule}
            config = config.override(**{n: v for n, v in extra.items() if v is not None})
            chosen |= _our_runs(label, config, compare_floor, compare_eager)
    return chosen


def preset_methods(presets: Sequence[str], target_model: str, *, compare_floor: bool = False,
                   compare_eager: bool = False) -> dict[str, BenchMethod]:
    """The benchmark methods of presets (`--presets`), each run as `hf-speculators generate --preset` runs it: its
    own method, draft length, schedule, verification and draft model (loaded by the drafter from the name the preset
    gives), whatever the run's drafter settings say.

    Args:
        presets (`Sequence[str]`): bundled preset names, model-card folders or Hub ids
            (`SpeculativeConfig.from_pretrained`); each is labelled by its name, a local card by its folder's name.
        target_model (`str`): the model the benchmark runs (`--model`).
        compare_floor, compare_eager (`bool`, defaults to `False`): as for `named_methods`.

    Returns:
        `dict[str, BenchMethod]`: label -> method, in the order given.

    Raises:
        `ValueError`: a preset made for another target than `target_model` (its `target_model` field), or two
            presets with one label; what `SpeculativeConfig.from_pretrained` raises for a preset it cannot read.
    """
    chosen = {}
    for preset in presets:
        label = _preset_label(preset)
        if label in chosen:
            raise ValueError(f"Two presets are labelled {label!r} (--presets {', '.join(presets)}): give each once.")
        config = SpeculativeConfig.from_pretrained(preset)
        if made_for_another_target(config, target_model):
            raise ValueError(f"Preset {preset!r} was made for target_model={config.target_model!r}, but the benchmark "
                             f"runs {target_model!r}: pass --model {config.target_model} or a preset for this model.")
        chosen |= _our_runs(label, config, compare_floor, compare_eager)
    return chosen


def _preset_label(preset: str) -> str:
    """A preset's label: a bundled name or Hub id as given, a local card by its folder's name (a card file's too)."""
    if not looks_local(preset):
        return preset
    path = Path(preset).expanduser()
    return (path.parent if path.is_file() else path).name


def _our_runs(label: str, config: SpeculativeConfig, compare_floor: bool, compare_eager: bool) -> dict:
    """`label` -> our method running `config`, and the runs `compare_floor` and `compare_eager` add beside it."""
    runs = {label: BenchMethod(config)}
    if compare_floor:  # the other side of the default: off for a drafter with a floor of its own
        own_floor = getattr(METHOD_SPECS[config.method].drafter, "has_own_floor", False)
        runs[label + (LOOP_FLOOR if own_floor else NO_FLOOR)] = BenchMethod(config, plain_floor=own_floor)
    if compare_eager:
        runs[label + EAGER] = BenchMethod(config, eager=True)
    return runs


def variant_label(method: str, num_draft_tokens: int, schedule: str) -> str:
    """The benchmark name of `method` run with `num_draft_tokens` under `schedule`, e.g. `draft-model[k=3]` or
    `draft-model[goodput,k<=6]` (the bound) or `draft-model[heuristic,k=5]` (the starting length)."""
    if schedule == "constant":
        return f"{method}[k={num_draft_tokens}]"
    return f"{method}[{schedule},k{'<=' if schedule == 'goodput' else '='}{num_draft_tokens}]"


def _variants(method: str, num_draft_tokens: int, schedule: str | None, variants) -> list[tuple[str, int, str | None]]:
    """`(label, num_draft_tokens, schedule)` of each run of our `method`: one per variant when `variants` is given,
    else the method itself with the run's settings."""
    if variants is None:
        return [(method, num_draft_tokens, schedule)]
    return [(variant_label(method, k, check_schedule(name)), k, name) for k, name in variants]


def _baseline_variants(method: str, num_draft_tokens: int, variants) -> list[tuple[str, int]]:
    """`(label, num_draft_tokens)` of each run of transformers' `method`: one per constant variant (transformers'
    methods run pinned to a constant length, so a schedule variant has no counterpart there), else the method itself
    with `num_draft_tokens`."""
    constant = [k for k, schedule in variants or () if check_schedule(schedule) == "constant"]
    if not constant:
        return [(method, num_draft_tokens)]
    return [(variant_label(method, k, "constant"), k) for k in constant]


def _transformers_config(method: str, num_draft_tokens: int, max_ngram_size: int, draft_model: str,
                         options: dict) -> SpeculativeConfig:
    """The config of one of transformers' baselines (`BenchMethod(engine="transformers")`): its `Baseline.fields`."""
    spec = METHOD_SPECS[transformers_methods()[method]]
    checkpoint = getattr(spec.checkpoint, "name", "draft_model")
    values = {**options, "num_draft_tokens": num_draft_tokens, "max_ngram_size": max_ngram_size,
              "draft_model": draft_model if checkpoint == "draft_model" else options.get(checkpoint)}
    return SpeculativeConfig(spec.name, **{name: values.get(name) for name in spec.baselines[method].fields})
