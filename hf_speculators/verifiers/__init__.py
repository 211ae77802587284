"""Verifiers and their registry: `verifier=` takes a name from `VERIFIERS` or a `Verifier` object."""

from .base import NodewiseVerifier, Verdict, Verifier
from .exact import ExactVerifier
from .rejection import RejectionVerifier
from .top_k import TopKVerifier
from .typical import TypicalVerifier

VERIFIERS: dict[str, type[Verifier]] = {
    ExactVerifier.name: ExactVerifier,
    RejectionVerifier.name: RejectionVerifier,
    TypicalVerifier.name: TypicalVerifier,
    TopKVerifier.name: TopKVerifier,
}


def resolve_verifier(verifier: "str | Verifier | None", do_sample: bool) -> Verifier:
    """Returns the verifier for a generate call and checks that it serves the decoding mode.

    Args:
        verifier: a name from `VERIFIERS` (built with its default parameters), a `Verifier` object, or `None` for
            the default (`"exact"` for greedy decoding, `"rejection"` for sampling).
        do_sample: whether the generate call samples.

    Raises:
        `ValueError`: an unknown name, an object that is not a `Verifier`, or a verifier that cannot serve
            the decoding mode.
    """
    if verifier is None:
        verifier = "rejection" if do_sample else "exact"
    if isinstance(verifier, str):
        if verifier not in VERIFIERS:
            raise ValueError(f"Unknown verifier {verifier!r}. Choose one of {sorted(VERIFIERS)} or pass a Verifier object.")
        verifier = VERIFIERS[verifier]()
    if not isinstance(verifier, Verifier):
        raise ValueError(f"verifier= must be a name from {sorted(VERIFIERS)} or a Verifier, got {type(verifier).__name__}.")
    verifier.validate(do_sample)
    return verifier


__all__ = [
    "VERIFIERS", "ExactVerifier", "NodewiseVerifier", "RejectionVerifier", "TopKVerifier", "TypicalVerifier",
    "Verdict", "Verifier", "resolve_verifier",
]
