"""`molt new-plugin NAME --kind estimator|agent|rollout`: a plugin package that installs and runs.

The generated package is what docs/plugins.md describes: a pyproject declaring one entry point in
the `molt` group, a module whose hook implementations are documented, and a test that passes
as generated. `pip install -e DIR/NAME` then `molt run recipe.yaml --plugin NAME` uses it.
"""

from __future__ import annotations

import keyword
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

__all__ = ["KINDS", "new_plugin"]

# kind -> the distribution-name infix (`molt-<infix>-<name>`)
KINDS = {"estimator": "estimator", "agent": "agent", "rollout": "rollout"}

_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
description = "Molt plugin: {name} ({kind})"
requires-python = ">=3.10"
dependencies = ["molt-core>=0.1,<0.2"]

[project.optional-dependencies]
test = ["pytest"]

# The plugin's name is the entry point's name: `molt run recipe.yaml --plugin {name}`.
[project.entry-points.molt]
{name} = "{module}"

[tool.setuptools]
packages = ["{module}"]
"""

_ESTIMATOR = '''\
"""{name}: an advantage estimator and policy loss for Molt (made by `molt new-plugin`).

`molt run recipe.yaml --plugin {name}` selects both (`algorithm.estimator` and `algorithm.loss`
become `{name}`); their keyword-only parameters are hyper-parameters, set in the recipe under
`algorithm.estimator_args` / `algorithm.loss_args`. Both are pure tensor functions.
"""

from __future__ import annotations

import torch

from molt_core import hookimpl
from molt_core.algos import clipped_surrogate, group_stats

__all__ = ["{name}_advantages", "{name}_loss"]


def {name}_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *,
                {pad}scale: float = 1.0) -> torch.Tensor:
    """A_i = scale * (r_i - mean of r over i's prompt group). [R] -> [R]

    rewards: one float per rollout; group_index: the id of each rollout's prompt group (long).
    The trainer broadcasts A_i to every trainable token of rollout i.
    """
    mean, _, _ = group_stats(rewards, group_index)
    return scale * (rewards - mean)


def {name}_loss(logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
          {pad2}advantages: torch.Tensor, mask: torch.Tensor, *, clip: float = 0.2
          {pad2}) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip per token: max(-A r, -A clip(r, 1 - clip, 1 + clip)), r = exp(lp - lp_behavior).

    All tensors are [B, T]; `mask` is True at trainable tokens. Return the per-token loss (the
    trainer aggregates it with `algorithm.loss_agg`) and metrics ([B, T] or scalars).
    """
    ratio = torch.exp(logprobs - behavior_logprobs)
    loss, clipped = clipped_surrogate(ratio, advantages, clip, clip)
    return loss * mask, {{"clip_fraction": clipped.float()}}


@hookimpl
def molt_estimators() -> dict:
    """Register the estimator under the plugin's name."""
    return {{"{name}": {name}_advantages}}


@hookimpl
def molt_losses() -> dict:
    """Register the loss under the plugin's name."""
    return {{"{name}": {name}_loss}}
'''

_ESTIMATOR_TEST = '''\
"""{name}: the estimator and loss against their formulas, on hand-made tensors."""

from __future__ import annotations

import math

import torch

from molt_tools.testing import fake_groups, run_step

import {module}


def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 2.0])
    groups = torch.tensor([0, 0, 1])                 # the last group has one member -> 0
    adv = {module}.{name}_advantages(rewards, groups, scale=2.0)
    assert torch.allclose(adv, torch.tensor([1.0, -1.0, 0.0]))


def test_loss_by_hand_with_a_masked_position():
    lp = torch.tensor([[math.log(1.5), math.log(1.1), 7.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss, metrics = {module}.{name}_loss(lp, torch.zeros(1, 3), torch.ones(1, 3), mask)
    assert torch.allclose(loss, torch.tensor([[-1.2, -1.1, 0.0]]))      # 1.5 is clipped to 1.2
    loss.sum().backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.0, -1.1, 0.0]]))    # no grad when clipped
    assert metrics["clip_fraction"][0, :2].tolist() == [1.0, 0.0]


def test_estimator_and_loss_through_the_trainers_path():
    """molt_tools.testing: the trainer's own batching, broadcast and loss aggregation."""
    out = run_step({module}.{name}_advantages, {module}.{name}_loss, fake_groups([[1.0, 0.0]]),
                   estimator_args={{"scale": 1.0}}, loss_args={{"clip": 0.2}})
    assert out.advantages.tolist() == [0.5, -0.5]
    mask = out.batch["loss_mask"]
    assert (out.grad[0][mask[0]] < 0).all() and (out.grad[1][mask[1]] > 0).all()
    assert (out.grad[~mask] == 0).all()               # prompt tokens get no gradient


