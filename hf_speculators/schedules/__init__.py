"""Draft-length schedules and their registry, keyed by the names `num_draft_tokens_schedule` takes."""

from .base import ConstantSchedule, DraftLengthSchedule, HeuristicSchedule
from .goodput import GoodputSchedule

SCHEDULES: dict[str, type[DraftLengthSchedule]] = {
    ConstantSchedule.name: ConstantSchedule,
    HeuristicSchedule.name: HeuristicSchedule,
    GoodputSchedule.name: GoodputSchedule,
}


def check_schedule(name, argument: str = "num_draft_tokens_schedule") -> str:
    """Returns `name` (`None`: `"constant"`); raises `ValueError` naming `argument` and the choices for anything
    else."""
    name = "constant" if name is None else name
    if not isinstance(name, str) or name not in SCHEDULES:
        raise ValueError(f"{argument} must be one of {sorted(SCHEDULES)}, got {name!r}.")
    return name


def make_schedule(name: str | None, num_draft_tokens: int) -> DraftLengthSchedule:
    """A fresh schedule called `name` (`None`: `"constant"`) for a drafter of `num_draft_tokens` draft tokens.

    Raises:
        `ValueError`: `name` is not a key of `SCHEDULES`.
    """
    return SCHEDULES[check_schedule(name)](num_draft_tokens)


__all__ = ["SCHEDULES", "ConstantSchedule", "DraftLengthSchedule", "GoodputSchedule", "HeuristicSchedule",
           "check_schedule", "make_schedule"]
