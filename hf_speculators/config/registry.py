"""The method registry: `METHOD_SPECS`, a plain dict of every method's `MethodSpec` (the drafters' and the
speculators types vLLM runs), and what the outer ring reads from it. Read it at call time, never into a constant at
import, so that a spec added to the dict (a new drafter, a test's toy one) is seen everywhere."""

from ..drafters import DRAFTER_SPECS
from ..drafters.spec import MethodSpec, Setting, Variant
from ..drafters.tree_growth import TREE_SETTINGS
from .speculators_format import SPECULATORS_SPECS

METHOD_SPECS: dict[str, MethodSpec] = {**DRAFTER_SPECS, **SPECULATORS_SPECS}


def named_methods() -> dict[str, tuple[MethodSpec, Variant]]:
    """The named methods of the command line and the benchmark (`"draft-model-tree"`): name -> (spec, variant)."""
    return {name: (spec, variant) for spec in METHOD_SPECS.values() for name, variant in spec.variants.items()}


def head_methods() -> tuple[str, ...]:
    """The config methods of learned draft heads on the target's hidden states (their `draft_model`: the head)."""
    return tuple(name for name, spec in METHOD_SPECS.items() if spec.loads == "head")


def checkpoint_of(spec: MethodSpec, variant: Variant) -> Setting | None:
    """The `method_config` keyword that names a named method's `draft_model` (`None`: it takes none)."""
    return None if variant.checkpoint is False else variant.checkpoint or spec.checkpoint


def method_settings() -> dict[str, Setting]:
    """Every method's own settings (config fields), by name, the first declaration of a shared one."""
    settings = {}
    for spec in METHOD_SPECS.values():
        for setting in spec.settings:
            settings.setdefault(setting.name, setting)
    return settings


def checkpoint_settings() -> dict[str, Setting]:
    """The keywords (and flags) that name a method's checkpoint besides `draft_model` (`--draft`): `eagle_head`..."""
    named = (checkpoint_of(spec, variant) for spec, variant in named_methods().values())
    return {setting.name: setting for setting in named if setting is not None and setting.name != "draft_model"}


def method_options() -> dict[str, Setting]:
    """`method_config`'s keywords besides `draft_model` and `num_draft_tokens`: the settings, the tree shape's and
    the checkpoints', in the order of the command line's flags."""
    return {**method_settings(), **{s.name: s for s in TREE_SETTINGS}, **checkpoint_settings()}


def checkpoint_methods() -> dict[str, tuple[str, ...]]:
    """Checkpoint keyword (`eagle_head`) -> the config methods whose `draft_model` it names (`("eagle3", "eagle")`)."""
    return {name: tuple(spec.name for spec in METHOD_SPECS.values()
                        if spec.checkpoint is not None and spec.checkpoint.name == name)
            for name in checkpoint_settings()}
