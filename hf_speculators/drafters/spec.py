"""What a speculative method is to the outer ring: `MethodSpec` (one per method, declared beside its drafter) and
`Setting` (one per setting). `SpeculativeConfig`'s validation, `method_config`, the command line's flags, the
benchmark's method list and the vLLM export are read from the specs (`hf_speculators.config.registry`)."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

# how a method's model loads (`hf_speculators.config.build.build_drafter`)
LOADS = ("nothing", "draft-model", "checkpoint", "head", "target", "pair")
# how a named method sets its draft length: num_draft_tokens, a tree of that depth, a tree as deep as the model's
# own draft, or the model's own draft length
LENGTHS = ("tokens", "depth", "tree", "own")


@dataclass(frozen=True)
class Setting:
    """One setting of a method: a `SpeculativeConfig` field (or a `method_config` keyword), checked as it declares,
    and the command line's flag `--name-with-dashes` (unset by default: the drafter's own default applies).

    Args:
        name (`str`): the field, keyword and (with `_` as `-`) flag name.
        kind (`type`, defaults to `int`): `int`, `float`, `str` or `bool`.
        low, high (`float`, *optional*): bounds of a number; `low_included`, `high_included` say whether they hold.
        choices (`tuple[str, ...]`, *optional*): the names a `str` setting takes.
        help (`str`, defaults to `""`): the flag's help (`{methods}` is replaced by the command's method names).
        flag (`bool`, defaults to `True`): whether the command line offers the flag.
        metavar (`str`, *optional*): the flag's value in the usage line.
    """

    name: str
    kind: type = int
    low: float | None = None
    high: float | None = None
    low_included: bool = True
    high_included: bool = True
    choices: tuple[str, ...] | None = None
    help: str = ""
    flag: bool = True
    metavar: str | None = None

    def requirement(self) -> str:
        """What a valid value is, in words (`"an integer >= 1"`, `"a number >= 0 and <= 1"`)."""
        if self.kind is bool:
            return "true or false"
        if self.kind is str:
            return f"one of {self.choices}" if self.choices else "a non-empty string"
        bounds = [f"{'>=' if self.low_included else '>'} {self.low}" if self.low is not None else None,
                  f"{'<=' if self.high_included else '<'} {self.high}" if self.high is not None else None]
        text = " and ".join(bound for bound in bounds if bound)
        return f"{'an integer' if self.kind is int else 'a number'}{' ' + text if text else ''}"

    def accepts(self, value) -> bool:
        """Whether `value` is valid (`None`, unset, always is)."""
        if value is None:
            return True
        if self.kind in (bool, str):
            valid = isinstance(value, self.kind) and (value.strip() != "" if self.kind is str else True)
            return valid and (self.choices is None or value in self.choices)
        number = isinstance(value, (self.kind, int) if self.kind is float else int) and not isinstance(value, bool)
        above = self.low is None or (number and (value >= self.low if self.low_included else value > self.low))
        below = self.high is None or (number and (value <= self.high if self.high_included else value < self.high))
        return number and above and below

    def check(self, value) -> None:
        """Raises `ValueError` naming the setting when `value` is not valid."""
        if not self.accepts(value):
            requirement = "a name (a string)" if self.choices and not isinstance(value, str) else self.requirement()
            raise ValueError(f"{self.name} must be {requirement}, got {value!r}.")


@dataclass(frozen=True)
class Variant:
    """A named method of the command line and the benchmark: its spec's method with a draft length and settings.

    Args:
        length (`str`, defaults to `"tokens"`): one of `LENGTHS`.
        settings (`Mapping`, *optional*): config fields it sets; the method's given settings override them.
        checkpoint (`Setting` or `False`, *optional*): the `method_config` keyword naming its checkpoint when it is
            not the spec's (`False`: none, e.g. a quantized copy of the target drafts).
        ignores (`tuple[str, ...]`): the method's settings it does not take (a chain's `num_candidates`).
    """

    length: str = "tokens"
    settings: Mapping = field(default_factory=dict)
    checkpoint: "Setting | bool | None" = None
    ignores: tuple[str, ...] = ()


@dataclass(frozen=True)
class VllmMapping:
    """How a method runs in vLLM: its `method` there, fixed keys, and our fields -> vLLM's keys (filled with our
    drafter's defaults when unset); `draft`: the draft model's `model`, `revision` and `quantization` as well;
    `needs`: what vLLM needs besides itself to run the method (a package), printed with the export."""

    method: str
    fixed: Mapping = field(default_factory=dict)
    fields: Mapping[str, str] = field(default_factory=dict)
    draft: bool = True
    needs: str | None = None


@dataclass(frozen=True)
class Baseline:
    """One of transformers' own methods, benchmarked against the spec's method (`BenchMethod(engine="transformers")`).

    Args:
        fields (`tuple[str, ...]`): the config fields it takes from the benchmark's options (`draft_model`: `--draft`
            or the spec's checkpoint).
        kwargs (`Callable`): `(config, target, draft, build) -> dict`, the `generate` keywords that run it (`draft`:
            the loaded draft model, `build()`: the spec's drafter for `target`).
        pinned (`bool`): transformers reads its draft length from the assistant's `generation_config` (pinned).
        universal (`bool`): universal assisted generation (the tokenizers passed as well).
    """

    fields: tuple[str, ...]
    kwargs: Callable
    pinned: bool = False
    universal: bool = False


@dataclass(frozen=True)
class MethodSpec:
    """Everything the outer ring knows of one `SpeculativeConfig.method`; see `docs/guides/adding_a_drafter.md`.

    Args:
        name (`str`): the config's `method`.
        drafter (`type`, *optional*): the drafter class (`None`: loads as a config, runs in vLLM only).
        settings (`tuple[Setting, ...]`): its own settings (config fields), besides `num_draft_tokens`.
        required (`tuple[str, ...]`): fields it cannot go without.
        shared (`tuple[str, ...]`): the shared fields it takes (`draft_model`, `draft_revision`, `draft_quantization`,
            `tree`).
        loads (`str`, defaults to `"nothing"`): how its model loads, one of `LOADS`.
        checkpoint (`Setting`, *optional*): the `method_config` keyword (and flag) naming its `draft_model`.
        variants (`Mapping[str, Variant]`): its named methods (`"draft-model-tree"`, `"self-draft-int8"`).
        vllm (`VllmMapping`, *optional*): its vLLM equivalent; `vllm_refusal` explains why there is none.
        baselines (`Mapping[str, Baseline]`): the transformers methods it is benchmarked against (`"hf-assisted"`).
        draft_length (`Callable`, *optional*): its draft length from a config when `num_draft_tokens` is unset.
        no_draft_tokens (`str`, *optional*): why `num_draft_tokens` does not apply (a refusal), when it does not.
    """

    name: str
    drafter: type | None = None
    settings: tuple[Setting, ...] = ()
    required: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    loads: str = "nothing"
    checkpoint: Setting | None = None
    variants: Mapping[str, Variant] = field(default_factory=dict)
    vllm: VllmMapping | None = None
    vllm_refusal: str | None = None
    baselines: Mapping[str, Baseline] = field(default_factory=dict)
    draft_length: Callable | None = None
    no_draft_tokens: str | None = None

    def fields(self) -> tuple[str, ...]:
        """The config fields it takes besides `num_draft_tokens` (required ones first)."""
        taken = (*self.shared, *(setting.name for setting in self.settings))
        return (*self.required, *(name for name in taken if name not in self.required))


DRAFT_MODEL = Setting("draft_model", str, flag=False)  # the draft model (--draft): a name, a folder or a demo id
