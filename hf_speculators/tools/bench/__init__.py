"""Benchmarks: the same prompts through plain greedy decoding and each speculative method, in one process.

`run_benchmark` warms every method up, then runs the methods back to back on each prompt (so that machine noise
hits all of them alike), checks that every exact method reproduces plain greedy decoding token for token, writes
one JSONL record per (prompt, method) (format: `records`) and summarises tokens/s, speedup, mean acceptance length
and the identical-output rate per category. With `batch_size=B > 1` the prompts are grouped in order into batches
of B (left padded) and every method, plain batched `generate()` included, runs once per batch (`batches`).

One module per job: `settings` (the method names, `BenchMethod`, `BenchSettings`, `named_methods`,
`preset_methods`), `engines` (the `generate` keywords of each method, transformers' baselines pinned), `timing`
(timed generate calls and forwards), `batches`, `records` (provenance, `RecordWriter`, `read_records`), `summaries`
(`summarize`, `BenchmarkResult`) and `run` (`run_benchmark`). Prompts are read by `hf_speculators.prompts`.
"""

from ...prompts import Prompt, load_prompts
from .records import RecordWriter, read_records
from .run import run_benchmark
from .settings import (
    DEFAULT_METHODS, BenchMethod, BenchSettings, bench_methods, draft_model_methods, exit_layer_methods, named_methods,
    preset_methods, transformers_methods, variant_label,
)
from .summaries import FIGURE_FORMATS, BenchmarkResult, summarize

__all__ = ["DEFAULT_METHODS", "FIGURE_FORMATS", "BenchMethod", "BenchSettings", "BenchmarkResult", "Prompt",
           "RecordWriter", "bench_methods", "draft_model_methods", "exit_layer_methods", "load_prompts", "named_methods",
           "preset_methods", "read_records", "run_benchmark", "summarize", "transformers_methods", "variant_label"]
