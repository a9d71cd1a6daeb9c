"""`molt serve-tinker RECIPE [k=v ...]`: the REST API the unmodified `tinker` SDK calls (sessions,
LoRA training clients, several at once time-sharing one trainer, forward/backward with Tinker's
losses, Adam steps, sampling, checkpoints, futures), served on 127.0.0.1 by Molt's own trainer
(`Policy.train`) and rollout engine (docs/tinker.md). The package registers the command and the
trainer backend it trains with."""

from __future__ import annotations

from molt_core import hookimpl

__all__: list[str] = []


@hookimpl
def molt_cli_commands() -> dict[str, tuple[str, str, str]]:
    return {"serve-tinker": ("serve a Tinker-compatible training API on the recipe's model "
                             "(tinker SDK: TINKER_BASE_URL=http://127.0.0.1:PORT)",
                             "molt_tinker.server:add_args", "molt_tinker.server:main")}


@hookimpl
def molt_trainer_backends() -> dict[str, str]:
    # the fsdp2 backend plus per-step Adam hyper-parameters (Tinker's optim_step sends them)
    return {"tinker": "molt_tinker.backend:TinkerPolicy"}
