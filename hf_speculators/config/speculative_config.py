"""`SpeculativeConfig`: everything a speculative run needs, in one flat, validated dataclass."""

import inspect
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from ..drafters.spec import Setting
from ..folders import write_folder
from ..quantization import QUANTIZATIONS
from ..schedules import SCHEDULES
from ..verifiers import VERIFIERS
from . import presets
from .build import VERIFIER_PARAMS, build
from .registry import METHOD_SPECS, method_settings
from .vllm_export import to_vllm



def method_fields(method: str) -> tuple[str, ...]:
    """The fields `method` takes besides `num_draft_tokens` (required ones first); none for an unknown method."""
    spec = METHOD_SPECS.get(method)
    return () if spec is None else spec.fields()


def _fail(name: str, requirement: str, value) -> None:
    raise ValueError(f"{name} must be {requirement}, got {value!r}.")


# the shared fields checked as the methods' settings are (`Setting.check`)
_SHARED_SETTINGS = (Setting("num_draft_tokens", low=1), Setting("top_k", low=1),
                    *(Setting(name, str) for name in ("draft_model", "draft_revision", "target_model", "source", "notes")),
                    Setting("typical_epsilon", float, low=0, high=1, low_included=False),
                    Setting("typical_delta", float, low=0, low_included=False), Setting("accept_tolerance", float, low=0))


