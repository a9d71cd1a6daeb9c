"""`molt sft RECIPE [k=v ...]` and `molt_core.sft`: supervised fine-tuning on the RL trainer
(`Policy.train` with a masked NLL loss: LoRA or full, bf16 over fp32 masters, micro-batches,
checkpoints, `RUN_DIR/final`, metric sinks). A row's tokens and loss mask are what the chat server
records for that conversation: each assistant reply goes through a `ChatSession` as if an engine
had sampled its canonical tokens, so a trained turn is token for token an RL rollout's."""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import structlog
import torch

from molt_core.chat import api as chat_api
from molt_core.chat.server import ChatSession
from molt_core.config import Config, ConfigError, to_dict
from molt_core.data import read_rows
from molt_core.trajectory import Completion, Trajectory, collate

__all__ = ["main", "nll", "render_row", "sft", "sft_args", "start"]


def nll(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
        mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The SFT loss per token: -log pi(token) ([B, T]; `aggregate` means it over the mask)."""
    return -logprobs, {}


def _messages(row: dict) -> tuple[list, Any]:
    """A row's messages and tools; prompt/completion rows (text or messages) as messages."""
    if "messages" in row:
        return row["messages"], row.get("tools")
    as_list = lambda x, role: [{"role": role, "content": str(x)}] if isinstance(  # noqa: E731
        x, (str, int, float)) else x            # CSV reads a completion 3 as a number
    msgs = as_list(row["prompt"], "user") + as_list(row["completion"], "assistant")
    return msgs, row.get("tools")


def render_row(row: dict, tokenizer: Any, stop_ids: list[int], max_tokens: int) -> Trajectory:
    """The trajectory the chat server records for `row`'s conversation (assistant tokens
    trainable); a bad row raises ValueError saying why."""
    msgs, tools = _messages(row)
    try:
        messages, tools = chat_api.openai_messages({"messages": msgs, "tools": tools})
    except chat_api.RequestError as e:
        raise ValueError(str(e)) from None
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not turns:
        raise ValueError("no assistant turn: nothing to train on")
    for i in turns:
        calls = len(messages[i].get("tool_calls") or [])
        results = next(j for j, m in enumerate(messages[i + 1:] + [{}]) if m.get("role") != "tool")
        if results < calls:
            raise ValueError(f"messages[{i}] makes {calls} tool calls but {results} tool results "
                             "follow it")

    async def generate(prompt_ids: list[int], sampling: dict) -> Completion:
        i = turns[len(session.trajectory.calls)]        # as sampled: up to the stop token
        try:
            ids = session.reply_ids(messages[:i], tools, messages[i], stop_ids)
        except chat_api.RequestError as e:
            raise ValueError(f"messages[{i}] (assistant): {e}") from None
        return Completion(ids, [0.0] * len(ids), [0] * len(ids))
    session = ChatSession("sft", "", "", "", tokenizer, generate, {"max_new_tokens": 1 << 30},
                          max_tokens)

    async def converse() -> None:
        for i in turns:
            await session.turn(session.prepare(messages[:i], tools), None)
    try:
        asyncio.run(converse())
    except chat_api.RequestError as e:
        raise ValueError(f"{e} (sft.max_tokens={max_tokens})") from None
    return session.trajectory


def _rows(path: str) -> list[tuple[int, dict]]:
    if not path or not Path(path).exists():
        raise ConfigError(f"sft.data '{path}' does not exist: point it at a JSONL, Parquet or "
                          "CSV file or a `datasets` directory of chat rows")
    return list(read_rows(path))


def load_data(cfg: Config, tokenizer: Any, stop_ids: list[int], max_tokens: int
              ) -> tuple[list[Trajectory], list[Trajectory], int]:
    """(training rows, held-out rows) as trajectories, one per chat segment, and the number of
    bad rows skipped (`sft.skip_bad_rows`: one warning; else the first is an error naming it)."""
    train, held, bad = [], [], []
    for line, row in _rows(cfg.sft.data):
        try:
            traj = render_row(row, tokenizer, stop_ids, max_tokens)
        except (ValueError, KeyError, TypeError) as e:
            bad.append(f"{cfg.sft.data} row {line}: {e}")
            if cfg.sft.skip_bad_rows:
                continue
            raise ConfigError(bad[0] + " (or skip such rows: sft.skip_bad_rows=true)") from None
        key = zlib.crc32(repr(sorted(row.items())).encode()) % 10_000
        (held if key < cfg.sft.eval_fraction * 10_000 else train).extend(traj.split_segments())
    if bad:
        structlog.get_logger("molt").warning(f"skipped {len(bad)} bad rows (sft.skip_bad_rows; "
                                             f"sft/skipped_rows), the first: {bad[0]}")
    if not train:
        raise ConfigError(f"{cfg.sft.data}: no training rows (sft.eval_fraction "
                          f"{cfg.sft.eval_fraction} holds them all out)")
    return train, held, len(bad)


def _batch(rows: list[Trajectory], pad: int) -> dict[str, torch.Tensor]:
    return collate(rows, [[float(m) for m in t.loss_mask] for t in rows], pad)


def eval_loss(policy: Any, rows: list[Trajectory], pad: int, size: int) -> float:
    """Mean NLL per assistant token of `rows` under the current weights."""
    total = count = 0.0
    for s in range(0, len(rows), size):
        b = _batch(rows[s:s + size], pad)
        total -= float(policy.logprobs(b)[b["loss_mask"]].sum())
        count += float(b["loss_mask"].sum())
    return total / max(count, 1.0)


class _Cursor:
    """The data order, in the checkpoint where the RL generator's state goes."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.pos, self._order = n, seed, 0, (-1, [])

    def take(self, k: int) -> list[int]:
        out = []
        for p in range(self.pos, self.pos + k):
            if self._order[0] != (epoch := p // self.n):      # one shuffle per epoch
                self._order = epoch, list(range(self.n))
                random.Random(self.seed * 1_000_003 + epoch).shuffle(self._order[1])
            out.append(self._order[1][p % self.n])
        self.pos += k
        return out

    def state_dict(self) -> dict:
        return {"buffer": [], "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def sft(cfg: Config, plugins: Any, run_dir: Path | None, progress: bool = True,
        resume: Path | None = None) -> list[dict]:
    """`sft.steps` (or epochs) optimizer steps of the masked NLL (from checkpoint `resume` on);
    rows as `molt run`'s: step k the k-th update (1..N), `eval/loss` after k updates (0..N)."""
    from transformers import AutoConfig

    from molt_core import multimodal
    from molt_core.engines import default_stop_ids
    from molt_core.policy.objective import TrainStep
    from molt_core.run import cluster
    from molt_core.run.checkpoint import Checkpointer
    from molt_core.run.metrics import MetricsSink
    from molt_core.trainer import _Log

    tok = multimodal.load_tokenizer(cfg.model.path, cfg.model.chat_template)
    model_cfg = AutoConfig.from_pretrained(cfg.model.path)
    max_tokens = cfg.sft.max_tokens or model_cfg.get_text_config().max_position_embeddings
    stop_ids = default_stop_ids(cfg.model.path, model_cfg)
    train, held, skipped = load_data(cfg, tok, stop_ids, max_tokens)
    s, pad = cfg.sft, tok.pad_token_id or 0
    steps = s.steps or math.ceil(len(train) * s.epochs / s.batch_size)
    local = cluster.embedded(cfg, True, torch.cuda.is_available())
    cfg = replace(cfg, trainer=replace(cfg.trainer, steps=steps, epochs=1, mini_batches=1),
                  engine=replace(cfg.engine, num_engines=0, cpus_per_engine=1.0),  # none
                  eval=replace(cfg.eval, every=(s.eval_every or steps) if held else 0),
                  ray=replace(cfg.ray, embedded="on" if local else cfg.ray.embedded))
    torch.manual_seed(cfg.seed)
    spec = TrainStep(nll, loss_agg="token-mean")
    with cluster.start(cfg, plugins) as (policy, _):
        cursor = _Cursor(len(train), cfg.seed)
        ckpt = Checkpointer(cfg, run_dir, policy, [], cursor, None, plugins)
        sink = MetricsSink(run_dir, steps, progress,
                           [plugins.get("metric_sink", k)(run_dir, cfg) for k in cfg.log.sinks])
        log = _Log(cfg, plugins, sink, lambda **_: {
            "eval/loss": eval_loss(policy, held, pad, cfg.trainer.micro_batch_size)})
        try:
            for step in range(ckpt.restore(resume)[0], steps):
                log.held_out(step)
                t0 = time.perf_counter()
                rows = [train[i] for i in cursor.take(s.batch_size)]
                m = policy.train(_batch(rows, pad), spec)
                m = {k: v for k, v in m.items() if not k.startswith("mismatch/")}
                log(step + 1, m | {"train/tokens": sum(t.num_trainable for t in rows),
                                   "sft/skipped_rows": skipped, "policy/version": step + 1,
                                   "time/step_s": time.perf_counter() - t0})
                if ckpt.step_end(step, step + 1):
                    return log.history
            log.held_out(steps)
        finally:
            ckpt.close()
            sink.close()
    return log.history


def sft_args(p: Any) -> None:
    from molt_core.cli import run_args
    run_args(p)         # RECIPE (its sft: section), --resume RUN_DIR, --checkpoint, --no-progress


def start(recipe: str | None, overrides: list[str], plugin_names: list[str] = (),
          blocked: list[str] = (), *, progress: bool = True, resume: str | None = None,
          checkpoint: str | None = None, argv: list[str] = ()) -> tuple[Path, list[dict]]:
    from molt_core.cli import load
    from molt_core.run.checkpoint import prepare_resume, resume_recipe
    from molt_core.run.metrics import make_run_dir
    if resume:
        recipe, overrides = resume_recipe(resume, recipe, overrides)
    cfg, plugins = load(recipe, overrides, plugin_names, blocked, agent=False)
    run_dir, ckpt = prepare_resume(resume, checkpoint, cfg, list(argv)) if resume else (
        make_run_dir(cfg.out_dir, cfg.name, to_dict(cfg), plugins.info, cfg.seed, list(argv)), None)
    print(f"run dir: {run_dir}", file=sys.stderr)
    return run_dir, sft(cfg, plugins, run_dir, progress, ckpt)


def main(args: Any) -> int:
    run_dir, history = start(args.recipe, args.overrides, args.plugin, args.blocked,
                             progress=not args.no_progress, resume=args.resume,
                             checkpoint=args.checkpoint, argv=["molt", *args.argv])
    evals = [h["eval/loss"] for h in history if "eval/loss" in h]
    if evals:
        print(f"eval/loss: {evals[0]:.4f} -> {evals[-1]:.4f}")
    print(f"model: {run_dir / 'final'} (model.path for molt run)")
    return 0
