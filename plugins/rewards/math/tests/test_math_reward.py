"""Math reward through math-verify: equivalent forms, wrong answers, missing boxes, threads."""

from __future__ import annotations

import threading

import pytest

from molt_core.plugins import build_plugins
from molt_reward_math import math_reward


@pytest.mark.parametrize("response, answer, expect", [
    ("so the answer is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("x = \\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    ("\\boxed{3}", "\\boxed{3}", 1.0),
    ("\\boxed{4}", "3", 0.0),
])
def test_boxed_answers(response, answer, expect):
    assert math_reward(response, answer)[0] == expect


def test_missing_box_is_zero_with_a_reason():
    assert math_reward("the answer is 3", "3") == (0.0, {"reason": "no_boxed_answer"})
    assert math_reward("the answer is 3", "3", require_boxed=False)[0] == 1.0


def test_works_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("\\boxed{2/4}", "1/2")))
    t.start()
    t.join()
    assert out[0][0] == 1.0


def test_registered_as_reward_kind():
    plugins = build_plugins()
    assert plugins.get("reward", "math") is math_reward
    assert {"math", "exact", "code"} <= set(plugins.registry["reward"])