@dataclass
class SpeculativeConfig:
    """The settings of a speculative run: which drafter, how many draft tokens, which verifier, for which target.

    Every field but `method` defaults to `None`, meaning "the drafter's or verifier's own default" (read from
    its signature, so a config and a drafter never disagree), or "not set" for ids and notes. The config is
    validated on construction; `from_dict` (and so `from_pretrained`) warns about unknown keys.

    Args:
        method (`str`, defaults to `"prompt-lookup"`): a key of `hf_speculators.config.registry.METHOD_SPECS`: `"prompt-lookup"`,
            `"draft-model"`, `"layer-skip"` (`LayerSkipDrafter`), `"tree"` (`TreeDrafter`), `"suffix"`
            (`SuffixDrafter`), `"lookahead"` (`LookaheadDrafter`), `"hybrid"` (`HybridDrafter`), `"mtp"` (`MTPDrafter`:
            the target's multi-token-prediction layers), `"dflash"` (`DFlashDrafter`), `"gemma4-assistant"`
            (`Gemma4AssistantDrafter`, transformers >= 5.24), and methods that load
            as a config but cannot be built in this version (the speculators drafter types in
            `SPECULATORS_TYPES`).
        num_draft_tokens (`int`, *optional*): draft tokens per step (k), at least 1; under the `"goodput"`
            schedule the most a step drafts.
        num_draft_tokens_schedule (`str`, *optional*): how each step's draft length is chosen, a key of
            `SCHEDULES`: `"constant"` (unset means constant), `"heuristic"` (transformers' +2/-1 rule) or
            `"goodput"` (the length of the highest expected tokens per second, measured during the call; 0 to
            `num_draft_tokens`); see `hf_speculators.generate`. For a tree it chooses the depth.
        max_ngram_size (`int`, *optional*): prompt lookup's longest n-gram.
        min_ngram_size (`int`, *optional*): prompt lookup's shortest n-gram.
        num_candidates (`int`, *optional*): prompt lookup's continuations merged into one token tree (1: a chain).
        prefer (`str`, *optional*): prompt lookup's match rule among earlier occurrences, `"latest"` or
            `"earliest"` (`MATCH_RULES`).
        draft_model (`str`, *optional*): the draft model: a Hub id, a local folder or a demo id
            (`"hf_speculators/demo-draft"`); for speculators types, the speculator checkpoint.
        draft_revision (`str`, *optional*): the draft model's Hub branch, tag or commit.
        draft_quantization (`str`, *optional*): one of `QUANTIZATIONS` (`"int8"`, `"nf4"`, `"int4"`, `"fp8"`): the
            draft model is loaded quantized (see `hf_speculators.quantization`). Without `draft_model`, a copy of
            the target quantized so drafts (self-speculative decoding; methods `"draft-model"` and `"tree"`).
        exit_layer (`int`, *optional*): layer-skip's exit layer (the draft runs layers `[0, exit_layer)`).
        confidence_threshold (`float`, *optional*): layer-skip's adaptive draft length, in [0, 1): drafting stops
            after a token whose early-exit probability is below it (`LayerSkipDrafter`).
        draft_vocab (`str`, *optional*): layer-skip's reduced draft vocabulary (FR-Spec): a token ranking (a JSON
            list of token ids, the most frequent first; see `hf_speculators.vocab.load_token_ranking`): a local
            path, a demo model's file (`"hf_speculators/demo-target/token_ranking.json"`) or `"hf://ORG/REPO/FILE"`.
        draft_vocab_size (`int`, *optional*): how many of the ranking's first ids draft; unset: all of them.
        tree (`dict`, *optional*): the tree drafter's shape: `{"paths": [...]}` (a static tree of child ranks) or
            some of `{"depth", "top_k", "num_nodes"}` (a dynamic tree); see `hf_speculators.drafters.tree_shape`.
            Unset: `TreeDrafter`'s default dynamic tree.
        max_tree_depth (`int`, *optional*): suffix decoding's most tokens of a match and its draft together
            (`SuffixDrafter`; methods `"suffix"` and `"hybrid"`, as the five fields below).
        max_cached_requests (`int`, *optional*): suffix decoding's earlier rows kept in its cross-call memory.
        max_spec_factor (`float`, *optional*): suffix decoding's draft tokens allowed per matched token.
        max_spec_offset (`float`, *optional*): suffix decoding's draft tokens allowed besides those.
        min_token_prob (`float`, *optional*): suffix decoding's lowest estimated probability of a drafted token.
        use_tree_spec (`bool`, *optional*): suffix decoding drafts a token tree instead of a chain.
        window_size (`int`, *optional*): lookahead decoding's W (`LookaheadDrafter`).
        ngram_size (`int`, *optional*): lookahead decoding's N; its draft length is `ngram_size - 1`, so
            `num_draft_tokens` does not apply.
        verification_set_size (`int`, *optional*): lookahead decoding's G.
        model_method (`str`, *optional*): method `"hybrid"`'s model drafter: `"draft-model"` (the default) or
            `"eagle3"` (`draft_model` is then the head's checkpoint); `num_draft_tokens` is its draft length.
        verification (`str`, *optional*): a verifier name (`VERIFIERS`: `"exact"`, `"rejection"`, and the relaxed
            `"typical"` and `"top_k"`); by default exact for greedy decoding and rejection when sampling.
        typical_epsilon (`float`, *optional*): `typical` verification's epsilon, in (0, 1].
        typical_delta (`float`, *optional*): `typical` verification's delta, > 0.
        top_k (`int`, *optional*): `top_k` verification's number of target tokens (speculators'
            `verifier_accept_k`).
        accept_tolerance (`float`, *optional*): `top_k` verification's tolerance, >= 0 nats (speculators'
            `accept_tolerance`).
        target_model (`str`, *optional*): the target the settings were chosen for; building for another model
            warns.
        source (`str`, *optional*): where the recommended settings come from.
        notes (`str`, *optional*): free text for the model card.

    Raises:
        `ValueError`: a value out of range or of the wrong type, an unknown method or verification, a field
            the method or verification does not take, or a field the method requires that is missing; the
            message names the field.
    """

    method: str = "prompt-lookup"
    num_draft_tokens: int | None = None
    num_draft_tokens_schedule: str | None = None
    max_ngram_size: int | None = None
    min_ngram_size: int | None = None
    num_candidates: int | None = None
    prefer: str | None = None
    draft_model: str | None = None
    draft_revision: str | None = None
    draft_quantization: str | None = None
    exit_layer: int | None = None
    confidence_threshold: float | None = None
    draft_vocab: str | None = None
    draft_vocab_size: int | None = None
    tree: dict | None = None
    max_tree_depth: int | None = None
    max_cached_requests: int | None = None
    max_spec_factor: float | None = None
    max_spec_offset: float | None = None
    min_token_prob: float | None = None
    use_tree_spec: bool | None = None
    window_size: int | None = None
    ngram_size: int | None = None
    verification_set_size: int | None = None
    model_method: str | None = None
    verification: str | None = None
    typical_epsilon: float | None = None
    typical_delta: float | None = None
    top_k: int | None = None
    accept_tolerance: float | None = None
    target_model: str | None = None
    source: str | None = None
    notes: str | None = None

    def __post_init__(self):
        for name in ("method", "num_draft_tokens_schedule", "draft_quantization", "verification"):
            if name != "method" and getattr(self, name) is None:
                continue
            if not isinstance(getattr(self, name), str):
                _fail(name, "a name (a string)", getattr(self, name))
        for setting in (*_SHARED_SETTINGS[:2], *method_settings().values(), *_SHARED_SETTINGS[2:]):
            setting.check(getattr(self, setting.name))
        if self.num_draft_tokens_schedule is not None and self.num_draft_tokens_schedule not in SCHEDULES:
            _fail("num_draft_tokens_schedule", f"one of {sorted(SCHEDULES)}", self.num_draft_tokens_schedule)
        if self.draft_quantization is not None and self.draft_quantization not in QUANTIZATIONS:
            _fail("draft_quantization", f"one of {QUANTIZATIONS}", self.draft_quantization)
        if self.tree is not None and not isinstance(self.tree, dict):
            _fail("tree", "a mapping of the tree drafter's arguments", self.tree)
        if self.draft_vocab_size is not None and self.draft_vocab is None:
            raise ValueError("draft_vocab_size takes the first ids of a token ranking: set draft_vocab as well.")
        if self.min_ngram_size and self.max_ngram_size and self.min_ngram_size > self.max_ngram_size:
            raise ValueError(
                f"min_ngram_size ({self.min_ngram_size}) must not exceed max_ngram_size ({self.max_ngram_size})."
            )
        self._check_method_fields()
        self._check_verification_fields()

    def _check_method_fields(self) -> None:
        spec = METHOD_SPECS.get(self.method)
        if spec is None:
            _fail("method", f"one of {sorted(METHOD_SPECS)}", self.method)
        for name in spec.required:
            if getattr(self, name) is None and not self.is_self_draft:
                raise ValueError(f"{name} is required for method={self.method!r}.")
        if spec.no_draft_tokens is not None and self.num_draft_tokens is not None:
            raise ValueError(f"num_draft_tokens does not apply to method={self.method!r}: {spec.no_draft_tokens}")
        method_specific = {name for method in METHOD_SPECS for name in method_fields(method)}
        for name in sorted(method_specific - set(method_fields(self.method))):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} does not apply to method={self.method!r}; remove it or change the method.")

    def _check_verification_fields(self) -> None:
        if self.verification is not None and self.verification not in {*VERIFIERS, *VERIFIER_PARAMS}:
            _fail("verification", f"one of {sorted({*VERIFIERS, *VERIFIER_PARAMS})}", self.verification)
        for verification, params in VERIFIER_PARAMS.items():
            for name in params:
                if verification != self.verification and getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} applies to verification={verification!r} only, not to {self.verification!r}."
                    )

    @property
    def is_self_draft(self) -> bool:
        """Whether a quantized copy of the target drafts: `draft_quantization` set and `draft_model` not."""
        spec = METHOD_SPECS.get(self.method)
        loads_draft = spec is not None and spec.loads == "draft-model"
        return loads_draft and self.draft_model is None and self.draft_quantization is not None

    def resolved(self, name: str):
        """The value `build` uses for field `name`: the field if set, else the drafter's default (or `None`); a
        learned head's `tree` sets the number of draft tokens to its depth, lookahead's `ngram_size` to N - 1."""
        value, spec = getattr(self, name), METHOD_SPECS.get(self.method)
        if value is not None or spec is None or spec.drafter is None:
            return value
        if name == "num_draft_tokens" and spec.draft_length is not None and spec.draft_length(self) is not None:
            return spec.draft_length(self)
        parameter = inspect.signature(spec.drafter).parameters.get(name)
        return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default

    def to_dict(self) -> dict:
        """The fields that are set, in declaration order (the `speculative_decoding:` block of a model card)."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    @classmethod
    def from_dict(cls, settings: dict) -> "SpeculativeConfig":
        """Builds a config from a mapping of field names; unknown keys are ignored with a warning."""
        if not isinstance(settings, dict):
            raise ValueError(f"speculative settings must be a mapping of field names to values, got {settings!r}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            warnings.warn(f"Ignoring unknown speculative_decoding keys {unknown}; known keys: {sorted(known)}.")
        return cls(**{key: value for key, value in settings.items() if key in known})

    def override(self, **changes) -> "SpeculativeConfig":
        """A copy with `changes` applied. Changing the method drops the settings tuned for the old one (the fields
        only it took, e.g. `draft_model`, and `num_draft_tokens`); changing the verification drops its parameters."""
        settings = self.to_dict()
        if changes.get("method", self.method) != self.method:
            for name in {"num_draft_tokens", *method_fields(self.method)} - set(method_fields(changes["method"])):
                settings.pop(name, None)
        if changes.get("verification", self.verification) != self.verification:
            for name in VERIFIER_PARAMS.get(self.verification, {}):
                settings.pop(name, None)
        return type(self).from_dict({**settings, **changes})

    @classmethod
    def from_pretrained(cls, repo_id_or_path: str, revision: str | None = None, token: str | None = None):
        """Loads a preset: a model card with a `speculative_decoding:` block, or a speculators-format config.json.

        Args:
            repo_id_or_path (`str`): a local `README.md` or `config.json`, a folder holding one, the name of a
                bundled preset (`hf-speculators presets` lists them), or a Hub repo id (needs a network).
            revision (`str`, *optional*): Hub branch, tag or commit.
            token (`str`, *optional*): Hub token for private or gated repos.

        Raises:
            `ValueError`: malformed YAML or JSON, no settings found, invalid settings (naming the field), or a name
                that is neither local nor bundled and whose Hub repo cannot be read (listing the bundled presets).
            `FileNotFoundError`: a local path that does not exist.
        """
        return cls.from_dict(presets.read_settings(str(repo_id_or_path), revision=revision, token=token))

    def save_pretrained(self, save_directory: str | Path) -> Path:
        """Writes a Hub-style model card (`README.md`) holding this config into `save_directory` (created if
        needed), all at once (`hf_speculators.folders.write_folder`: an interrupted save leaves nothing half-written);
        returns its path.

        Raises:
            `NotADirectoryError`: `save_directory` is a file.
        """
        directory = Path(save_directory)
        text = presets.card_text(self, name=directory.resolve().name)
        write_folder(directory, lambda folder: (folder / "README.md").write_text(text, encoding="utf-8"))
        return directory / "README.md"

    def push_to_hub(self, repo_id: str, token: str | None = None, private: bool | None = None,
                    commit_message: str = "Upload speculative decoding preset"):
        """Creates the Hub model repo `repo_id` if needed and uploads this config as its model card."""
        return presets.push_card(self, repo_id, token=token, private=private, commit_message=commit_message)

    def to_vllm(self) -> dict:
        """The `speculative_config` dict that runs the same method in vLLM (`LLM(model=target,
        speculative_config=...)`). Raises `ValueError` naming the field that vLLM has no equivalent for."""
        return to_vllm(self)

    def build(self, target, tokenizer=None):
        """Returns `(drafter, verifier)` for `target` (see `hf_speculators.config.build.build`)."""
        return build(self, target, tokenizer)
