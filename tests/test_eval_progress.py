"""The evaluation's progress line (issue 28: the first SmolLM2 evaluation sat a minute at
`step 0/3` with no sign of life): `Generator.on_group_done` fires once per finished group, and
`evaluate` turns it into "eval: N/TOTAL rollouts". Real HF engine, tiny model."""

from __future__ import annotations

from molt_tools.evaluate import evaluate

ARITHMETIC = ["agent.args.env=arithmetic", "eval.agent_args={env_args: {split: test}}"]


def test_eval_reports_each_finished_group(ray_local, tiny_recipe, tiny_model_dir):
    lines: list[str] = []
    out = evaluate(tiny_model_dir, tiny_recipe, [*ARITHMETIC, "eval.prompts=3", "eval.k=2"],
                   progress=lines.append)
    # 3 greedy groups of 1 rollout, then 3 sampled groups of 2: 9 rollouts
    assert lines == [f"eval: {n}/9 rollouts" for n in (1, 2, 3, 5, 7, 9)]
    assert "eval/sampled/pass@2" in out
