"""Molt's examples, a plugin beside the RL path: the toy environments the CPU recipes learn (for
the `gym` agent, `molt_gym`) and the chat calculator agents (for the `chat` agent, `molt_chat`).
Registered like any plugin, through the `molt` entry-point group; no plugin imports them."""

from __future__ import annotations

from molt_core import hookimpl
from molt_examples.calculator import AgentsCalculator, Calculator
from molt_examples.toy_envs import Addition, Arithmetic, Colours, GuessNumber, NextLetter, Spell

__all__ = ["Addition", "AgentsCalculator", "Arithmetic", "Calculator", "Colours", "GuessNumber",
           "NextLetter", "Spell"]


@hookimpl
def molt_envs() -> dict:
    return {"addition": Addition, "next_letter": NextLetter, "guess_number": GuessNumber,
            "colours": Colours, "arithmetic": Arithmetic, "spell": Spell}


@hookimpl
def molt_chat_agents() -> dict:
    return {"calculator": Calculator, "agents_calculator": AgentsCalculator}
