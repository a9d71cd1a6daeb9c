"""TRL's own view of `environment_factory` classes, as JSON: run in .venv-trl (no molt imports).

    .venv-trl/bin/python tests/trl_probe.py SPECS.json OUT.json     (cwd: the envs' directory)

SPECS is {name: SPEC}, OUT is {name: what TRL did with SPEC}; a SPEC is
    {"model": dir, "environment": "module:Class", "reward": {"module:function": weight},
     "rows": [row, ...] | null, "cases": [{"inputs": [row index, ...], "turns": [text, ...],
     "seed": int}], "max_completion_length": int, "max_tool_calling_iterations": int}
A real `trl.GRPOTrainer(environment_factory=...)` is built; OUT records what it derived (the tool
schemas it renders, its reward sources and weights, the reward functions' keyword arguments) or
the error it raised. Each case then runs TRL's `_generate_and_score_completions` on those dataset
rows with generation scripted (every rollout's turn k replies `turns[k]`: the model is random, so
this is the one part replaced): reset, tool calls, tool messages, token ids, tool mask and
rewards are all TRL's own code.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
import sys
import tempfile
from typing import Any


def _load(name: str) -> Any:
    module, _, attr = name.rpartition(":")
    return getattr(importlib.import_module(module), attr)


def _plain(x: Any) -> Any:
    """JSON-able: tensors as lists, objects (environments, states) as their type name."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if x is None or isinstance(x, (str, int, float, bool)) else type(x).__name__


def probe(spec: dict) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema
    from trl import GRPOConfig, GRPOTrainer

    funcs = [_load(n) for n in spec.get("reward", {})]
    tok = AutoTokenizer.from_pretrained(spec["model"])
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2,
                      num_generations=2, max_steps=1, use_cpu=True,
                      max_completion_length=spec.get("max_completion_length", 256),
                      bf16=False, report_to=[], reward_weights=list(spec.get("reward", {}).values())
                      or None, max_tool_calling_iterations=spec.get("max_tool_calling_iterations"))
    rows = spec.get("rows")
    out: dict[str, Any] = {}
    try:
        trainer = GRPOTrainer(model=spec["model"], processing_class=tok, reward_funcs=funcs,
                              args=args, train_dataset=Dataset.from_list(rows) if rows else None,
                              environment_factory=_load(spec["environment"]))
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    try:        # transformers renders each callable by its get_json_schema
        out["tools"] = [get_json_schema(t) for t in trainer._env_tools[None]]
    except Exception as e:
        out["tools"] = f"{type(e).__name__}: {e}"
    out["reward_func_names"] = list(trainer.reward_func_names)
    out["reward_weights"] = trainer.reward_weights.tolist()
    out["chat_template_swapped"] = trainer.chat_template is not None
    out["cases"], keys = [], set()

    def spy(fn):        # the keyword arguments the reward functions get
        async def acall(**kw):
            keys.update(kw)
            return await fn(**kw)

        def call(**kw):
            keys.update(kw)
            return fn(**kw)
        return acall if inspect.iscoroutinefunction(fn) else call

    trainer.reward_funcs = [spy(f) for f in trainer.reward_funcs]
    generate, rewards = trainer._generate, trainer._calculate_rewards
    for case in spec.get("cases", []):
        seen: dict[str, Any] = {}
        turns = iter(case["turns"])

        def scripted(prompt_ids, images, multimodal_fields, num_generations, **_):
            ids = tok(next(turns), add_special_tokens=False)["input_ids"]
            return [list(ids) for _ in prompt_ids], None

        def record_generate(prompts):
            res = generate(prompts)
            seen["prompt_ids"], seen["completion_ids"], seen["tool_mask"] = res[0], res[1], res[2]
            return res

        def record_rewards(inputs, prompts, completions, completion_ids_list):
            per_func = rewards(inputs, prompts, completions, completion_ids_list)
            seen["prompts"], seen["completions"], seen["rewards_per_func"] = \
                prompts, completions, per_func
            # GRPOTrainer's total: nansum over sources of weight * reward
            seen["reward"] = (per_func * trainer.reward_weights).nansum(dim=1)
            return per_func

        trainer._generate_single_turn = scripted
        trainer._generate, trainer._calculate_rewards = record_generate, record_rewards
        inputs = [dict(trainer.train_dataset[i]) for i in case["inputs"]]
        random.seed(case.get("seed", 0))
        try:
            trainer._generate_and_score_completions(inputs)
        except Exception as e:
            seen["error"] = f"{type(e).__name__}: {e}"
        out["cases"].append(_plain(seen))
    out["reward_kwargs"] = sorted(keys)
    return out


if __name__ == "__main__":
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    sys.path.insert(0, os.getcwd())
    specs = json.load(open(sys.argv[1]))
    json.dump({name: probe(spec) for name, spec in specs.items()}, open(sys.argv[2], "w"))
