"""The agentic learning run on a real model: SmolLM2-135M-Instruct learns to use a calculator tool
(recipes/cpu/smollm2_agent.yaml, examples/calculator_agent.py on the stock OpenAI SDK).

    python bench/smollm2_agent.py imprint                  (writes .cache/smollm2-135m-agent)
    python bench/smollm2_agent.py [--base] [key=value ...] (needs make pretrained)

The base model never calls the tool, so the recipe starts from a cold-start imprint of it
(`imprint`, run first when the directory is missing): a short SFT on calculator transcripts for
additions and subtractions (not the task's multiplications), one question in four answered by a
call, the rest in its head, so that the call's format is known and its use is rare (~1/5 of
sampled multiplications, none greedy); RL has to make it the rule. `--base` also measures the
held-out episodes on the model before the imprint.

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
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
RECIPE = str(ROOT / "recipes/cpu/smollm2_agent.yaml")
PLUGIN = str(ROOT / "examples/calculator_agent.py")
BASE = ROOT / ".cache/smollm2-135m-instruct"
AGENT_MODEL = ROOT / ".cache/smollm2-135m-agent"


def imprint_pairs(tok: Any, questions: int = 32, call_every: int = 4,
                  seed: int = 0) -> list[tuple[str, str]]:
    """(prompt, reply) text pairs for `a + b` / `a - b` questions (a 3-digit, b 2-digit): every
    `call_every`-th one is a calculator call, then the answer after the tool's result; the
    others are answered in the head (correctly: it is the format, not wrong sums, being taught)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from calculator_agent import TOOLS

    def render(msgs: list[dict]) -> str:
        return tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False,
                                       add_generation_prompt=True)
    rng, pairs = random.Random(seed), []
    for q in range(questions):
        a, b, op = rng.randint(100, 999), rng.randint(10, 99), rng.choice("+-")
        expr, value = f"{a} {op} {b}", a + b if op == "+" else a - b
        msgs = [{"role": "user", "content": f"What is {expr}?"}]
        if q % call_every == 0:
            args = json.dumps({"expression": expr})
            pairs.append((render(msgs), f'<tool_call>{{"name": "calculator", "arguments": '
                                        f'{args}}}</tool_call><|im_end|>'))
            msgs += [{"role": "assistant", "content": "", "tool_calls": [{
                         "id": "c", "type": "function",
                         "function": {"name": "calculator", "arguments": args}}]},
                     {"role": "tool", "tool_call_id": "c", "content": str(value)}]
        pairs.append((render(msgs), f"{expr} = {value}<|im_end|>"))
    return pairs


def build_agent_model(out_dir: Path = AGENT_MODEL, base: Path = BASE) -> Path:
    """The recipe's starting policy: `base` after 20 SFT steps on `imprint_pairs` (full
    fine-tuning, batch 8, lr 3e-5 decayed to 0; ~16 CPU-minutes)."""
    from molt_core.multimodal import load_tokenizer
    from molt_tools.imprint import imprint

    if not (base / "config.json").exists():
        raise FileNotFoundError(f"{base} is missing: run `make pretrained` first")
    tok = load_tokenizer(str(base), str(ROOT / "recipes/templates/smollm2_tools.jinja"))
    t0 = time.perf_counter()
    imprint(base, out_dir, imprint_pairs(tok), steps=20, lr=3e-5, tol=None, batch_size=8,
            clip=1.0, decay=True, threads=2)
    print(f"imprinted {out_dir} in {time.perf_counter() - t0:.0f} s, load {os.getloadavg()}")
    return out_dir


def sampled_tool_use(run_dir: Path) -> list[float]:
    """Per training step, the share of sampled episodes that called the tool (trajectories)."""
    import pyarrow.parquet as pq

    rows = [r for f in sorted((run_dir / "trajectories").glob("*.parquet"))
            for r in pq.read_table(f, columns=["step", "info"]).to_pylist()]
    by_step: dict[int, list[float]] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(float(json.loads(r["info"])["tool_calls"] > 0))
    return [round(statistics.mean(v), 3) for _, v in sorted(by_step.items())]


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

    args = sys.argv[1:]
    if args == ["imprint"]:
        build_agent_model()
        return
    overrides = [a for a in args if a != "--base"]
    configure_logging()
    cfg, plugins = load(RECIPE, overrides, [PLUGIN])
    if Path(cfg.model.path).resolve() == AGENT_MODEL and not (AGENT_MODEL / "config.json").exists():
        build_agent_model()
    n = cfg.eval.prompts
    if "--base" in args:
        base = held_out_episodes(str(BASE), cfg, n)
        print("held-out, model before the imprint:", json.dumps(base), flush=True)
    before = held_out_episodes(cfg.model.path, cfg, n)
    print("held-out before:", json.dumps(before), "load:", os.getloadavg(), flush=True)
    start = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="molt-agent-bench-") as run_dir:
        t0 = time.perf_counter()
        history = train(cfg, plugins, Path(run_dir), progress=False)
        wall = time.perf_counter() - t0
        end = datetime.datetime.now(datetime.timezone.utc)
        after = held_out_episodes(str(Path(run_dir) / "final"), cfg, n)
        tool_use = sampled_tool_use(Path(run_dir))
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
        "sampled_tool_use_per_step": tool_use,
        "step_s": [round(h["time/step_s"], 1) for h in steps],
        "cpu_minutes": round(time.process_time() / 60, 1),
        "load_avg": os.getloadavg(),
    }, indent=1))


if __name__ == "__main__":
    main()
