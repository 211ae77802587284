"""Runs one vLLM engine on token-id prompts and writes its greedy outputs, timings and speculative-decoding counters
as JSON. A standalone script for vLLM's own Python (its virtual environment, `tests/make_vllm_env.sh`): it imports
nothing from hf_speculators, and hf_speculators never imports vLLM (`hf_speculators.vllm_check.client` runs it).

Usage: `VLLM_PYTHON worker.py REQUEST.json RESULT.json`. The request holds `target` (a model folder), `prompts`
(lists of token ids), `max_tokens`, `speculative_config` (vLLM's dict, or null for plain decoding), `dtype`,
`max_model_len`, `kv_cache_memory_bytes`, `threads` (OpenMP threads of the engine, default 1), `enforce_eager`
(default true: vLLM's compile off) and `passes`: how
the prompts are generated, in order, each timed into `pass_seconds` (`"batch"`: all prompts in one `generate`
call; `"each"`: one call per prompt). Outputs and counters come from the first pass. vLLM spawns its engine in
another process, hence the `__main__` guard.
"""

import json
import os
import sys
import time

# CPU backend settings before vLLM is imported: no thread pinning on a shared machine
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

COUNTERS = {  # vLLM's metric names -> the result's keys
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(llm) -> dict:
    """vLLM's speculative-decoding counters summed over engines: drafts, draft tokens, accepted tokens and accepted
    tokens per draft position (`num_accepted_tokens_per_pos`)."""
    counters = {key: 0 for key in COUNTERS.values()}
    counters["num_accepted_tokens_per_pos"] = []
    for metric in llm.get_metrics():
        if metric.name in COUNTERS:
            counters[COUNTERS[metric.name]] += int(metric.value)
        elif metric.name == PER_POSITION:
            per_position = counters["num_accepted_tokens_per_pos"]
            per_position += [0] * (len(metric.values) - len(per_position))
            for i, value in enumerate(metric.values):
                per_position[i] += int(value)
    return counters


def main(request_path: str, result_path: str) -> None:
    with open(request_path, encoding="utf-8") as file:
        request = json.load(file)
    os.environ["OMP_NUM_THREADS"] = str(request.get("threads", 1))  # the engine process inherits it
    started = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(model=request["target"], dtype=request.get("dtype", "float32"),
              enforce_eager=request.get("enforce_eager", True),
              max_model_len=request.get("max_model_len", 512), max_num_seqs=request.get("max_num_seqs", 8),
              kv_cache_memory_bytes=request.get("kv_cache_memory_bytes", 1 << 28), gpu_memory_utilization=0.05,
              disable_log_stats=False, seed=0, speculative_config=request.get("speculative_config"))
    startup = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"],
                            ignore_eos=request.get("ignore_eos", False))
    prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
    result = {"vllm_version": vllm.__version__, "startup_seconds": startup, "pass_seconds": []}
    for i, mode in enumerate(request.get("passes", ["batch"])):
        begin = time.perf_counter()
        if mode == "batch":
            outputs = llm.generate(prompts, params, use_tqdm=False)
        else:
            outputs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
        result["pass_seconds"].append(time.perf_counter() - begin)
        if i == 0:
            result["outputs"] = [list(output.outputs[0].token_ids) for output in outputs]
            result["counters"] = read_counters(llm)
    with open(result_path, "w", encoding="utf-8") as file:
        json.dump(result, file)


if __name__ == "__main__":
    main(*sys.argv[1:3])
