"""Demonstrations from `molt rollout`: the policy that answers (`--policy`, `--model`,
`--teacher-url`), the filter on episodes (`--keep 'reward>=1'`), SFT rows (`--sft-out`) and the dry
run's base rates.

SFT rows, one JSON object a line: a chat agent's episodes as {"messages", "tools"}, one row per
segment, exactly the messages the chat server saw and the reply it recorded (`info
["conversations"]`); other agents' as {"prompt", "completion"}, one row per model call, the text of
the tokens before the call and of the call (special tokens and the final eos included).
"""

from __future__ import annotations

import json
import operator
import re
from pathlib import Path
from typing import Any, Callable

__all__ = ["add_args", "chat_args", "configure", "keep_filter", "sft_rows", "summary", "write_rows"]

_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
        ">": operator.gt, "<": operator.lt}


def add_args(p: Any) -> None:
    p.add_argument("--keep", metavar="EXPR", help="keep only episodes passing KEY OP NUMBER "
                   "(KEY: reward or an info key), e.g. 'reward>=1'")
    p.add_argument("--sft-out", metavar="PATH", help="write the kept episodes as SFT rows (JSONL)")
    p.add_argument("--policy", choices=("model", "scripted"), default="model",
                   help="who answers: the recipe's model (default) or the chat agent's "
                        "scripted policy (ChatAgent.policy)")
    p.add_argument("--model", metavar="PATH", help="another local model answers (model.path)")
    p.add_argument("--teacher-url", metavar="URL", help="an OpenAI-compatible server answers "
                   "(its key: $MOLT_TEACHER_API_KEY)")
    p.add_argument("--teacher-model", metavar="NAME", default="teacher",
                   help="the model name sent to --teacher-url")


def configure(args: Any) -> tuple[list[str], dict]:
    """Extra overrides and the chat agent's extra arguments the flags ask for."""
    overrides = [f"model.path={args.model}"] if args.model else []
    extra: dict[str, Any] = {}
    if args.teacher_url and args.policy != "model":
        raise ValueError("--teacher-url and --policy scripted both name who answers: give one")
    if args.teacher_url:
        extra.update(policy=args.teacher_url, teacher_model=args.teacher_model)
    elif args.policy != "model":
        extra["policy"] = args.policy
    if args.sft_out:
        extra["transcripts"] = True
    return overrides, extra


def chat_args(agent_args: dict, extra: dict) -> dict:
    """The agent's arguments with `extra`; only the chat runner (its `agent` arg) takes them."""
    if "agent" in agent_args:
        return {**agent_args, **extra}
    if set(extra) - {"transcripts"}:
        raise ValueError("--policy scripted and --teacher-url need a chat agent (agent.name: chat)")
    return agent_args


def keep_filter(expr: str | None) -> Callable[[Any], bool]:
    if not expr:
        return lambda t: True
    m = re.fullmatch(r"\s*([\w.]+)\s*(>=|<=|==|!=|>|<)\s*(-?[\d.]+(?:e-?\d+)?)\s*", expr)
    if not m:
        raise ValueError(f"--keep '{expr}': write KEY OP NUMBER, e.g. 'reward>=1' "
                         f"(OP one of {' '.join(_OPS)})")
    key, op, value = m[1], _OPS[m[2]], float(m[3])

    def keep(t: Any) -> bool:
        v = t.reward if key == "reward" else t.info.get(key)
        return isinstance(v, (int, float)) and op(float(v), value)
    return keep


def sft_rows(traj: Any, tok: Any) -> list[dict]:
    if "conversations" in traj.info:
        return [{"messages": c["messages"], "tools": c["tools"] or []}
                for c in traj.info["conversations"]]
    starts = sorted(set(traj.segments) | {0})
    rows = []
    for a, b in traj.calls:
        seg = max(s for s in starts if s <= a)
        rows.append({"prompt": tok.decode(traj.token_ids[seg:a], skip_special_tokens=False),
                     "completion": tok.decode(traj.token_ids[a:b], skip_special_tokens=False)})
    return rows


def write_rows(path: str, trajs: list, tok: Any) -> int:
    rows = [r for t in trajs for r in sft_rows(t, tok)]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return len(rows)


def summary(trajs: list) -> str:
    """Base rates of a dry run: mean reward, success (reward >= 1), episodes with a tool call."""
    n = max(1, len(trajs))
    mean = sum(t.reward for t in trajs) / n
    solved = sum(t.reward >= 1 for t in trajs) / n
    line = f"base rate: mean reward {mean:.3f}, success {solved:.3f} (reward >= 1)"
    if any("chat_tool_calls" in t.info for t in trajs):
        line += f", tool-call rate {sum(t.info.get('chat_tool_calls', 0) > 0 for t in trajs) / n:.3f}"
    return line
