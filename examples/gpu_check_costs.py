"""The GPU check's `curve` and `curve-compiled` stages: what a verify forward of q query tokens costs on a 1B target,
and how much of the speedup those costs allow the loop delivers when exactly n draft tokens are accepted per step,
eagerly, then (`curve-compiled`) with plain decoding and ours both compiled (a static cache, CUDA graphs).

The target is a Llama of about 1.1B parameters (TinyLlama's shape) built from its config with random weights in
float32, TF32 off: its costs are real, its text is not. Float32, not bfloat16: on an H200 (2026-11-26) the
bfloat16 model's 5-token verify forwards left its own one-token greedy output at every accepted count, so no
loop efficiency was measured. Its initializer range is large so that its next-token distributions are peaky
(greedy decoding far from ties, as the tests' tiny models). The drafter is the test suite's `ScriptedDrafter`
(tests/drafters_for_tests.py): the first n of its k tokens are the target's own greedy tokens, the rest wrong,
so exactly n are accepted and drafting costs next to nothing.
"""

import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import hf_speculators as hs
from hf_speculators.cache import cache_argument

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from drafters_for_tests import ScriptedDrafter  # noqa: E402

QUERY_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
NUM_DRAFT_TOKENS = 4
SHAPES = {  # (full, smoke): hidden, intermediate, layers, heads, key-value heads, vocabulary, dtype
    False: (2048, 5632, 22, 32, 4, 32000, torch.float32),
    True: (64, 128, 2, 4, 2, 256, torch.float32),  # float32: the smoke test's greedy outputs must not tie
}


def target_1b(device: str, smoke: bool) -> LlamaForCausalLM:
    """The randomly initialised Llama of `SHAPES` (a 2-layer float32 stand-in with `smoke`) on `device`, in eval
    mode, with no BOS, EOS or PAD token (greedy decoding runs its full length)."""
    hidden, intermediate, layers, heads, kv_heads, vocab, dtype = SHAPES[smoke]
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                         initializer_range=0.25, max_position_embeddings=4096, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 matmuls in float32: a verify forward must not tie
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.bos_token_id = model.generation_config.eos_token_id = None
    return model


def clock(device: str) -> float:
    """`time.perf_counter()` once the work queued on `device` has finished."""
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter()


@torch.no_grad()
def verify_cost_curve(stage, model) -> dict[int, float]:
    """Median milliseconds of a forward of q tokens of `model` after a cached context, per q in `QUERY_SIZES`,
    recorded with its ratio to one token's; returns q -> ratio."""
    context, repeats = (16, 2) if stage.smoke else (512, 10)
    cache = DynamicCache(config=model.config)
    cache_kwargs = {cache_argument(model): cache}
    model(torch.randint(model.config.vocab_size, (1, context), device=stage.device), use_cache=True, **cache_kwargs)
    milliseconds = {}
    for size in QUERY_SIZES:
        times = []
        for _ in range(repeats + 1):  # the first warms up
            query = torch.randint(model.config.vocab_size, (1, size), device=stage.device)
            start = clock(stage.device)
            model(query, use_cache=True, logits_to_keep=size, **cache_kwargs)
            times.append(clock(stage.device) - start)
            cache.crop(-size)
        milliseconds[size] = 1000 * statistics.median(times[1:])
    for size, ms in milliseconds.items():
        stage.record(measure="verify_cost", query_tokens=size, context=context, ms=round(ms, 3),
                     ratio=round(ms / milliseconds[1], 3))
    return {size: ms / milliseconds[1] for size, ms in milliseconds.items()}


@torch.no_grad()
def loop_efficiency(stage, model, ratios: dict[int, float] | None, **compiled) -> None:
    """Per accepted count n (0 to k), the speedup of `model`'s greedy decoding with `ScriptedDrafter` over plain
    decoding, and its share of the speedup the verify cost allows: (n + 1) tokens per step for one (k + 1)-token
    forward (`ratios`: `verify_cost_curve`'s). With `compiled` (the `generate` keywords of compiled decoding), plain
    and ours both run compiled, and with `ratios=None` the ideal is n + 1, an upper bound (a verify forward costing
    one token's: memory-bound forwards at batch size 1 come close)."""
    new_tokens = 8 if stage.smoke else 64
    prompt = torch.randint(model.config.vocab_size, (1, 32), device=stage.device)
    mode = {"mode": "compiled" if compiled else "eager"}
    plain_seconds, reference = timed_generate(stage.device, lambda: model.generate(
        prompt, do_sample=False, max_new_tokens=new_tokens, **compiled))
    stage.record(measure="loop_efficiency", **mode, plain_ms_per_token=round(1000 * plain_seconds / new_tokens, 3))
    for accepted in range(NUM_DRAFT_TOKENS + 1):
        drafter = ScriptedDrafter(reference, NUM_DRAFT_TOKENS, num_correct=accepted)
        try:
            seconds, result = timed_generate(stage.device, lambda: model.generate(  # noqa: B023 (called at once)
                prompt, do_sample=False, max_new_tokens=new_tokens, custom_generate=hs.generate,
                candidate_generator=drafter, return_dict_in_generate=True, **compiled))
        except AssertionError as error:  # the scripted drafter found the target off its own greedy output
            stage.record(measure="loop_efficiency", **mode, accepted=accepted, error=str(error))
            continue
        speedup = plain_seconds / seconds
        ideal = (accepted + 1) / (1.0 if ratios is None else ratios[NUM_DRAFT_TOKENS + 1])
        stage.record(measure="loop_efficiency", **mode, num_draft_tokens=NUM_DRAFT_TOKENS, accepted=accepted,
                     identical=bool(torch.equal(result.sequences, reference)), speedup=round(speedup, 3),
                     ideal_speedup=round(ideal, 3), efficiency=round(speedup / ideal, 3),
                     ms_per_step=round(1000 * seconds / result.speculative_stats.num_steps, 3))


def timed_generate(device: str, call) -> tuple[float, torch.LongTensor]:
    """Seconds of the second of two calls of `call` (the first warms up) and its output."""
    call()
    start = clock(device)
    output = call()
    return clock(device) - start, output
