"""The agentic learning run on a real model: SmolLM2-135M-Instruct learns to use a calculator tool
(recipes/cpu/smollm2_agent.yaml, examples/calculator_agent.py on the stock OpenAI SDK).

    python bench/smollm2_agent.py [key=value ...]          (needs make pretrained)

Prints start and end (UTC), minutes of training (evaluations excluded), held-out greedy success at
every evaluation, the held-out episodes' tool use before and after (`held_out_episodes`: the agent
on the base model and on the trained one, greedy, through the chat server: tool called, tool
called with the right expression, answer right, reply well-formed), the step-time breakdown and
the trainer's peak memory. `uptime`'s load is printed with it: the box may be shared.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
RECIPE = str(ROOT / "recipes/cpu/smollm2_agent.yaml")
PLUGIN = str(ROOT / "examples/calculator_agent.py")


def held_out_episodes(model_dir: str, cfg: Any, n: int) -> dict[str, float]:
    """The agent on `n` held-out problems, greedy, on an hf engine of `model_dir`: shares."""
    sys.path.insert(0, str(ROOT / "examples"))
    from calculator_agent import CalculatorAgent

    from molt_chat import ChatContext
    from molt_core.chat.server import ChatServer
    from molt_core.engines.hf import HFEngine
    from molt_core.multimodal import load_tokenizer
    from molt_core.rollout.eval import EVAL_TASKS, GREEDY

    tok = load_tokenizer(cfg.model.path, cfg.model.chat_template)
    engine = HFEngine(model_dir, num_threads=2)
    sampling = {**vars(cfg.sampling), **GREEDY,
                "stop_token_ids": [tok.convert_tokens_to_ids("<|im_end|>")]}
    agent = CalculatorAgent(**{**cfg.agent.args.get("agent_args", {}), "split": "test"})

    async def main() -> list[dict]:
        server = ChatServer()
        await server.start()

        async def one(task: int) -> dict:
            s = server.open_session(tok, engine.generate, sampling, max_context=2048)
            ctx = ChatContext(task, task, 0, s.base_url, s.anthropic_base_url, s.api_key)
            await agent.run(ctx)
            server.close_session(s)
            return ctx.info
        try:
            return await asyncio.gather(*(one(EVAL_TASKS + g) for g in range(n)))
        finally:
            await server.close()
    infos = asyncio.run(main())
    keys = {"tool_used": lambda i: i["tool_calls"] > 0, "tool_correct": lambda i: i["tool_correct"],
            "solved": lambda i: i["solved"], "format_ok": lambda i: i["format_ok"]}
    return {k: round(sum(float(f(i)) for i in infos) / n, 3) for k, f in keys.items()}


def main() -> None:
    from molt_core.cli import load
    from molt_core.run.metrics import configure_logging
    from molt_core.trainer import train

    overrides = sys.argv[1:]
    configure_logging()
    cfg, plugins = load(RECIPE, overrides, [PLUGIN])
    n = cfg.eval.prompts
    before = held_out_episodes(cfg.model.path, cfg, n)
    print("held-out before:", json.dumps(before), "load:", os.getloadavg(), flush=True)
    start = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="molt-agent-bench-") as run_dir:
        t0 = time.perf_counter()
        history = train(cfg, plugins, Path(run_dir), progress=False)
        wall = time.perf_counter() - t0
        end = datetime.datetime.now(datetime.timezone.utc)
        after = held_out_episodes(str(Path(run_dir) / "final"), cfg, n)
    steps = [h for h in history if "reward/mean" in h]
    evals = [h for h in history if "eval/time_s" in h]
    train_s = sum(h["time/step_s"] for h in steps)
    step = statistics.mean(h["time/step_s"] for h in steps)
    parts = {"generation": "time/generate_s", "train fwd/bwd": "train/fwd_bwd_s",
             "optimizer": "train/optim_s", "weight sync": "time/weight_sync_s"}
    print(json.dumps({
        "start": start.isoformat(timespec="seconds"), "end": end.isoformat(timespec="seconds"),
        "engine": cfg.engine.name, "steps": len(steps), "lr": cfg.trainer.lr,
        "train_minutes": round(train_s / 60, 2),
        "eval_minutes": round(sum(e["eval/time_s"] for e in evals) / 60, 2),
        "wall_minutes": round(wall / 60, 2), "mean_step_s": round(step, 2),
        "breakdown": {k: round(statistics.mean(h.get(v, 0.0) for h in steps) / step, 3)
                      for k, v in parts.items()},
        "trainer_peak_gib": round(max(h["memory/trainer_peak_gib"] for h in steps), 2),
        "held_out_greedy_success": {e["step"]: round(e["eval/greedy/pass@1"], 3) for e in evals},
        "held_out_episodes": {"before": before, "after": after},
        "reward_per_step": [round(h["reward/mean"], 3) for h in steps],
        "load_avg": os.getloadavg(),
    }, indent=1))


if __name__ == "__main__":
    main()
