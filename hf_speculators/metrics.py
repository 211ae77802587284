"""Acceptance figures and timings of one speculative generate call."""

import time
from dataclasses import asdict, dataclass, field

import torch


def clock(device: torch.device) -> float:
    """`time.perf_counter()` in seconds, after waiting for queued CUDA work when `device` is a GPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@dataclass
class SpeculativeStats:
    """What speculative decoding did in one generate call.

    Attributes:
        num_target_forwards (`int`): target forwards, the prefill included.
        num_steps (`int`): verification steps (one target forward each).
        num_drafts (`int`): steps whose draft had at least one token.
        num_drafted_tokens (`int`): draft tokens (tree nodes) proposed, over all steps (the per-step setting is
            the drafter's `num_draft_tokens`).
        num_accepted_tokens (`int`): draft tokens accepted, over all steps.
        num_generated_tokens (`int`): tokens added to the sequence (accepted, bonus and recovered tokens).
        drafted_per_position (`list[int]`): entry i counts drafts with a token at position (tree: depth) i.
        accepted_per_position (`list[int]`): entry i counts drafts that had a token accepted at position i.
        draft_lengths (`list[int]`): entry k counts steps that asked the drafter for k draft tokens (the draft
            length the schedule chose, capped by the length limit; 0: a plain step, the drafter not called).
        num_floor_steps (`int`): steps the plain-speed floor ran plain (draft length 0) because the row's drafts
            cost more than they brought (`floor.py`); they are among `draft_lengths[0]`, probes are not.
        draft_time (`float`): seconds spent drafting.
        verify_time (`float`): seconds spent in target forwards (prefill included) and verification.
        lossless (`bool`): whether the verification preserves the target's output (greedy: token for token;
            sampling: in distribution).
        verifier (`str`): the verifier's name.
        drafter (`str`): the drafter's description.
        drafter_stats (`dict`): the drafter's own figures of the call (`Drafter.finish`; e.g. `HybridDrafter`'s
            steps and accepted tokens per source); empty for most drafters.
        row_stats (`list[SpeculativeStats]`): for a batch, each row's own figures (its timings are not split
            out: they stay 0); the call's figures are then their totals, with `num_steps` counting every row's
            steps and `num_target_forwards` the batched forwards. Empty for a single sequence.
    """

    num_target_forwards: int = 0
    num_steps: int = 0
    num_drafts: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    num_generated_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    num_floor_steps: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    lossless: bool = True
    verifier: str = ""
    drafter: str = ""
    drafter_stats: dict = field(default_factory=dict)
    row_stats: list["SpeculativeStats"] = field(default_factory=list)

    def add(self, other: "SpeculativeStats") -> None:
        """Adds the step and token counts of `other` (a row of a batch) to these; forwards and timings stay."""
        for name in ("num_steps", "num_drafts", "num_drafted_tokens", "num_accepted_tokens", "num_generated_tokens",
                     "num_floor_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("drafted_per_position", "accepted_per_position", "draft_lengths"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine += [0] * (len(theirs) - len(mine))
            for i, count in enumerate(theirs):
                mine[i] += count

    def record(self, num_nodes: int, num_accepted: int, num_generated: int, depth: int | None = None,
               draft_length: int | None = None) -> None:
        """Adds one verification step that proposed `num_nodes` draft tokens and accepted `num_accepted` of them.

        `depth` is the longest path of a tree draft (default: `num_nodes`, a chain); the per-position
        figures count depths, so for a tree position i is "a node at depth i". `draft_length` is the length the
        step asked the drafter for (default: `depth`).
        """
        depth = num_nodes if depth is None else depth
        draft_length = depth if draft_length is None else draft_length
        self.draft_lengths += [0] * (draft_length + 1 - len(self.draft_lengths))
        self.draft_lengths[draft_length] += 1
        self.num_steps += 1
        self.num_target_forwards += 1
        self.num_drafts += num_nodes > 0
        self.num_drafted_tokens += num_nodes
        self.num_accepted_tokens += num_accepted
        self.num_generated_tokens += num_generated
        missing = depth - len(self.drafted_per_position)
        self.drafted_per_position += [0] * missing
        self.accepted_per_position += [0] * missing
        for i in range(depth):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over proposed draft tokens (0.0 when nothing was proposed)."""
        return self.num_accepted_tokens / self.num_drafted_tokens if self.num_drafted_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per draft, bonus token included: `1 + accepted / drafts` (vLLM's convention)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def num_steps_without_draft(self) -> int:
        """Steps that ran as plain one-token steps: the schedule asked for no draft or the drafter found none."""
        return self.num_steps - self.num_drafts

    @property
    def acceptance_rate_per_position(self) -> list[float]:
        """Entry i: how often the draft token at position i was accepted when one was proposed there."""
        return [a / d for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def vllm_metrics(self) -> dict:
        """These figures under vLLM's names and conventions (its `vllm:spec_decode_*` counters, the
        `llm.get_metrics()` prefix left out), for comparing a run here with one in vLLM: `num_drafts`,
        `num_draft_tokens`, `num_accepted_tokens`, `num_accepted_tokens_per_pos` (entry i: drafts whose token at
        position i was accepted), and the figures vLLM derives from them: `mean_acceptance_length`
        (`1 + num_accepted_tokens / num_drafts`) and `acceptance_rate_per_position` (`num_accepted_tokens_per_pos[i] /
        num_drafts`: over every draft, where `acceptance_rate_per_position` here divides by the drafts that reached
        position i; the two agree when every draft has the same length).
        """
        drafts = self.num_drafts
        return {
            "num_drafts": drafts,
            "num_draft_tokens": self.num_drafted_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_position": [a / drafts if drafts else 0.0 for a in self.accepted_per_position],
        }

    def to_dict(self) -> dict:
        """All fields and derived figures, JSON-serialisable."""
        return {
            **asdict(self),
            "row_stats": [row.to_dict() for row in self.row_stats],
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate_per_position": self.acceptance_rate_per_position,
            "num_steps_without_draft": self.num_steps_without_draft,
        }
