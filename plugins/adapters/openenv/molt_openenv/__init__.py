"""Env `openenv`: an OpenEnv server's environment over openenv-core's client (docs/adapters)."""

import asyncio
import contextlib
from typing import Any

from molt_core import hookimpl
from molt_core.config import ConfigError
from molt_gym import Env, Observation

__all__ = ["OpenEnv"]


class OpenEnv(Env):
    """The server at `url`; `reset_args` go to its reset with the seed, other fields to info."""

    def __init__(self, *, url: str, action: str = "message", observation: str = "message",
                 reset_args: dict | None = None, timeout_s: float = 30.0) -> None:
        from openenv.core import GenericEnvClient   # imports gradio (seconds): not at plugin load
        self.url, self.action, self.field, self.reset_args = url, action, observation, reset_args
        self.client = GenericEnvClient(url, connect_timeout_s=timeout_s,
                                       message_timeout_s=timeout_s)

    async def reset(self, seed: int) -> Observation:
        return (await self._call(self.client.reset(seed=seed, **self.reset_args or {})))[0]

    async def step(self, action: str) -> tuple[Observation, float, bool, dict]:
        return await self._call(self.client.step({self.action: action}))

    async def _call(self, request: Any) -> tuple[Observation, float, bool, dict]:
        try:
            result = await request
            obs = (info := dict(result.observation)).pop(self.field)
        except Exception as e:  # refused, timed out, the server's error reply, another shape
            raise RuntimeError(f"OpenEnv server {self.url}: {type(e).__name__}: {e}") from None
        return obs, float(result.reward or 0.0), bool(result.done), info

    def __del__(self) -> None:    # the rollout is over (done, or cut at max_turns): end the session
        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(self.client.close())


@hookimpl
def molt_configure(cfg: Any, plugins: Any) -> None:
    agent = cfg.agent.args if cfg.agent.name == "gym" else {}
    if agent.get("env") != "openenv" or "url" not in (args := agent.get("env_args") or {}):
        return
    import requests
    try:
        r = requests.get(args["url"].rstrip("/") + "/schema", timeout=args.get("timeout_s", 30.0))
        schema = {k: r.json()[k]["properties"] for k in ("action", "observation")}
    except (requests.RequestException, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"agent.args.env_args.url: no OpenEnv server answers at {args['url']} "
                          f"({type(e).__name__}: {e}); start it or fix the url") from None
    for key, fields in schema.items():
        if (want := args.get(key, "message")) not in fields:
            raise ConfigError(f"agent.args.env_args.{key}: the server's {key}s have fields "
                              f"{', '.join(fields)}, not {want!r}")


@hookimpl
def molt_envs() -> dict:
    return {"openenv": OpenEnv}
