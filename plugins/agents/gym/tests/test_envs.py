"""The gym plugin's data env `math`: its rows and reward (the toy envs: molt_examples' tests)."""

from __future__ import annotations

import asyncio
import json

import pytest

from molt_gym import MathProblems


def run(coro):
    return asyncio.run(coro)


def test_math_problems_rows_and_reward(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}"},
        {"prompt": "What is 2 + 2?", "answer": "4"}]))
    env = MathProblems(data=str(data), instruction=" Put the answer in \\boxed{}.",
                       test_fraction=0.0)                 # both rows are training rows
    assert run(env.reset(3)) == "What is 2 + 2? Put the answer in \\boxed{}."
    assert run(env.step("so \\boxed{4}"))[1:3] == (1.0, True)
    assert run(env.step("4"))[1] == 0.0                       # no boxed answer
    run(env.reset(0))
    assert run(env.step("\\boxed{0.75}"))[1] == 1.0            # equal by value
    (tmp_path / "bad.jsonl").write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="lacks them"):
        MathProblems(data=str(tmp_path / "bad.jsonl"))