def test_hooks_register_under_the_plugin_name():
    assert {module}.molt_estimators() == {{"{name}": {module}.{name}_advantages}}
    assert {module}.molt_losses() == {{"{name}": {module}.{name}_loss}}
'''

_AGENT = '''\
"""{name}: a Molt agent (made by `molt new-plugin`).

`molt run recipe.yaml --plugin {name}` makes `agent.name` `{name}`; `agent.args` in the recipe
are the agent's keyword arguments. The agent owns one rollout: it builds the prompt, asks the
engine for tokens through `ctx.generate` (token space: no re-tokenizing of sampled text), and
scores the result. Exceptions drop the rollout (counted as `rollout/dropped/agent_error`).
"""

from __future__ import annotations

import random
from typing import Any

from molt_core import hookimpl
from molt_core.contracts import RolloutContext
from molt_core.trajectory import Trajectory

__all__ = ["{cls}"]


class {cls}:
    """Task: "repeat: <word>"; reward 1.0 when the reply starts with the word."""

    def __init__(self, cfg: Any, tokenizer: Any, plugins: Any, *,
                 words: tuple[str, ...] = ("cat", "dog", "sun")) -> None:
        self.tok, self.words = tokenizer, list(words)

    async def rollout(self, ctx: RolloutContext) -> Trajectory:
        word = random.Random(ctx.task).choice(self.words)   # ctx.task seeds the prompt
        traj = Trajectory()
        traj.add_prompt(self.tok(f"repeat: {{word}}\\n", add_special_tokens=False).input_ids)
        completion = await ctx.generate(traj.token_ids, ctx.sampling)
        traj.add_completion(completion)                     # trainable, exactly as sampled
        reply = self.tok.decode(completion.token_ids, skip_special_tokens=True)
        traj.reward = float(reply.strip().startswith(word))
        traj.info["word"] = word
        return traj


@hookimpl
def molt_agents() -> dict:
    """Register under the plugin's name; `factory(cfg, tokenizer, plugins, **agent.args)`."""
    return {{"{name}": {cls}}}
'''

_AGENT_TEST = '''\
"""{name}: one rollout against a fake engine and a fake tokenizer (both stand-ins, named so)."""

from __future__ import annotations

import asyncio

from molt_core.contracts import RolloutContext
from molt_core.trajectory import Completion

import {module}


class FakeCharTokenizer:
    """Stand-in tokenizer: one id per character."""

    class _Encoded:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, text, add_special_tokens=False):
        return self._Encoded([ord(c) for c in text])

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


def _rollout(reply: str):
    async def fake_generate(prompt_ids, sampling=None):
        ids = [ord(c) for c in reply]
        return Completion(ids, [-0.1] * len(ids), [0] * len(ids))

    agent = {module}.{cls}(None, FakeCharTokenizer(), None, words=("cat",))
    ctx = RolloutContext(0, 0, 7, {{}}, fake_generate, None)
    return asyncio.run(agent.rollout(ctx))


def test_rollout_records_sampled_tokens_and_reward():
    traj = _rollout("cat!")
    traj.check()
    assert traj.reward == 1.0 and traj.num_trainable == 4
    assert traj.token_ids[-4:] == [ord(c) for c in "cat!"]
    assert _rollout("dog").reward == 0.0


def test_hook_registers_under_the_plugin_name():
    assert {module}.molt_agents() == {{"{name}": {module}.{cls}}}
'''

_ROLLOUT = '''\
"""{name}: a Molt rollout scheme (made by `molt new-plugin`).

A scheme decides how generation and training interleave. `molt run recipe.yaml --plugin {name}`
makes `rollout.scheme` `{name}`. This one is strictly on-policy (generate, train, push weights);
change `next_batch` / `sync_weights` to overlap them.
"""

from __future__ import annotations

from typing import Any

from molt_core import hookimpl
from molt_core.trajectory import Trajectory

__all__ = ["{cls}"]


class {cls}:
    def __init__(self, cfg: Any, generator: Any, weights: Any, engines: list[Any]) -> None:
        self.cfg, self.generator, self.weights, self.engines = cfg, generator, weights, engines
        self.version = 0

    def next_batch(self, step: int) -> list[list[Trajectory]]:
        """The complete prompt groups to train on at `step` (blocking)."""
        return self.generator.generate(self.cfg.rollout.groups_per_step)

    def sync_weights(self, step: int) -> int:
        """Called after each optimizer step; push weights when the scheme decides. Returns the
        weight version the engines now serve."""
        self.version += 1
        self.weights.push(self.version)
        return self.version


