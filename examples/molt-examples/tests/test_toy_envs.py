"""The toy environments' rewards (the learning and masking tests live in tests/)."""

from __future__ import annotations

import asyncio

import pytest

from molt_examples import Addition, GuessNumber, NextLetter, Spell


def run(coro):
    return asyncio.run(coro)


def test_next_letter_shaped_reward():
    env = NextLetter(letters="abcdefgh", window=2)
    assert run(env.reset(7)) == f"after {env.letter}"
    target = chr(ord(env.letter) + 1)
    assert run(env.step(f" {target}"))[1] == 1.0
    assert run(env.step(chr(ord(target) + 1)))[1] == 0.1 + 0.5 * (1 - 1 / 2)
    assert run(env.step(chr(ord(target) + 2)))[1] == 0.1
    assert run(env.step("7"))[1] == 0.0
    assert run(env.step(""))[1] == 0.0


def test_addition_reward():
    env = Addition(hi=4)
    assert run(env.reset(3)) == f"what is {env.a} plus {env.b}?"
    assert 0 <= env.a <= 4 and 0 <= env.b <= 4
    right = str(env.a + env.b)
    assert run(env.step(f" {right}<|im_end|>"))[1:3] == (1.0, True)
    assert run(env.step(str((env.a + env.b + 1) % 10)))[1] == 0.1
    assert run(env.step("x7"))[1] == 0.0


def test_guess_number_feedback_and_reward():
    env = GuessNumber(1, 8)
    run(env.reset(3))
    s = env.secret
    if s > 1:
        assert run(env.step("1"))[:3] == ("higher", 0.0, False)
    if s < 8:
        assert run(env.step("9"))[:3] == ("lower", 0.0, False)
    assert run(env.step(str(s)))[1:3] == (1.0, True)
    assert run(env.step("x"))[1:3] == (0.0, True)


def test_spell_reward_counts_every_answer_letter():
    env = Spell("reverse", letters="abcdefgh", length=4)
    assert run(env.reset(3)) == f"{env.source}="
    target = env.source[::-1]
    assert run(env.step(target))[1] == 1.0
    for i in range(4):      # one wrong letter (or a non-letter) at any position costs reward
        wrong = target[:i] + ("z" if target[i] != "z" else "y") + target[i + 1:]
        assert run(env.step(wrong))[1] == pytest.approx((3 + 0.1) / 4)
        assert run(env.step(target[:i] + "7" + target[i + 1:]))[1] == pytest.approx(3 / 4)
    assert run(env.step(target[:2]))[1] == 0.5                  # a short answer loses the rest
    assert run(env.step(target + "xyz"))[1] == 1.0              # past `length` is not read
    shift = Spell("shift", length=4)
    run(shift.reset(3))
    assert shift.target == "".join(chr(ord(c) + 1) for c in shift.source)
