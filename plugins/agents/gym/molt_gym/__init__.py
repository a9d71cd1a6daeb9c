"""Gym-style agents: an async `Env` and the runner that owns the generation loop.

The runner appends the sampled tokens unchanged (trainable) and tokenizes only the text the chat
template adds after them (the environment's reply; masked), never re-tokenizing sampled text.
Observations may hold images (`multimodal.images_of`), which ride with the trajectory."""

from __future__ import annotations

import inspect
from typing import Any

from molt_core import hookimpl, multimodal
from molt_core.config import ConfigError
from molt_core.contracts import RolloutContext
from molt_core.trajectory import ImageInput, Trajectory, as_reward
from molt_gym.envs import Dataset, Env, MathProblems, Observation

__all__ = ["Dataset", "Env", "GymAgent", "MathProblems"]

class TemplateMismatch(RuntimeError):
    """The rendered history no longer starts with the tokens already captured."""


def _messages(obs: Observation) -> list[dict]:
    return [{"role": "user", "content": obs}] if isinstance(obs, str) else list(obs)


class GymAgent:
    """Runs `env` for up to `max_turns` policy turns; the rollout's reward is the sum of turns'."""

    def __init__(self, cfg: Any, tokenizer: Any, plugins: Any, *, env: str,
                 env_args: dict | None = None, max_turns: int = 1,
                 system_prompt: str | None = None, chat_template: bool = True) -> None:
        self.env_cls = plugins.get("env", env)
        self.env_args = env_args or {}
        # eval (molt_core.rollout.eval) runs only an env that serves a held-out split, and keeps
        # the args that decide it (the env's `split_by`) as training has them
        sig = inspect.signature(self.env_cls).parameters
        self.held_out = self.env_args.get("split") == "test" and "split" in sig
        self.split_args = {f"env_args.{k}": self.env_args.get(k, sig[k].default)
                           for k in getattr(self.env_cls, "split_by", ()) if k in sig}
        self.max_turns = max_turns
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.chat_template, self.tok = chat_template, tokenizer
        if chat_template:
            multimodal.require_chat_template(tokenizer, "; or agent.args.chat_template=false")
        self.model_path = cfg.model.path if cfg is not None else ""
        self.encode = multimodal.MessageEncoder(tokenizer, self.model_path)
        self._openings: dict[str, tuple[str, list[int]]] = {}   # text-only first prompts
        # a prompt longer than this many characters cannot fit (each token spells at most its
        # longest vocabulary entry's): rejected before tokenizing (20 MB: 6 min, 8.8 GB)
        from transformers import AutoConfig     # here: `molt plugins` imports no transformers
        self.max_chars = AutoConfig.from_pretrained(self.model_path).get_text_config() \
            .max_position_embeddings * max(map(len, tokenizer.get_vocab())) if cfg and tokenizer else None

    def opening(self, messages: list[dict]) -> tuple[str, list[int], list[ImageInput]]:
        """The first prompt as text and ids; a group's rollouts share it, so text-only ones are
        rendered and tokenized once (a template render + encode cost ~0.2 ms per rollout)."""
        key = None if multimodal.images_of(messages) else repr(messages)
        if key in self._openings:
            return *self._openings[key], []
        text = self.render(messages)
        if self.max_chars and len(text) > self.max_chars:
            raise ValueError(f"the prompt has {len(text)} characters: more than the model's "
                             f"positions can hold at any tokenization ({self.max_chars}); drop or "
                             "shorten such rows of the data")
        ids, images = self.encode(text, messages)
        if key is not None:
            if len(self._openings) >= 4096:
                self._openings.clear()
            self._openings[key] = (text, ids)
        return text, ids, images

    def render(self, messages: list[dict]) -> str:
        """The conversation as text, up to the policy's turn (no template: the turns joined)."""
        if not self.chat_template:
            return "".join(multimodal.content_text(m["content"]) for m in messages)
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    async def rollout(self, ctx: RolloutContext) -> Trajectory:
        env = self.env_cls(**self.env_args)
        messages = self.system + _messages(await env.reset(ctx.task))
        covered, ids, images = self.opening(messages)   # covered: the text the tokens spell
        traj = Trajectory()
        traj.add_prompt(ids, images)
        rewards: list[float] = []
        for turn in range(self.max_turns):
            completion = await ctx.generate(traj.token_ids, ctx.sampling, traj.images or None)
            traj.add_completion(completion)
            action = self.tok.decode(completion.token_ids, skip_special_tokens=True)
            obs, reward, done, info = await env.step(action)
            rewards.append(as_reward(reward))
            traj.info.update(info)
            if done or obs is None or turn == self.max_turns - 1:
                break
            sampled = self.tok.decode(completion.token_ids)
            covered += sampled
            # The history keeps the reply as sampled (special tokens included, minus the closing
            # eos the template adds itself) so that re-rendering reproduces `covered` exactly.
            reply = sampled.removesuffix(self.tok.eos_token) if self.chat_template else sampled
            new = _messages(obs)
            messages += [{"role": "assistant", "content": reply}, *new]
            rendered = self.render(messages)
            if not rendered.startswith(covered):
                raise TemplateMismatch("the chat template re-renders earlier turns differently, "
                                       "so the env reply cannot be appended token-exactly; use a "
                                       "prefix-stable template or the chat agent (segments)")
            traj.add_prompt(*self.encode(rendered[len(covered):], new))
            covered = rendered
        traj.reward, traj.turn_rewards = sum(rewards), rewards
        return traj


@hookimpl
def molt_agents() -> dict:
    return {"gym": GymAgent}


@hookimpl
def molt_configure(cfg: Any, plugins: Any) -> None:
    if cfg.agent.name == "gym" and cfg.agent.args:  # unknown env, bad env_args: before any start
        a = cfg.agent.args
        plugins.check_args("agent.args.env_args", "env", a["env"], a.get("env_args") or {})
        if plugins.get("env", a["env"]) is Dataset:     # its files and reward functions load
            try:
                Dataset(**a["env_args"])
            except (ValueError, OSError, ImportError) as e:
                raise ConfigError(f"agent.args.env_args: {type(e).__name__}: {e}") from None


@hookimpl
def molt_envs() -> dict:
    return {"math": MathProblems, "dataset": Dataset}     # the toy envs: molt_examples
