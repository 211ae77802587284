"""The same preset in our `generate()` and in vLLM's CPU build: batch-1 latency and batch-8 throughput of every
exportable demo preset and of plain decoding, on the same token-id prompts, one thread each. Run it as
`python -m hf_speculators.vllm_check.bench --out records.jsonl [--prompt-set FILE] [--compile]` (vLLM's environment:
`tests/make_vllm_env.sh`; `--compile`: both engines compiled);
docs/benchmarks/vllm.md holds its figures."""

import argparse
import functools
import json
import tempfile
import time

import torch

from ..config import SpeculativeConfig
from ..config.vllm_export import export
from ..decoding import generate
from ..loading import load_model, load_tokenizer, resolve_model_id
from ..onednn_linear import cpu_linear_kernel, with_cpu_linear
from ..tools.bench.engines import compiled_kwargs
from ..tools.cli_parser import add_cpu_linear_option
from .check import comparable, request
from .client import run_vllm
from .compare import encode_prompts, vllm_acceptance

TARGET = "hf_speculators/demo-target"
# the exportable demo presets and the draft length each is served with (demo-draft-model's card says 6 with a
# goodput schedule; vLLM has no schedule, and a fixed 3 is what its measurements favoured)
DEMO_PRESETS = {"demo-eagle3": 3, "demo-draft-model": 3, "demo-medusa": 3, "demo-prompt-lookup": 8}


def _new_tokens(row: list[int], eos_id: int) -> int:
    """New tokens of one generated row, its end-of-sequence token included (as vLLM counts them), padding not."""
    return row.index(eos_id) + 1 if eos_id in row else len(row)


def _ours(model, prompts, max_new_tokens: int, config, pad_id: int, batch: bool, compiled: bool = False):
    """Seconds and new tokens of our greedy `generate()` on `prompts`: one call per prompt, or one left-padded
    batch; `compiled`: with a static cache and compiled forwards, as the bench's `--compile` runs them."""
    eos_id = model.generation_config.eos_token_id
    eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
    kwargs = {"do_sample": False, "max_new_tokens": max_new_tokens, "pad_token_id": pad_id}
    kwargs |= compiled_kwargs(model) if compiled else {}
    if config is not None:
        kwargs.update(custom_generate=generate, speculative_config=config)
    groups = [prompts] if batch else [[ids] for ids in prompts]
    seconds = tokens = 0
    for group in groups:
        width = max(map(len, group))
        input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in group])
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in group])
        start = time.perf_counter()
        out = model.generate(input_ids, attention_mask=mask, **kwargs)
        seconds += time.perf_counter() - start
        sequences = out if isinstance(out, torch.Tensor) else out.sequences
        tokens += sum(_new_tokens(row, eos_id) for row in sequences[:, width:].tolist())
    return seconds, tokens


def measure(name: str | None, model, prompts, max_new_tokens: int, pad_id: int, target: str, vllm_python=None,
            compiled: bool = False) -> dict:
    """One record: `name` (a preset, `None`: plain decoding) in both engines, batch 1 (one prompt at a time:
    seconds per prompt) and batch 8 (all prompts at once: new tokens per second), after a warm-up pass each;
    `compiled`: both engines compile (ours as the bench's `--compile`, vLLM its default `torch.compile`), and the
    warm-up passes run every prompt at both batch sizes, so that the timed passes compile nothing."""
    with tempfile.TemporaryDirectory(prefix="hf-speculators-vllm-bench-") as folder:  # Medusa heads in vLLM's layout
        return _measure(name, model, prompts, max_new_tokens, pad_id, target, vllm_python, folder, compiled)


def _measure(name, model, prompts, max_new_tokens, pad_id, target, vllm_python, folder, compiled) -> dict:
    config = exported = None
    if name is not None:
        config = SpeculativeConfig.from_pretrained(name).override(num_draft_tokens=DEMO_PRESETS[name])
        exported, _ = export(config, folder)
        config = comparable(config)
    ours = functools.partial(_ours, model, max_new_tokens=max_new_tokens, config=config, pad_id=pad_id,
                             compiled=compiled)
    if compiled:  # warm-up: the shapes of every timed call
        ours(prompts, batch=False)
        ours(prompts, batch=True)
    else:
        ours(prompts[:1], max_new_tokens=8, batch=False)
    latency, throughput = ours(prompts, batch=False), ours(prompts, batch=True)
    passes = ("batch", "each", "each", "batch") if compiled else ("batch", "each", "batch")
    served = run_vllm(request(target, prompts, max_new_tokens, exported, passes, compiled), vllm_python)
    vllm_tokens = sum(map(len, served["outputs"]))
    per_position, length = vllm_acceptance(served["counters"])
    timed = served["pass_seconds"][-2:]  # batch 1, then batch 8
    return {
        "preset": name or "plain", "speculative_config": exported, "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens, "vllm_version": served["vllm_version"], "compiled": compiled,
        "ours": {"batch1_seconds_per_prompt": latency[0] / len(prompts), "batch1_tokens": latency[1],
                 "batch8_tokens_per_second": throughput[1] / throughput[0]},
        "vllm": {"batch1_seconds_per_prompt": timed[0] / len(prompts), "batch1_tokens": vllm_tokens,
                 "batch8_tokens_per_second": vllm_tokens / timed[1],
                 "startup_seconds": served["startup_seconds"], "mean_acceptance_length": length,
                 "acceptance_rate_per_position": per_position},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8, help="how many prompts (the batch size of batch 8)")
    parser.add_argument("--prompt-set", default="spec-bench",
                        help="where the prompts come from: spec-bench or a prompts file (JSONL, as the bench reads)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--presets", default=",".join(["plain", *DEMO_PRESETS]))
    parser.add_argument("--vllm-python", default=None)
    parser.add_argument("--compile", action="store_true", help="both engines compiled: ours with a static cache and "
                        "torch.compile (the bench's --compile), vLLM with its own compile on (no enforce_eager)")
    parser.add_argument("--out", required=True, help="JSON-lines records, appended")
    add_cpu_linear_option(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    folder = resolve_model_id(TARGET)
    model, tokenizer = with_cpu_linear(load_model(folder), args.cpu_linear), load_tokenizer(folder)
    prompts = encode_prompts(tokenizer, args.prompts, args.prompt_set)
    for name in args.presets.split(","):
        record = measure(None if name == "plain" else name, model, prompts, args.max_new_tokens,
                         tokenizer.pad_token_id, folder, args.vllm_python, args.compile)
        record["ours"]["cpu_linear"] = cpu_linear_kernel(model)
        print(json.dumps(record), flush=True)
        with open(args.out, "a", encoding="utf-8") as file:
            file.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
