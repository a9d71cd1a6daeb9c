"""An MCP server's tools (stdio) for chat agent `mcp` (docs/adapters/mcp.md): list_tools gives
`tools=`, call_tool a masked tool message; the loop, rows and rewards are agent `trl`'s."""

from __future__ import annotations

import asyncio
import weakref
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from molt_chat import ChatContext
from molt_core import hookimpl
from molt_gym.envs import Dataset, _functions
from molt_trl import TRLEnvironment

__all__ = ["MCPTools", "connect"]

_HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # event loop -> {command: ...}


async def _hold(server: list[str], timeout: timedelta, ready: asyncio.Future) -> None:
    """The server stays up until the event loop ends; a failed start is `ready`'s error."""
    from mcp import ClientSession, StdioServerParameters   # here: `molt plugins` stays fast
    from mcp.client.stdio import stdio_client
    try:
        async with stdio_client(StdioServerParameters(command=server[0], args=server[1:])) as io, \
                ClientSession(*io, read_timeout_seconds=timeout) as session:
            await session.initialize()
            ready.set_result((session, (await session.list_tools()).tools))
            await asyncio.Event().wait()
    except Exception as e:
        while hasattr(e, "exceptions"):            # the error, out of anyio's task groups
            e = e.exceptions[0]
        if not ready.done():
            ready.set_exception(RuntimeError(f"MCP server {server} did not start: "
                                             f"{type(e).__name__}: {e} (agent_args.server)"))


async def connect(server: list[str], timeout: timedelta) -> tuple[Any, list]:
    """The `mcp.ClientSession` and tools of stdio server `server`, started once per event loop."""
    held = _HELD.setdefault(asyncio.get_running_loop(), {})
    if tuple(server) not in held:
        ready = asyncio.get_running_loop().create_future()
        held[tuple(server)] = (asyncio.create_task(_hold(server, timeout, ready)), ready)
    return await asyncio.shield(held[tuple(server)][1])     # one cancelled rollout: not all


def _tool(session: Any, name: str, timeout: timedelta) -> Any:
    async def call(**arguments: Any) -> str:
        r = await session.call_tool(name, arguments, read_timeout_seconds=timeout)
        return "\n".join(c.text if c.type == "text" else c.model_dump_json() for c in r.content)
    return call


class MCPTools(TRLEnvironment):
    """The rows of `data` answered with the tools of the MCP server `server` (a command line)."""

    def __init__(self, *, server: list[str], data: str, reward: dict, data_args: dict | None = None,
                 max_tool_calling_iterations: int = 10, timeout_s: float = 60.0) -> None:
        self.functions = _functions(tuple(reward.items()))
        self.data = Dataset(data=data, reward=[], **data_args or {})
        self.env = SimpleNamespace(reset=lambda **row: None)      # the server keeps its own state
        self.server, self.max_calls = server, max_tool_calling_iterations
        self.timeout = timedelta(seconds=timeout_s)

    async def run(self, ctx: ChatContext) -> float:
        session, tools = await connect(self.server, self.timeout)
        self.schemas = [{"type": "function", "function": {"name": t.name, "description":
                         t.description or "", "parameters": t.inputSchema}} for t in tools]
        self.tools = {t.name: _tool(session, t.name, self.timeout) for t in tools}
        return await super().run(ctx)


@hookimpl
def molt_chat_agents() -> dict:
    return {"mcp": MCPTools}
