"""Our side of the vLLM check: the same token-id prompts through our `generate()`, and the comparisons with what
vLLM returned (greedy outputs, acceptance per draft position)."""

from dataclasses import dataclass

import torch

from ..decoding import generate
from ..metrics import SpeculativeStats
from ..prompts import PROMPT_SETS, encode_prompt, load_prompts, use_chat_template

# a greedy difference between engines passes only where the target's two best logits at the first differing position
# are this close (fp32 kernels of two engines round differently; a near-tie can flip)
NEAR_TIE = 1e-3


def encode_prompts(tokenizer, limit: int, prompts: str = "spec-bench") -> list[list[int]]:
    """The first `limit` prompts of `prompts` (a named set, `"spec-bench"` by default, or a prompts file that
    `load_prompts` reads) as token ids (through the chat template when the tokenizer has one)."""
    chat = use_chat_template(tokenizer, None)
    texts = [prompt.text for prompt in load_prompts(PROMPT_SETS.get(prompts, prompts), limit)]
    return [encode_prompt(tokenizer, text, chat)["input_ids"][0].tolist() for text in texts]


def our_outputs(model, prompts: list[list[int]], max_new_tokens: int, config=None,
                tokenizer=None) -> tuple[list[list[int]], SpeculativeStats]:
    """Greedy new tokens of `model` for each prompt (batch 1), with `config` (a `SpeculativeConfig`) or plain
    `generate()` when `None`, and the speculative figures summed over prompts (empty for plain decoding).
    `tokenizer`, the target's, is passed on for a draft of another tokenizer. The plain-speed floor is off: vLLM
    drafts every step, and the floor's plain steps would leave out the stretches where drafts lose."""
    outputs, total = [], SpeculativeStats()
    for ids in prompts:
        input_ids = torch.tensor([ids], device=model.device)
        if config is None:
            sequences = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                       max_new_tokens=max_new_tokens)
        else:
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), custom_generate=generate,
                                 speculative_config=config, target_tokenizer=tokenizer, do_sample=False,
                                 max_new_tokens=max_new_tokens, return_dict_in_generate=True, plain_floor=False)
            sequences = out.sequences
            total.add(out.speculative_stats)
        outputs.append(sequences[0, len(ids):].tolist())
    return outputs, total


@dataclass(frozen=True)
class Difference:
    """Where two greedy outputs of one prompt part: `prompt` (its index), `position` (the first differing new token)
    and `margin`: the target's top-1 minus top-2 logit there (in our engine), in logit units."""

    prompt: int
    position: int
    margin: float

    @property
    def near_tie(self) -> bool:
        return self.margin < NEAR_TIE


def differences(model, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]]) -> list[Difference]:
    """The prompts whose outputs differ, each with its first differing position and the target's margin there. An
    output that is a prefix of the other (one engine stopped sooner) counts as differing at its end."""
    found = []
    for index, (ids, a, b) in enumerate(zip(prompts, ours, theirs)):
        if a == b:
            continue
        position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        with torch.no_grad():
            logits = model(torch.tensor([ids + a[:position]], device=model.device)).logits[0, -1].float()
        top = logits.topk(2).values
        found.append(Difference(index, position, float(top[0] - top[1])))
    return found


def vllm_acceptance(counters: dict) -> tuple[list[float], float]:
    """vLLM's acceptance rate per draft position (`num_accepted_tokens_per_pos[i] / num_drafts`) and mean
    acceptance length (`1 + num_accepted_tokens / num_drafts`) from the counters `run_vllm` returns."""
    drafts = counters["num_drafts"]
    if not drafts:
        return [], 1.0
    per_position = [accepted / drafts for accepted in counters["num_accepted_tokens_per_pos"]]
    return per_position, 1.0 + counters["num_accepted_tokens"] / drafts


def acceptance_gap(stats: SpeculativeStats, counters: dict) -> float:
    """The largest difference, over draft positions, between our and vLLM's acceptance per position (both as
    vLLM counts them: accepted at position i over drafts)."""
    ours = stats.vllm_metrics()["acceptance_rate_per_position"]
    theirs, _ = vllm_acceptance(counters)
    return max((abs(a - b) for a, b in zip(ours, theirs)), default=0.0) if len(ours) == len(theirs) else float("inf")


def side_by_side(stats: SpeculativeStats, counters: dict) -> str:
    """Two lines: our and vLLM's mean acceptance length and acceptance per draft position."""
    ours = stats.vllm_metrics()
    theirs, length = vllm_acceptance(counters)

    def line(name, rates, mean):
        return f"{name:<5} mean acceptance length {mean:.2f}; per position {' '.join(f'{r:.2f}' for r in rates)}"

    return "\n".join([line("ours", ours["acceptance_rate_per_position"], ours["mean_acceptance_length"]),
                      line("vLLM", theirs, length)])
