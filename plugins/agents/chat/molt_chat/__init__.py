"""Chat agents: ordinary programs that talk to the policy through the stock OpenAI/Anthropic SDKs
(docs/agents.md). The `chat` agent opens a session on the loopback chat server
(`molt_core.chat.server`), runs a `ChatAgent`, closes the session and returns its token-exact
`Trajectory`; a list of rewards is per model call (`turn_rewards`, `reward` its sum)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from molt_core import hookimpl
from molt_core.config import Config
from molt_core.contracts import RolloutContext
from molt_core.multimodal import require_chat_template
from molt_core.trajectory import Trajectory, as_reward
from molt_chat.compaction import Compactor

__all__ = ["ChatAgent", "ChatContext", "ChatRunner", "Compactor"]


@dataclass
class ChatContext:
    """What a chat agent gets for one rollout."""
    task: int                       # task index: seed for the agent's problem
    group_id: int
    rollout_id: int
    base_url: str                   # OpenAI SDK base_url (…/v1)
    anthropic_base_url: str         # Anthropic SDK base_url (the SDK appends /v1/messages)
    api_key: str                    # this session's bearer token (also accepted as x-api-key)
    model: str = "molt-policy"      # any string; the server serves the policy under every name
    info: dict[str, Any] = field(default_factory=dict)   # merged into the trajectory's info


class ChatAgent:
    """Subclass and implement `run`. Constructor keyword arguments come from `agent_args`."""

    async def run(self, ctx: ChatContext) -> float | list[float]:
        """Talk to the policy at `ctx.base_url`; return the reward (or one reward per turn)."""
        raise NotImplementedError

    async def policy(self, messages: list[dict], tools: list[dict] | None) -> dict:
        """A scripted policy, an oracle (`agent.args.policy: scripted`, `molt rollout --policy
        scripted`): the next assistant message (OpenAI form) for the conversation so far."""
        raise NotImplementedError(f"chat agent '{type(self).__name__}' has no scripted policy: "
                                  "implement ChatAgent.policy")


class ChatRunner:
    """The `chat` agent: `agent.args = {agent: NAME, agent_args: {...}, max_segments: N,
    max_request_mb: M, policy: P, transcripts: T}` (N: the segments a rollout may have, M: the
    MiB of a request body; P: who answers, `model` (the engine), `scripted` (the agent's
    `policy`) or a teacher's OpenAI base URL (`teacher_model`, key `$MOLT_TEACHER_API_KEY`);
    T: keep each segment's messages in `info["conversations"]`; docs/plugins.md)."""

    def __init__(self, cfg: Any, tokenizer: Any, plugins: Any, *, agent: str,
                 agent_args: dict | None = None, max_segments: int | None = None,
                 max_request_mb: float = 8.0, policy: str = "model",
                 teacher_model: str = "teacher", transcripts: bool = False) -> None:
        if policy not in ("model", "scripted") and not policy.startswith(("http://", "https://")):
            raise ValueError(f"agent.args.policy '{policy}': use model, scripted or a teacher's "
                             "OpenAI-compatible base URL")
        self.policy, self.teacher_model, self.transcripts = policy, teacher_model, transcripts
        self.agent_cls = plugins.get("chat_agent", agent)   # registered by `molt_chat_agents`
        self.agent_args = agent_args or {}
        sig = inspect.signature(self.agent_cls).parameters        # eval: as molt_gym's rule
        self.held_out = self.agent_args.get("split") == "test" and "split" in sig
        self.split_args = {f"agent_args.{k}": self.agent_args.get(k, sig[k].default)
                           for k in getattr(self.agent_cls, "split_by", ()) if k in sig}
        require_chat_template(tokenizer)
        self.tok, self.max_segments = tokenizer, max_segments
        self.max_body_bytes = int(max_request_mb * 2**20)
        from transformers import AutoConfig
        self.max_context = AutoConfig.from_pretrained(
            cfg.model.path).get_text_config().max_position_embeddings

    async def rollout(self, ctx: RolloutContext) -> Trajectory:
        from molt_core.chat.server import shared_server     # FastAPI: imported when used
        agent = self.agent_cls(**self.agent_args)
        server = await shared_server()
        respond = None if self.policy == "model" else \
            agent.policy if self.policy == "scripted" else self._teacher
        session = server.open_session(self.tok, ctx.generate, ctx.sampling,
                                      max_context=self.max_context,
                                      max_body_bytes=self.max_body_bytes, respond=respond)
        chat = ChatContext(ctx.task, ctx.group_id, ctx.rollout_id, session.base_url,
                           session.anthropic_base_url, session.api_key)
        try:
            result = await agent.run(chat)
        finally:
            traj = server.close_session(session)
        if not len(traj):
            raise RuntimeError(f"chat agent '{type(agent).__name__}' made no model call: "
                               "nothing to train on")
        if self.max_segments is not None and len(traj.segments) > self.max_segments:
            raise RuntimeError(f"rollout has {len(traj.segments)} segments (the chat template "
                               f"re-rendered history); agent.args.max_segments="
                               f"{self.max_segments}")
        if isinstance(result, (list, tuple)):
            traj.turn_rewards = [as_reward(r) for r in result]
            traj.reward = sum(traj.turn_rewards)
        else:
            traj.reward = as_reward(result)
        traj.info.update(chat.info)
        if self.transcripts:
            traj.info["conversations"] = session.conversations
        return traj

    async def _teacher(self, messages: list[dict], tools: list[dict] | None) -> dict:
        """The teacher's reply (nothing trains on it: the run's sampling is not imposed)."""
        import json
        import os

        import openai
        sent = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": a if
                 isinstance(a := c["function"]["arguments"], str) else json.dumps(a)}}
                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
        async with openai.AsyncOpenAI(base_url=self.policy, max_retries=2, api_key=os.environ.get(
                "MOLT_TEACHER_API_KEY", "none")) as client:
            r = await client.chat.completions.create(model=self.teacher_model, messages=sent,
                                                     **({"tools": tools} if tools else {}))
        return r.choices[0].message.model_dump(exclude_none=True)

    async def aclose(self) -> None:
        """The generator's close: the shared server of its loop stops (if one was started)."""
        from molt_core.chat.server import shutdown_shared
        await shutdown_shared()


@hookimpl
def molt_agents() -> dict:
    return {"chat": ChatRunner}


@hookimpl
def molt_configure(cfg: Config, plugins: Any) -> None:
    """The chat agent's arguments (its tokenizer's chat template: `ChatRunner`, built by
    `trainer.prepare` before anything starts)."""
    if cfg.agent.name == "chat":
        a = cfg.agent.args
        plugins.check_args("agent.args.agent_args", "chat_agent", a["agent"],
                           a.get("agent_args") or {})
