"""Reading the speculative settings of a vllm-project/speculators `config.json` as `SpeculativeConfig` fields.

A speculators checkpoint keeps its settings in its `config.json`:

    {"speculators_model_type": "eagle3",
     "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                            "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "architectures": []}},
     ...}
"""

from ..drafters.spec import MethodSpec, VllmMapping

# `speculators_model_type` values of the format; they load as a config (and export to vLLM) but need a drafter
# architecture that hf_speculators does not implement
SPECULATORS_TYPES = ("eagle", "eagle3", "peagle", "dflash", "dspark", "mtp")
# the types with no drafter here (the others are drafters' methods): vLLM runs them (peagle as eagle3 with parallel
# drafting, as vLLM's own reader of the speculators format does)
SPECULATORS_SPECS = {name: MethodSpec(name, required=("draft_model",), shared=("draft_revision",), vllm=vllm)
                     for name, vllm in (("peagle", VllmMapping("eagle3", fixed={"parallel_drafting": True})),
                                        ("dspark", VllmMapping("dspark")))}


def is_speculators_config(config_json: dict) -> bool:
    """Whether a parsed `config.json` is in the speculators format."""
    return isinstance(config_json, dict) and "speculators_model_type" in config_json


def _proposal(speculators_config: dict) -> dict:
    """The proposal method named by `default_proposal_method`, else the first one (as vLLM picks it)."""
    methods = speculators_config.get("proposal_methods")
    if not isinstance(methods, list) or not methods or not all(isinstance(m, dict) for m in methods):
        raise ValueError("speculators_config.proposal_methods must be a non-empty list of mappings.")
    default = speculators_config.get("default_proposal_method")
    return next((m for m in methods if m.get("proposal_type") == default), methods[0])


def _verification(proposal: dict) -> dict:
    """`top_k` verification when the proposal accepts more than the target's top token, else nothing."""
    accept_k = proposal.get("verifier_accept_k", 1)
    tolerance = proposal.get("accept_tolerance", 0.0)
    if accept_k == 1 and tolerance == 0:
        return {}
    return {"verification": "top_k", "top_k": accept_k, "accept_tolerance": tolerance}


def speculators_settings(config_json: dict, name_or_path: str) -> dict:
    """Maps a speculators-format `config.json` onto `SpeculativeConfig` fields.

    `speculators_model_type` becomes the method, the checkpoint itself the draft model, `speculative_tokens` of
    the default proposal method the number of draft tokens, `verifier.name_or_path` the target model, and
    `verifier_accept_k > 1` or `accept_tolerance > 0` the `top_k` verification with those values.

    Args:
        config_json (`dict`): the parsed `config.json`.
        name_or_path (`str`): where it was read from (Hub id or folder): the draft model of the config.

    Raises:
        `ValueError`: an unknown `speculators_model_type`, or a missing or malformed `speculators_config`, naming
            the field.
    """
    model_type = config_json["speculators_model_type"]
    if model_type not in SPECULATORS_TYPES:
        raise ValueError(
            f"{name_or_path}: speculators_model_type={model_type!r} is not a speculators drafter type that "
            f"hf_speculators knows ({', '.join(SPECULATORS_TYPES)})."
        )
    speculators_config = config_json.get("speculators_config")
    if not isinstance(speculators_config, dict):
        raise ValueError(f"{name_or_path}: config.json has no speculators_config mapping.")
    proposal = _proposal(speculators_config)
    verifier = speculators_config.get("verifier") or {}
    settings = {
        "method": model_type,
        "num_draft_tokens": proposal.get("speculative_tokens"),
        "draft_model": name_or_path,
        **_verification(proposal),
        "target_model": verifier.get("name_or_path") if isinstance(verifier, dict) else None,
        "source": (
            f"speculators-format config.json of {name_or_path} (speculators "
            f"{config_json.get('speculators_version', 'version unknown')}, proposal method "
            f"{proposal.get('proposal_type')!r})"
        ),
    }
    return {key: value for key, value in settings.items() if value is not None}
