"""`verifiers` environments, unchanged, as chat agent `verifiers` (docs/adapters/verifiers.md):
task i is row i (mod len) of the env's dataset, rolled out by the env through its own AsyncOpenAI
client against the loopback chat server, sampling the recipe's; the reward is its rubric score."""

from __future__ import annotations

from functools import partial
from typing import Any

from molt_chat import ChatAgent, ChatContext
from molt_core import hookimpl
from molt_core.config import Config, ConfigError
from molt_core.plugins import import_module

__all__ = ["Verifiers", "environment"]

_ENVS: dict[str, Any] = {}      # per (env, env_args): the runner builds an agent per rollout


def environment(env: str, env_args: dict | None = None) -> Any:
    """`env`: a `verifiers.load_environment` id, or `module:attr` (attr: a function, or an env)."""
    key = repr((env, sorted((env_args or {}).items())))
    if key not in _ENVS:
        import verifiers as vf
        obj = getattr(import_module(env.rpartition(":")[0]), env.rpartition(":")[2]) \
            if ":" in env else partial(vf.load_environment, env)
        obj = obj if isinstance(obj, vf.Environment) else obj(**(env_args or {}))
        if not isinstance(obj, vf.Environment):
            raise TypeError(f"'{env}' gave {type(obj).__name__}, not a verifiers Environment")
        if obj.requires_group_rollouts:     # Molt scores each rollout alone
            raise ValueError(f"'{env}': its rubric has group-level reward functions; Molt "
                             "scores each rollout alone (use per-rollout reward functions)")
        _ENVS[key] = obj
    return _ENVS[key]


class Verifiers(ChatAgent):
    """`agent_args: {env: ID or module:attr, env_args: {...}}`; `timeout` (s) per model call."""

    def __init__(self, *, env: str, env_args: dict | None = None, timeout: float = 600.0) -> None:
        self.env, self.env_args, self.timeout = env, env_args or {}, timeout

    async def run(self, ctx: ChatContext) -> float:
        import openai
        import verifiers as vf
        env = environment(self.env, self.env_args)
        rows = env.build_dataset() or env.get_eval_dataset()   # an eval-only env: its eval rows
        row = rows[ctx.task % len(rows)]
        async with openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key,
                                      max_retries=0, timeout=self.timeout) as client:
            out = await env.run_rollout(row, vf.OpenAIChatCompletionsClient(client), ctx.model, {})
        if (err := out.get("error")) and err["error"] != "EmptyModelResponseError":  # scored
            raise RuntimeError(f"verifiers env '{self.env}', row {row['example_id']}: "
                               f"{out.get('error_chain') or err['message']}")
        ctx.info.update({"example_id": row["example_id"],
                         **{f"verifiers/{k}": v for k, v in (out.get("metrics") or {}).items()}})
        return float(out["reward"])


@hookimpl
def molt_chat_agents() -> dict:
    return {"verifiers": Verifiers}


@hookimpl
def molt_configure(cfg: Config, plugins: Any) -> None:
    """A bad env (unknown id, wrong env_args, group rubric) is one error before anything starts."""
    args = cfg.agent.args.get("agent_args") or {}
    if cfg.agent.name != "chat" or cfg.agent.args.get("agent") != "verifiers" or "env" not in args:
        return      # not this agent; no env: the chat plugin's check names the missing key
    try:
        environment(args["env"], args.get("env_args"))
    except Exception as e:
        raise ConfigError(f"agent.args.agent_args.env '{args['env']}': {type(e).__name__}: "
                          f"{e}") from None
