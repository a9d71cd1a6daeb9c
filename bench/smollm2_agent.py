"""The agentic learning run on a real model: SmolLM2-135M-Instruct learns to use a calculator tool
(recipes/cpu/smollm2_agent.yaml, examples/calculator_agent.py on the stock OpenAI SDK).

    python bench/smollm2_agent.py [--base] [--demos 32] [key=value ...] [--sft k=v ...]
                                  (needs make pretrained)

The base model never calls the tool, so RL starts from a cold start made with `molt` commands
(docs/agents.md, "Cold start"): `molt rollout recipes/cpu/smollm2_agent_sft.yaml --policy scripted
--keep 'reward>=1' --sft-out DEMOS` (the agent's oracle, CalculatorAgent.policy), `molt sft` on
them, then the recipe with `model.init_from=SFT_RUN_DIR`. `--base` also measures the held-out
episodes on the model before the cold start.

Prints start and end (UTC), the cold start's demos kept and SFT minutes (wall and CPU), minutes
of training (evaluations excluded), held-out greedy success at every evaluation, the held-out
episodes' tool use before and after (`held_out_episodes`: the agent on the SFT model and on the
trained one, greedy, through the chat server: tool called, tool called with the right
expression, answer right, reply well-formed), the step-time breakdown and the trainer's peak
memory. `uptime`'s load is printed with it: the box may be shared.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
RECIPE = str(ROOT / "recipes/cpu/smollm2_agent.yaml")
SFT_RECIPE = str(ROOT / "recipes/cpu/smollm2_agent_sft.yaml")
PLUGIN = str(ROOT / "examples/calculator_agent.py")
BASE = ROOT / ".cache/smollm2-135m-instruct"
MOLT = str(Path(sys.executable).with_name("molt"))


def molt(*args: str) -> tuple[str, str, dict]:
    """`molt ARGS` (stdout, stderr, {wall_min, cpu_min}: os.wait4's rusage of that process)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([MOLT, *args, f"--plugin={PLUGIN}"], cwd=ROOT, stdout=out,
                                stderr=err)
        _, status, ru = os.wait4(proc.pid, 0)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"molt {' '.join(args)} failed:\n{stderr[-3000:]}")
    return stdout, stderr, {"wall_min": round((time.perf_counter() - t0) / 60, 2),
                            "cpu_min": round((ru.ru_utime + ru.ru_stime) / 60, 2)}


def cold_start(out_dir: Path, demos: int, sft_overrides: list[str]) -> tuple[Path, dict]:
    """Demonstrations from the scripted oracle, then `molt sft` on them: (SFT run dir, numbers)."""
    data = out_dir / "demos.jsonl"
    out, _, t_demos = molt("rollout", SFT_RECIPE, "-n", str(demos), "--policy", "scripted",
                           "--keep", "reward>=1", "--sft-out", str(data), "--quiet",
                           f"out_dir={out_dir}")
    kept = re.search(r"kept (\d+) of (\d+)", out)[0]
    out, err, t_sft = molt("sft", SFT_RECIPE, f"sft.data={data}", "--no-progress",
                           f"out_dir={out_dir}", *sft_overrides)
    loss = re.search(r"eval/loss: (\S+ -> \S+)", out)
    numbers = {"demos_kept": kept, "demos": t_demos, "sft": t_sft,
               "sft_eval_loss": loss[1] if loss else None, "load": os.getloadavg()}
    print("cold start:", json.dumps(numbers), flush=True)
    return Path(re.search(r"run dir: (\S+)", err)[1]), numbers


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

    args, demos, sft_overrides = sys.argv[1:], 32, []
    if "--demos" in args:
        i = args.index("--demos")
        demos, args = int(args[i + 1]), args[:i] + args[i + 2:]
    if "--sft" in args:        # --sft k=v ... up to the next flag or the end
        i = args.index("--sft")
        j = next((k for k in range(i + 1, len(args)) if args[k].startswith("--")), len(args))
        sft_overrides, args = args[i + 1:j], args[:i] + args[j:]
    if not (BASE / "config.json").exists():
        sys.exit(f"{BASE} is missing: run `make pretrained` first")
    configure_logging()
    work = Path(tempfile.mkdtemp(prefix="molt-agent-bench-"))
    overrides = [a for a in args if a != "--base"]
    cold = None           # model.init_from=RUN_DIR given: that run is the cold start
    if not any(a.startswith("model.init_from=") for a in overrides):
        sft_dir, cold = cold_start(work, demos, sft_overrides)
        overrides.append(f"model.init_from={sft_dir}")
    cfg, plugins = load(RECIPE, overrides, [PLUGIN])
    n = cfg.eval.prompts
    if "--base" in args:
        base = held_out_episodes(str(BASE), cfg, n)
        print("held-out, model before the cold start:", json.dumps(base), flush=True)
    before = held_out_episodes(cfg.model.path, cfg, n)
    print("held-out before:", json.dumps(before), "load:", os.getloadavg(), flush=True)
    start = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="run-", dir=work) as run_dir:
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
        "cold_start": cold, "engine": cfg.engine.name, "steps": len(steps), "lr": cfg.trainer.lr,
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
