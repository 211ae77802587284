"""Serving an exported config in vLLM and comparing it with our `generate()` on the same prompts: greedy outputs
(vLLM speculative vs vLLM plain, vLLM plain vs ours) and acceptance per draft position. Used by
`hf-speculators export NAME --to vllm --check` and by tests/test_vllm_serving.py."""

from dataclasses import dataclass, field

from ..loading import load_model, load_tokenizer, resolve_model_id
from ..metrics import SpeculativeStats
from ..verifiers import VERIFIERS
from .client import run_vllm
from .compare import Difference, acceptance_gap, differences, encode_prompts, our_outputs, side_by_side


def comparable(config):
    """`config` as vLLM runs it: a fixed draft length (vLLM has no per-step schedule) and exact verification (vLLM
    verifies losslessly; a relaxed verifier such as Medusa's typical acceptance is replaced by the exact one)."""
    changes = {}
    if config.num_draft_tokens_schedule not in (None, "constant"):
        changes["num_draft_tokens_schedule"] = "constant"
    verification = config.verification
    if verification is not None and not (verification in VERIFIERS and VERIFIERS[verification].lossless):
        changes["verification"] = None
    return config.override(**changes) if changes else config


@dataclass
class Reference:
    """The target (its folder, model and tokenizer), the prompts (token ids), and both engines' plain greedy new
    tokens per prompt (`ours`, `vllm`), shared by the checks of one target."""

    target: str
    model: object
    tokenizer: object
    prompts: list[list[int]]
    max_new_tokens: int
    ours: list[list[int]]
    vllm: list[list[int]]
    vllm_python: str | None = None

    @classmethod
    def build(cls, target: str, num_prompts: int | None = 8, max_new_tokens: int = 64, vllm_python=None,
              prompts: str = "spec-bench") -> "Reference":
        """Loads `target` (fp32, CPU), encodes the first `num_prompts` (`None`: all) of `prompts` (Spec-Bench, or a
        prompts file) and generates both engines' plain greedy outputs of `max_new_tokens` tokens (one vLLM engine
        start)."""
        folder = resolve_model_id(target)
        model, tokenizer = load_model(folder), load_tokenizer(folder)
        prompts = encode_prompts(tokenizer, num_prompts, prompts)
        ours, _ = our_outputs(model, prompts, max_new_tokens)
        served = run_vllm(request(folder, prompts, max_new_tokens, None), vllm_python)
        return cls(folder, model, tokenizer, prompts, max_new_tokens, ours, served["outputs"], vllm_python)


def request(target: str, prompts, max_new_tokens: int, speculative_config: dict | None, passes=("batch",),
            compiled: bool = False) -> dict:
    """`worker.py`'s request: greedy, fp32, a 256 MiB KV cache, contexts up to 512 tokens, eager execution unless
    `compiled` (vLLM's own `torch.compile` of the model, its default)."""
    return {"target": target, "prompts": prompts, "max_tokens": max_new_tokens, "dtype": "float32",
            "speculative_config": speculative_config, "max_model_len": 512, "kv_cache_memory_bytes": 1 << 28,
            "passes": list(passes), "enforce_eager": not compiled}


@dataclass
class CheckResult:
    """One exported config served in vLLM beside our run of the same config.

    Attributes:
        speculative_config (`dict`): what vLLM was given.
        spec_vs_plain (`int`): prompts whose vLLM speculative output equals vLLM's plain output.
        cross_engine (`list[Difference]`): prompts whose vLLM plain output differs from ours, with the target's
            top-1/top-2 logit margin at the first differing position (a near-tie passes).
        stats (`SpeculativeStats`): our figures for the config as vLLM runs it (`comparable`).
        counters (`dict`): vLLM's `spec_decode_*` counters.
        gap (`float`): the largest difference of acceptance per position, ours vs vLLM's.
        num_prompts (`int`), vllm_seconds (`float`): prompts served; seconds of vLLM's generate call.
    """

    speculative_config: dict
    spec_vs_plain: int
    cross_engine: list[Difference]
    stats: SpeculativeStats
    counters: dict
    gap: float
    num_prompts: int
    vllm_seconds: float = 0.0
    ours_identical: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        """vLLM's speculative output is its plain output on every prompt, and its plain output ours (or a near-tie)."""
        return self.spec_vs_plain == self.num_prompts and all(d.near_tie for d in self.cross_engine)

    def report(self) -> str:
        """The side-by-side lines `export --check` prints."""
        cross = ", ".join(f"prompt {d.prompt} token {d.position} (margin {d.margin:.2g}"
                          f"{', a near-tie' if d.near_tie else ''})" for d in self.cross_engine) or "none"
        return "\n".join([
            f"vLLM speculative_config: {self.speculative_config}",
            f"greedy output, vLLM speculative = vLLM plain: {self.spec_vs_plain}/{self.num_prompts} prompts",
            f"greedy output, vLLM plain = ours: {self.num_prompts - len(self.cross_engine)}/{self.num_prompts} "
            f"prompts (differences: {cross})",
            f"our speculative output = our plain output: {self.ours_identical}/{self.num_prompts} prompts",
            side_by_side(self.stats, self.counters),
            f"largest difference of acceptance per position: {self.gap:.3f}",
        ])


def check(reference: Reference, config, speculative_config: dict) -> CheckResult:
    """Serves `speculative_config` (vLLM's dict, exported from `config`) in vLLM on the reference's prompts and runs
    `comparable(config)` here on the same prompts.

    Raises:
        `RuntimeError`: vLLM failed (its log's tail in the message). `FileNotFoundError`: no vLLM environment.
    """
    served = run_vllm(request(reference.target, reference.prompts, reference.max_new_tokens, speculative_config),
                      reference.vllm_python)
    ours, stats = our_outputs(reference.model, reference.prompts, reference.max_new_tokens, comparable(config),
                              reference.tokenizer)
    return CheckResult(
        speculative_config=speculative_config,
        spec_vs_plain=sum(a == b for a, b in zip(served["outputs"], reference.vllm)),
        cross_engine=differences(reference.model, reference.prompts, reference.ours, reference.vllm),
        stats=stats, counters=served["counters"], gap=acceptance_gap(stats, served["counters"]),
        num_prompts=len(reference.prompts), vllm_seconds=served["pass_seconds"][0],
        ours_identical=sum(a == b for a, b in zip(ours, reference.ours)),
    )


def check_export(config, exported: dict, vllm_python=None, num_prompts: int = 4,
                 max_new_tokens: int = 32, prompts: str = "spec-bench") -> CheckResult:
    """`hf-speculators export NAME --to vllm --check`: serves `exported` (vLLM's `speculative_config` for `config`,
    from `hf_speculators.config.vllm_export.export`) and the plain target in vLLM on the first `num_prompts` of
    `prompts` (Spec-Bench, or a prompts file: `--prompts`), and compares with our run of the same config (two vLLM engine starts, about a minute each
    on a CPU).

    Raises:
        `ValueError`: a config without `target_model`.
        `FileNotFoundError`: no vLLM environment. `RuntimeError`: vLLM failed.
    """
    if config.target_model is None:
        raise ValueError("--check serves the export on its target: the preset sets no target_model.")
    reference = Reference.build(config.target_model, num_prompts, max_new_tokens, vllm_python, prompts)
    return check(reference, config, exported)
