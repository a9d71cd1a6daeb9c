"""Exact-match reward: 1.0 when the response equals the answer (after optional normalisation)."""

from __future__ import annotations

from molt_core import hookimpl

__all__ = ["exact_match"]


def exact_match(response: str, answer: str, *, strip: bool = True,
                case_sensitive: bool = True) -> tuple[float, dict]:
    """`strip` trims surrounding whitespace and collapses inner runs to one space."""
    a, b = response, answer
    if strip:
        a, b = " ".join(a.split()), " ".join(b.split())
    if not case_sensitive:
        a, b = a.casefold(), b.casefold()
    ok = a == b
    return float(ok), {"reason": "match" if ok else "mismatch"}


@hookimpl
def molt_rewards() -> dict:
    return {"exact": exact_match}
