"""Cold start on a tool task Molt does not ship (issue 42, acceptance 1): SmolLM2-135M-Instruct on
unit conversion with a `convert` tool (examples/unit_agent.py, the stock OpenAI SDK), from its
held-out base rate to held-out greedy success after SFT and after RL, with `molt` commands only:

    1. demos  molt rollout recipes/cpu/smollm2_units_sft.yaml -n N --policy scripted
                  --keep 'reward>=1' --sft-out DEMOS     (the agent's oracle, ChatAgent.policy)
    2. sft    molt sft recipes/cpu/smollm2_units_sft.yaml sft.data=DEMOS
    3. rl     molt run recipes/cpu/smollm2_units.yaml model.init_from=SFT_RUN_DIR

and, outside the three stages, `molt rollout ... --eval --greedy -n 32` on the base model, the SFT
model and the RL model (the held-out split, greedy: eval's greedy pass). The base model's eval
runs alongside stages 1-2 and the SFT model's alongside stage 3: each stage's minutes are its own.

    python bench/smollm2_units.py [--demos 48] [--eval-n 32] [--sft k=v ...] [--rl k=v ...]

Prints per stage its wall minutes and its CPU minutes (os.wait4's rusage of that `molt` process:
RUSAGE_CHILDREN's accounting, the process and everything it waited for; the total over all of
them is resource.getrusage(RUSAGE_CHILDREN)), the load (`uptime`), then a JSON summary. The box
may be shared: judge by CPU minutes. Needs `make pretrained`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
MOLT = str(Path(sys.executable).with_name("molt"))
PLUGIN = "--plugin=./examples/unit_agent.py"
SFT_RECIPE, RL_RECIPE = "recipes/cpu/smollm2_units_sft.yaml", "recipes/cpu/smollm2_units.yaml"


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


class Stage:
    """`molt ARGS` in the background; `wait()` reaps it with os.wait4, whose rusage is that
    process's own and its waited-for children's (RUSAGE_CHILDREN's accounting, per stage)."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name, self.args, self.t0 = name, args, time.perf_counter()
        self.out, self.err = log_dir / f"{name}.out", log_dir / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([MOLT, *args], cwd=ROOT, stdout=out, stderr=err)

    def wait(self) -> tuple[str, str, dict]:
        _, status, ru = os.wait4(self.proc.pid, 0)
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - self.t0
        stdout, stderr = self.out.read_text(), self.err.read_text()
        if self.proc.returncode:
            sys.exit(f"{self.name}: molt {' '.join(self.args)} exited {self.proc.returncode}:\n"
                     f"{stderr[-3000:]}")
        timing = {"wall_min": round(wall / 60, 2),
                  "cpu_min": round((ru.ru_utime + ru.ru_stime) / 60, 2), "load": _uptime()}
        print(f"{self.name}: {timing['wall_min']} wall minutes, {timing['cpu_min']} CPU "
              f"minutes; {timing['load']}", flush=True)
        return stdout, stderr, timing


def run_dir(stderr: str) -> Path:
    return Path(re.search(r"run dir: (\S+)", stderr)[1])


def held_out(name: str, recipe: str, model: str | None, n: int, out: Path, log_dir: Path
             ) -> Stage:
    """Held-out greedy episodes of `model` (None: the recipe's), started."""
    return Stage(name, ["rollout", recipe, PLUGIN, "-n", str(n), "--eval", "--greedy",
                        "--quiet", f"out_dir={out}", *([f"model.path={model}"] if model else [])],
                 log_dir)


def rates(stage: Stage) -> dict:
    stdout, _, timing = stage.wait()
    m = re.search(r"success ([\d.]+) \(reward >= 1\), tool-call rate ([\d.]+)", stdout)
    print(f"  {stage.name}: held-out greedy success {m[1]}, tool-call rate {m[2]}", flush=True)
    return {"success": float(m[1]), "tool_call_rate": float(m[2]), **timing}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demos", type=int, default=48, help="scripted episodes (stage 1)")
    p.add_argument("--eval-n", type=int, default=32, help="held-out greedy episodes per eval")
    p.add_argument("--sft", nargs="*", default=[], metavar="K=V", help="molt sft overrides")
    p.add_argument("--rl", nargs="*", default=[], metavar="K=V", help="molt run overrides")
    p.add_argument("--no-base", action="store_true", help="skip the base model's eval")
    a = p.parse_args()
    if not (ROOT / ".cache/smollm2-135m-instruct/config.json").exists():
        sys.exit("run `make pretrained` first (.cache/smollm2-135m-instruct)")
    out = Path(tempfile.mkdtemp(prefix="molt-units-bench-"))
    logs = out / "logs"
    logs.mkdir()
    print(f"start {time.strftime('%H:%M:%S', time.gmtime())} UTC, runs and logs under {out}; "
          f"{_uptime()}", flush=True)
    result: dict = {"demos": a.demos, "eval_episodes": a.eval_n, "stages": {}}
    base = None if a.no_base else held_out("eval-base", SFT_RECIPE, None, a.eval_n, out, logs)

    demos = out / "demos.jsonl"
    stdout, _, result["stages"]["demos"] = Stage("demos", [
        "rollout", SFT_RECIPE, PLUGIN, "-n", str(a.demos), "--policy", "scripted", "--keep",
        "reward>=1", "--sft-out", str(demos), "--quiet", f"out_dir={out}"], logs).wait()
    result["demos_kept"] = re.search(r"kept (\d+) of (\d+)", stdout)[0]

    stdout, stderr, result["stages"]["sft"] = Stage("sft", [
        "sft", SFT_RECIPE, PLUGIN, f"sft.data={demos}", "--no-progress", f"out_dir={out}",
        *a.sft], logs).wait()
    sft_dir = run_dir(stderr)
    sft_model = sft_dir / "final"
    result["sft_eval_loss"] = (re.search(r"eval/loss: (\S+ -> \S+)", stdout) or [None, None])[1]
    after_sft = held_out("eval-sft", SFT_RECIPE, str(sft_model), a.eval_n, out, logs)

    _, stderr, result["stages"]["rl"] = Stage("rl", [
        "run", RL_RECIPE, PLUGIN, f"model.init_from={sft_dir}", "eval.every=0", "--no-progress",
        f"out_dir={out}", *a.rl], logs).wait()
    rl_dir = run_dir(stderr)
    rows = [json.loads(line) for line in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    result["rl_reward_per_step"] = [round(r["reward/mean"], 3) for r in rows if "reward/mean" in r]
    result["rl_no_signal_steps"] = max(r.get("train/no_signal_steps", 0) for r in rows)
    after_rl = held_out("eval-rl", RL_RECIPE, str(rl_dir / "final"), a.eval_n, out, logs)

    result["held_out_greedy"] = {"base": rates(base) if base else None,
                                 "after_sft": rates(after_sft), "after_rl": rates(after_rl)}
    st = result["stages"]
    result["three_stages"] = {k: round(sum(s[k] for s in st.values()), 2)
                              for k in ("wall_min", "cpu_min")}
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    result["all_children_cpu_min"] = round((r.ru_utime + r.ru_stime) / 60, 2)
    result["load_end"] = _uptime()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
