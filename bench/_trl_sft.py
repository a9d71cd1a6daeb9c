"""TRL's side of bench/sft_vs_trl.py (runs in .venv-trl; imports no Molt): `SFTTrainer` on the
rows Molt trained on, pre-tokenized (`input_ids` + `completion_mask`) and read in Molt's order,
LoRA from Molt's initial adapters, the same optimizer. Writes per-step loss, grad norm, wall and
CPU time stamps and the peak RSS to the spec's `out`.

    .venv-trl/bin/python bench/_trl_sft.py SPEC.json
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def load_adapters(model, path: str) -> int:
    """Copy Molt's initial LoRA tensors (names of the plain HF module tree) into the PEFT model."""
    import torch
    from safetensors.torch import load_file
    init = load_file(path)
    ours = {n.removeprefix("base_model.model."): p for n, p in model.named_parameters()
            if ".lora_" in n}
    if set(ours) != set(init):
        missing, extra = sorted(set(init) - set(ours))[:3], sorted(set(ours) - set(init))[:3]
        raise SystemExit(f"adapter names differ: Molt has {missing}..., TRL {extra}...")
    with torch.no_grad():
        for n, p in ours.items():
            if p.shape != init[n].shape:
                raise SystemExit(f"{n}: Molt {tuple(init[n].shape)}, TRL {tuple(p.shape)}")
            p.copy_(init[n])
    return len(ours)


def run(spec: dict) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(spec["threads"])
    steps_rows = json.loads(Path(spec["rows"]).read_text())      # [step][row] as Molt trained
    if len(steps_rows) != spec["steps"] or any(len(s) != spec["batch"] for s in steps_rows):
        raise SystemExit(f"expected {spec['steps']} steps of {spec['batch']} rows")
    data = Dataset.from_list([r for s in steps_rows for r in s])
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    targets = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()    # all-linear
                      if isinstance(m, torch.nn.Linear) and m is not model.get_output_embeddings()})
    args = SFTConfig(
        output_dir=spec["out_dir"], per_device_train_batch_size=spec["micro"],
        gradient_accumulation_steps=spec["batch"] // spec["micro"], max_steps=spec["steps"],
        learning_rate=spec["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=spec["weight_decay"], adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        max_grad_norm=spec["grad_clip"], optim="adamw_torch_fused",
        train_sampling_strategy="sequential", shuffle_dataset=False, packing=False,
        padding_free=False, max_length=None, completion_only_loss=True, loss_type="nll",
        gradient_checkpointing=False, bf16=False, fp16=False, use_cpu=True, seed=spec["seed"],
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0)
    peft = LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], lora_dropout=0.0,
                      target_modules=targets, task_type="CAUSAL_LM")
    steps: list[dict] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            steps.append({"t": time.time(), "cpu": _cpu()})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                steps[-1].update(loss=logs["loss"], grad_norm=logs.get("grad_norm"))

    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                         peft_config=peft, callbacks=[Stamp()])
    n = load_adapters(trainer.model, spec["adapter"])
    trainer.train()
    return {"steps": steps, "adapters": n, "targets": targets,
            "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "threads": torch.get_num_threads()}


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    Path(spec["out"]).write_text(json.dumps(run(spec)))
