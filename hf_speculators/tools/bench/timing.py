"""The benchmark's timing: one generate call timed, with the seconds spent inside the model forwards (module hooks)
and the whole-target forwards counted, and the torch threads it runs with."""

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ...metrics import SpeculativeStats, clock
from .batches import Batch, row_new_ids, row_stats
from .settings import BenchSettings


@contextmanager
def torch_threads(num_threads: int | None):
    """Runs the block with `num_threads` torch CPU threads (`None`: as they are), restoring the number after."""
    saved = torch.get_num_threads()
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        yield
    finally:
        torch.set_num_threads(saved)


@dataclass
class TimedRun:
    """One row of a timed generate call.

    Attributes:
        new_ids (`torch.LongTensor` of shape `(new_tokens,)`): the row's new tokens, up to its first EOS.
        seconds (`float`): the call's wall-clock seconds, divided by its number of rows.
        num_target_forwards (`int`): the call's whole-target forwards.
        forward_seconds (`float`): the call's seconds inside timed model forwards, divided by its number of rows.
        stats (`SpeculativeStats`, *optional*): the row's figures; `None` for methods that report none.
    """

    new_ids: torch.LongTensor
    seconds: float
    num_target_forwards: int
    forward_seconds: float
    stats: SpeculativeStats | None


def timed_modules(target, generate_kwargs: dict) -> list:
    """The modules whose forwards count as model time for a method: the target, and transformers' assistant model
    or the modules our drafter declares (`Drafter.draft_modules`: its draft model or head, and the target's parts
    it calls outside the target's forward, e.g. layer skip's decoder layers); a model-free method hooks nothing
    more, so its timing pays for no extra hooks. `generate_kwargs` are the method's (`engines.generate_kwargs`).

    Returns:
        `list[torch.nn.Module]`: the target first.
    """
    drafter = generate_kwargs.get("candidate_generator")
    own = () if drafter is None else drafter.draft_modules(target)
    assistant = generate_kwargs.get("assistant_model")
    return [target, *own, *(() if assistant is None else (assistant,))]


@contextmanager
def _forward_timer(target, modules: list):
    """Counts target forwards and adds up the seconds spent inside the forwards of `modules` (module hooks).

    A module that runs inside another timed module's forward is counted with it. Yields a dict with
    `num_target_forwards` (whole-target forwards) and `forward_seconds`; on CUDA the hooks time kernel launches
    and waits, not the GPU work, so `forward_seconds` is exact on CPU only.
    """
    totals = {"num_target_forwards": 0, "forward_seconds": 0.0}
    starts = []

    def before(module, args):
        starts.append(time.perf_counter())
        totals["num_target_forwards"] += module is target

    def after(module, args, output):
        start = starts.pop()
        if not starts:  # the outermost timed module
            totals["forward_seconds"] += time.perf_counter() - start

    hooks = [h for m in modules for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))]
    try:
        yield totals
    finally:
        for hook in hooks:
            hook.remove()


def timed_generate(target, batch: Batch, generate_kwargs: dict, settings: BenchSettings) -> list[TimedRun]:
    """One generate call on a batch of prompts (greedy or sampled as `settings` say, from `settings.seed`), timed,
    with its model forwards measured; `generate_kwargs` select the method (`engines.generate_kwargs`).

    With `settings.compile` no module is hooked (`num_target_forwards` and `forward_seconds` are `None`): a hook
    inside a compiled forward breaks its graph (dynamo cannot trace the clock) and hooks added after compilation
    are not guarded, so compiled runs are timed as whole calls only.

    Returns:
        `list[TimedRun]`: one per row, each with the row's own new tokens and an even share of the call's seconds
        (`hf_speculators.tools.bench.batches`).
    """
    rows = len(batch.indices)
    padding = {} if batch.attention_mask is None else {"attention_mask": batch.attention_mask,
                                                       "pad_token_id": batch.pad_token_id}
    torch.manual_seed(settings.seed)
    with _forward_timer(target, [] if settings.compile else timed_modules(target, generate_kwargs)) as forwards:
        start = clock(target.device)
        output = target.generate(batch.input_ids, max_new_tokens=settings.max_new_tokens, **settings.sampling(),
                                 return_dict_in_generate=True, **padding, **generate_kwargs)
        seconds = clock(target.device) - start
    stats = getattr(output, "speculative_stats", None)
    new_ids = row_new_ids(output.sequences, batch.input_ids.shape[1], target.generation_config.eos_token_id)
    num_forwards, forward_seconds = forwards["num_target_forwards"], forwards["forward_seconds"] / rows
    if settings.compile:
        num_forwards = forward_seconds = None
    return [TimedRun(ids, seconds / rows, num_forwards, forward_seconds, row_stats(stats, row, rows))
            for row, ids in enumerate(new_ids)]


def timed_generate_one(target, input_ids: torch.LongTensor, generate_kwargs: dict,
                       settings: BenchSettings) -> TimedRun:
    """`timed_generate` on one prompt `(1, prompt_tokens)`, unpadded."""
    batch = Batch([0], input_ids, None, [input_ids.shape[1]], [False])
    return timed_generate(target, batch, generate_kwargs, settings)[0]
