"""GiGPO's advantages against hand-computed values; step groups from real trajectories' tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from molt_core.advantage import Rollouts
from molt_core.trajectory import Completion, Trajectory
from molt_gigpo import gigpo, gigpo_advantages, step_keys
from molt_grpo import grpo_advantages


def test_episode_plus_weighted_step_advantage_by_hand():
    # group 0: rollout 1 stops after one turn; rollouts 0 and 2 reach the same turn-1 observation
    turn_rewards = torch.tensor([[0.0, 1.0], [0.5, 0.0], [1.0, 0.0], [2.0, 0.0]])
    rewards = turn_rewards.sum(-1)
    keys = torch.tensor([[0, 1], [0, -1], [0, 1], [2, -1]])
    groups = torch.tensor([0, 0, 0, 1])
    adv = gigpo(rewards, turn_rewards, keys, groups, omega=2.0, gamma=0.5, norm_std=False)
    # A^E: rewards [1, 0.5, 1] - 5/6. Returns (gamma 0.5): [0.5, 1], [0.5], [1, 0]; step groups:
    # turn 0 {0.5, 0.5, 1} (mean 2/3), turn 1 {1, 0} (mean 1/2); group 1: alone, 0
    expect = torch.tensor([[1 / 6 + 2 * (-1 / 6), 1 / 6 + 2 * 0.5],
                           [-1 / 3 + 2 * (-1 / 6), 0.0],
                           [1 / 6 + 2 * (1 / 3), 1 / 6 + 2 * (-0.5)],
                           [0.0, 0.0]])
    assert torch.allclose(adv, expect, atol=1e-6)


def test_std_normalised_parts_and_omega_zero_is_grpo():
    turn_rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]])
    rewards, groups = turn_rewards.sum(-1), torch.zeros(3, dtype=torch.long)
    keys = torch.tensor([[0, 1], [0, 1], [0, 2]])         # rollout 2 alone at its turn-1 state
    episode = grpo_advantages(rewards, groups)
    assert torch.allclose(gigpo(rewards, turn_rewards, keys, groups, omega=0.0),
                          episode[:, None].expand(3, 2))
    adv = gigpo(rewards, turn_rewards, keys, groups, gamma=1.0)
    ret0 = rewards                                       # turn-0 returns, one step group
    step0 = (ret0 - ret0.mean()) / (ret0.std() + 1e-6)
    step1 = torch.zeros(3)            # {0, 0} has equal returns; rollout 2 is alone
    assert torch.allclose(adv[:, 0], episode + step0, atol=1e-5)
    assert torch.allclose(adv[:, 1], episode + step1, atol=1e-5)


def _traj(group: int, replies: list[int], observations: list[list[int]]) -> Trajectory:
    t = Trajectory(group, 0)
    t.add_prompt([1, 2, 3])
    for k, tok in enumerate(replies):
        if k:
            t.add_prompt(observations[k - 1])
        t.add_completion(Completion([tok], [-1.0], [0]))
    return t


def test_step_groups_are_identical_states_within_a_group():
    trajs = [_traj(0, [7, 8], [[4, 5]]), _traj(0, [9, 8], [[4, 5]]), _traj(0, [7, 8], [[4, 6]]),
             _traj(0, [7], []), _traj(1, [7, 8], [[4, 5]]), _traj(0, [7, 8], [[4, 5]])]
    groups = torch.tensor([0, 0, 0, 0, 1, 0])
    for state_key in ("history", "last_reply"):
        keys = step_keys(Rollouts.of(trajs), groups, state_key)
        # turn 0: the group's shared prompt; a rollout past its turns: -1; another group: apart
        assert keys[[0, 1, 2, 3, 5], 0].unique().numel() == 1 and keys[4, 0] != keys[0, 0]
        assert keys[3, 1] == -1 and len({*keys[[0, 2, 4], 1].tolist()}) == 3
        assert keys[0, 1] == keys[5, 1]                  # the same history, so the same reply
    # turn 1 of rollouts 0 and 1: the same reply [4, 5] after different first calls (7 vs 9)
    assert step_keys(Rollouts.of(trajs), groups, "history")[0, 1] != \
        step_keys(Rollouts.of(trajs), groups, "history")[1, 1]
    assert step_keys(Rollouts.of(trajs), groups, "last_reply")[0, 1] == \
        step_keys(Rollouts.of(trajs), groups, "last_reply")[1, 1]


def _guesses(guesses: list[int], answer: int) -> Trajectory:
    """A guessing game: every wrong guess gets the same reply, "Incorrect, try again" (ids
    [4, 5]), a right one ends the episode with reward 1 on that call."""
    t = Trajectory(0, answer * 10 + len(guesses), turn_rewards=[float(g == answer)
                                                                   for g in guesses])
    t.reward = sum(t.turn_rewards)
    t.add_prompt([1, 2, 3])
    for k, g in enumerate(guesses):
        if k:
            t.add_prompt([4, 5])
        t.add_completion(Completion([g], [-1.0], [0]))
    return t


def _by_formula(trajs: list[Trajectory], state, omega: float, gamma: float) -> list[list[float]]:
    """docs/algorithms.md's GiGPO in plain Python: A^E over the group's rewards, A^S over the
    discounted returns of the turns whose `state(t, k)` is equal (std unbiased, + 1e-6)."""
    def rel(x: float, xs: list[float]) -> float:
        m = sum(xs) / len(xs)
        sd = (sum((y - m) ** 2 for y in xs) / (len(xs) - 1)) ** 0.5 if len(xs) > 1 else 0.0
        return (x - m) / (sd + 1e-6)
    ret = {(i, k): sum(gamma ** (j - k) * r for j, r in enumerate(t.turn_rewards) if j >= k)
           for i, t in enumerate(trajs) for k in range(len(t.turns()))}
    group = {}
    for (i, k), g in ret.items():
        group.setdefault(state(trajs[i], k), []).append(g)
    rewards = [t.reward for t in trajs]
    return [[rel(t.reward, rewards) + omega * rel(ret[i, k], group[state(t, k)])
             for k in range(len(t.turns()))] for i, t in enumerate(trajs)]


def test_history_key_keeps_a_repeated_reply_at_different_depths_apart_and_matches_the_formula():
    """The answer is 3. "Incorrect, try again" follows every wrong guess: under `last_reply`
    the third guess of [1, 2, 3] and the second of [2, 3] share one step group (so do the
    seconds of [1, 2, 3] and [2, 3]), although they follow different histories; under
    `history` (the default) only turns after the same tokens do: [1, 2, 3] and [1, 3] share
    their first two states, the turn after "1" wrong."""
    trajs = [_guesses([1, 2, 3], 3), _guesses([2, 3], 3), _guesses([1, 3], 3), _guesses([3], 3),
             _guesses([1, 2, 3], 3)]
    rollouts, groups = Rollouts.of(trajs), torch.zeros(len(trajs), dtype=torch.long)
    history = step_keys(rollouts, groups)
    last = step_keys(rollouts, groups, "last_reply")
    assert last[0, 2] == last[1, 1] and history[0, 2] != history[1, 1]
    assert last[0, 1] == last[1, 1] == last[2, 1] and history[0, 1] == history[2, 1]
    assert history[0, 1] != history[1, 1] and (history[0] == history[4]).all()
    states = {"history": lambda t, k: tuple(t.token_ids[:t.turns()[k][0]]),
              "last_reply": lambda t, k: tuple(t.token_ids[t.turns()[k - 1][1] if k else 0:
                                                           t.turns()[k][0]])}
    adv = {}
    for state_key, state in states.items():
        adv[state_key] = gigpo_advantages(torch.tensor([t.reward for t in trajs]), groups,
                                          rollouts=rollouts, omega=0.5, gamma=0.9,
                                          state_key=state_key)
        for i, row in enumerate(_by_formula(trajs, state, omega=0.5, gamma=0.9)):
            assert torch.allclose(adv[state_key][i, :len(row)], torch.tensor(row), atol=1e-5)
            assert not adv[state_key][i, len(row):].any()
    assert not torch.allclose(adv["history"], adv["last_reply"])


def test_state_key_is_checked_when_the_recipe_loads(tmp_path):
    from molt_core.cli import load
    from molt_core.config import ConfigError
    from molt_tools.tiny import CHARSET, build_tiny_model

    model = build_tiny_model(tmp_path / "chars", "qwen3", charset=CHARSET)
    over = [f"model.path={model}", "algorithm.estimator=gigpo"]
    recipe = str(Path(__file__).parents[4] / "recipes/cpu/guess_number.yaml")
    cfg, _ = load(recipe, over + [
        "algorithm.estimator_args={state_key: last_reply}"])
    assert cfg.algorithm.estimator_args == {"state_key": "last_reply"}
    with pytest.raises(ConfigError, match=r"algorithm.estimator_args.state_key: estimator 'gigpo'"
                                          r".* expects .*history.*last_reply.*, got 'hist'"):
        load(recipe, over + ["algorithm.estimator_args={state_key: hist}"])