@hookimpl
def molt_rollout_schemes() -> dict:
    """Register under the plugin's name; `factory(cfg, generator, weights, engines)`."""
    return {{"{name}": {cls}}}
'''

_ROLLOUT_TEST = '''\
"""{name}: the scheme's call order against a fake generator and weight pusher (stand-ins, named
so)."""

from __future__ import annotations

from types import SimpleNamespace

import {module}


class FakeGenerator:
    def __init__(self):
        self.calls = []

    def generate(self, n):
        self.calls.append(n)
        return [["trajectory"]] * n


class FakeWeights:
    def __init__(self):
        self.pushed = []

    def push(self, version):
        self.pushed.append(version)


def test_generate_then_push_each_step():
    cfg = SimpleNamespace(rollout=SimpleNamespace(groups_per_step=3))
    gen, pol = FakeGenerator(), FakeWeights()
    scheme = {module}.{cls}(cfg, gen, pol, engines=[])
    for step in range(2):
        assert len(scheme.next_batch(step)) == 3
        assert scheme.sync_weights(step) == step + 1
    assert gen.calls == [3, 3] and pol.pushed == [1, 2]


def test_hook_registers_under_the_plugin_name():
    assert {module}.molt_rollout_schemes() == {{"{name}": {module}.{cls}}}
'''

_TEMPLATES = {"estimator": (_ESTIMATOR, _ESTIMATOR_TEST), "agent": (_AGENT, _AGENT_TEST),
              "rollout": (_ROLLOUT, _ROLLOUT_TEST)}


def new_plugin(name: str, kind: str, directory: str | Path = ".") -> Path:
    """Write the package `directory/name/` and return its path."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name) or keyword.iskeyword(name):
        raise ValueError(f"plugin name {name!r} must be a lowercase Python identifier "
                         "(letters, digits, underscores), e.g. my_estimator")
    if kind not in _TEMPLATES:
        raise ValueError(f"unknown plugin kind {kind!r}; valid: {', '.join(_TEMPLATES)}")
    root = Path(directory) / name
    if root.exists():
        raise FileExistsError(f"{root} already exists; pick another name or --dir")
    module = f"molt_{name}"
    suffix = {"agent": "Agent", "rollout": "Scheme"}.get(kind, "")
    cls = "".join(p.capitalize() for p in name.split("_"))
    cls += "" if cls.endswith(suffix) else suffix
    fields = {"name": name, "kind": kind, "module": module, "cls": cls,
              "dist": f"molt-{KINDS[kind]}-{name.replace('_', '-')}",
              "pad": " " * len(name), "pad2": " " * len(name)}
    code, test = _TEMPLATES[kind]
    (root / module).mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pyproject.toml").write_text(_PYPROJECT.format(**fields))
    (root / module / "__init__.py").write_text(code.format(**fields))
    (root / module / "py.typed").write_text("")
    (root / "tests" / f"test_{name}.py").write_text(test.format(**fields))
    (root / "README.md").write_text(textwrap.dedent(f"""\
        # {fields['dist']}

        A Molt {kind} plugin. Install it into the environment that has molt-core (Molt's own
        venv), or into a new venv with molt-core from Molt's `make dist` wheelhouse
        (`pip install --find-links MOLT/dist/wheelhouse -e .`), then:

            pip install -e .
            pytest tests
            molt plugins                      # lists `{name}` (or: python -m molt_core plugins)
            molt run recipe.yaml --plugin {name}

        Hooks are documented in Molt's docs/plugins.md ("Developing a plugin").
        """))
    return root


def add_args(p: Any) -> None:
    """`molt new-plugin` options."""
    p.add_argument("name", help="plugin (entry-point) name, a lowercase identifier")
    p.add_argument("--kind", required=True, choices=list(_TEMPLATES))
    p.add_argument("--dir", default=".", help="parent directory of the package (default: .)")


def main(args: Any) -> int:
    try:
        root = new_plugin(args.name, args.kind, args.dir)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"created {root}\nnext, in the Python environment that has molt-core: pip install -e "
          f"{root} && pytest {root}/tests && molt run RECIPE --plugin {args.name}\n(a venv "
          "without it: pip install --find-links MOLT/dist/wheelhouse -e ...; docs/plugins.md)")
    return 0
