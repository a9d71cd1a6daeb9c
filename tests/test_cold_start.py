"""The cold-start pipeline of docs/agents.md on a tool task Molt does not ship
(examples/unit_agent.py, recipes/cpu/smollm2_units_sft.yaml + smollm2_units.yaml), on the tiny
model: demonstrations from the agent's scripted oracle through `molt rollout`, `molt sft` on them,
`molt run` RL from the SFT model. The real model's run is bench/smollm2_units.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from molt_tools.commands import main

ROOT = Path(__file__).parents[1]
PLUGIN = f"--plugin={ROOT / 'examples/unit_agent.py'}"


def _weights(model_dir: Path) -> dict:
    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_the_unit_tool_converts_and_refuses_what_it_cannot():
    sys.path.insert(0, str(ROOT / "examples"))
    from unit_agent import convert
    assert convert(json.dumps({"value": 3.7, "from_unit": "inches", "to_unit": "cm"})) == \
        "9.398 centimetres"
    assert convert('{"value": 2, "from_unit": "lbs", "to_unit": "kilograms"}') == \
        "0.907 kilograms"
    assert convert('{"value": 2, "from_unit": "pounds", "to_unit": "metres"}') == \
        "error: cannot convert mass to length"
    assert convert('{"value": 2, "from_unit": "parsecs", "to_unit": "metres"}').startswith(
        "error: unknown unit")
    assert convert('{"value": "two"}').startswith("error: call convert with")


def test_demos_then_sft_then_rl_on_a_new_tool_task(tiny_model_dir, tmp_path, capsys):
    runs, demos = tmp_path / "runs", tmp_path / "demos.jsonl"
    model, out = f"model.path={tiny_model_dir}", f"out_dir={runs}"
    sft_recipe = str(ROOT / "recipes/cpu/smollm2_units_sft.yaml")
    assert main(["rollout", sft_recipe, PLUGIN, "-n", "3", "--policy", "scripted", "--keep",
                 "reward>=1", "--sft-out", str(demos), "--quiet", model, out]) == 0
    printed = capsys.readouterr().out
    assert "success 1.000 (reward >= 1), tool-call rate 1.000" in printed, printed
    rows = [json.loads(line) for line in demos.read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:       # the oracle's call, the tool's result, an answer quoting it
        user, call, result, answer = r["messages"]
        (tc,) = call["tool_calls"]
        args = json.loads(tc["function"]["arguments"])
        assert tc["function"]["name"] == "convert" == r["tools"][0]["function"]["name"]
        assert f"{args['value']} {args['from_unit']}" in user["content"]
        assert result["role"] == "tool" and result["content"].endswith(args["to_unit"])
        assert answer["content"].endswith(f" is {result['content']}.")

    assert main(["sft", sft_recipe, PLUGIN, f"sft.data={demos}", "sft.steps=2",
                 "sft.batch_size=2", "sft.eval_fraction=0", "--no-progress", model, out]) == 0
    (sft_dir,) = [d for d in runs.iterdir() if d.name.startswith("smollm2_units_sft-2")]
    sft_model = sft_dir / "final"
    before, after = _weights(tiny_model_dir), _weights(sft_model)
    assert any((before[k] != after[k]).any() for k in before), "SFT changed no weight"

    assert main(["run", str(ROOT / "recipes/cpu/smollm2_units.yaml"), PLUGIN,
                 f"model.init_from={sft_dir}", "trainer.steps=1", "rollout.groups_per_step=1",
                 "rollout.group_size=2", "eval.every=1", "eval.prompts=2", "--no-progress",
                 out]) == 0
    (rl_dir,) = [d for d in runs.iterdir() if d.name.startswith("smollm2_units-")]
    rows = [json.loads(line) for line in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in rows if "reward/mean" in r]) == 1
    assert len([r for r in rows if "eval/greedy/pass@1" in r]) == 2       # before and after
    assert (rl_dir / "final" / "config.json").exists()
    assert f"init_from: {sft_dir}" in (rl_dir / "config.yaml").read_text()    # the lineage
