"""Environments written for `verifiers` (single-turn, multi-turn, tool envs), run unchanged as the
chat agent `verifiers` (docs/adapters/verifiers.md): task i is row i (mod len) of the env's
dataset, the env rolls it out against the loopback chat server through its own AsyncOpenAI
client, and its rubric's score is the reward. Sampling stays the recipe's."""

from __future__ import annotations

from typing import Any

import openai

from molt_chat import ChatAgent, ChatContext
from molt_core import hookimpl
from molt_core.config import Config, ConfigError
from molt_core.plugins import import_module

__all__ = ["Verifiers", "environment"]

_ENVS: dict[str, Any] = {}      # one env per (env, env_args): the runner builds an agent per rollout


def environment(env: str, env_args: dict | None = None) -> Any:
    """`env` an id for `verifiers.load_environment` (an installed env module), or `module:attr`
    (a file works: `./my_env.py:load_environment`), attr a `load_environment`-style function or
    an env object."""
    key = repr((env, sorted((env_args or {}).items())))
    if key not in _ENVS:
        import verifiers as vf
        if ":" in env:
            obj = getattr(import_module(env.rpartition(":")[0]), env.rpartition(":")[2])
            obj = obj if isinstance(obj, vf.Environment) else obj(**(env_args or {}))
        else:
            obj = vf.load_environment(env, **(env_args or {}))
        if not isinstance(obj, vf.Environment):
            raise TypeError(f"'{env}' gave {type(obj).__name__}, not a verifiers Environment")
        if obj.requires_group_rollouts:     # Molt scores each rollout alone
            raise ValueError(f"'{env}': its rubric has group-level reward functions; Molt "
                             "scores each rollout alone (use per-rollout reward functions)")
        _ENVS[key] = obj
    return _ENVS[key]


class Verifiers(ChatAgent):
    """`agent_args: {env: ID or module:attr, env_args: {...}}`; `timeout` (s) per model call."""

    def __init__(self, *, env: str, env_args: dict | None = None,
                 timeout: float = 600.0) -> None:
        self.env, self.env_args, self.timeout = env, env_args or {}, timeout

    async def run(self, ctx: ChatContext) -> float:
        import verifiers as vf
        env = environment(self.env, self.env_args)
        rows = env.build_dataset() or env.get_eval_dataset()   # an eval-only env: its eval rows
        row = rows[ctx.task % len(rows)]
        client = vf.OpenAIChatCompletionsClient(openai.AsyncOpenAI(
            base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=self.timeout))
        try:        # sampling args {}: the recipe's (others would be a 400)
            out = await env.run_rollout(row, client, ctx.model, {})
        finally:
            await client.close()
        if out.get("error"):
            raise RuntimeError(f"verifiers env '{self.env}', row {row['example_id']}: "
                               f"{out['error']}")
        ctx.info.update({"example_id": row["example_id"],
                         **{f"verifiers/{k}": v for k, v in (out.get("metrics") or {}).items()}})
        return float(out["reward"])


@hookimpl
def molt_chat_agents() -> dict:
    return {"verifiers": Verifiers}


@hookimpl
def molt_configure(cfg: Config, plugins: Any) -> None:
    """A bad env (unknown id, wrong env_args, group rubric) is one error before anything starts."""
    a = cfg.agent.args
    if cfg.agent.name != "chat" or a.get("agent") != "verifiers":
        return
    args = a.get("agent_args") or {}
    try:
        environment(args.get("env", ""), args.get("env_args"))
    except Exception as e:
        raise ConfigError(f"agent.args.agent_args.env '{args.get('env')}': "
                          f"{type(e).__name__}: {e}") from None
