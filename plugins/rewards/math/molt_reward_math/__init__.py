"""Math answer reward: the response's \\boxed{} answer checked against the reference by
math-verify (symbolic equivalence: 1/2 == \\frac{1}{2} == 0.5, sets, intervals, expressions)."""

from __future__ import annotations

import logging
import threading

from molt_core import hookimpl

__all__ = ["math_reward"]

# math-verify warns "Timeout is disabled" on every call made off the main thread (said once below)
logging.getLogger("math_verify").setLevel(logging.ERROR)


def math_reward(response: str, answer: str, *, require_boxed: bool = True,
                timeout_s: int = 5) -> tuple[float, dict]:
    """1.0 if the \\boxed{} answer of `response` equals `answer` (several boxes: their set).

    `answer` may be bare LaTeX/number ("\\frac{1}{2}", "0.5") or already boxed. math-verify's
    timeouts use SIGALRM, which only the main thread may set: in other threads (the generator's
    event loop) parsing runs without a timeout."""
    from math_verify import parse, verify

    if require_boxed and "\\boxed" not in response and "\\fbox" not in response:
        return 0.0, {"reason": "no_boxed_answer"}
    timeout = timeout_s if threading.current_thread() is threading.main_thread() else None
    try:
        gold = parse(answer if "\\boxed" in answer else f"\\boxed{{{answer}}}",
                     parsing_timeout=timeout)
        pred = parse(response, parsing_timeout=timeout)
        if not gold:
            return 0.0, {"reason": "unparsable_reference", "answer": answer}
        if not pred:
            return 0.0, {"reason": "unparsable_response"}
        ok = verify(gold, pred, timeout_seconds=timeout)
    except Exception as e:  # math-verify on adversarial text: a zero reward, never a crash
        return 0.0, {"reason": "error", "error": f"{type(e).__name__}: {e}"}
    return float(ok), {"reason": "correct" if ok else "wrong", "parsed": str(pred[-1])}


@hookimpl
def molt_rewards() -> dict:
    return {"math": math_reward}
