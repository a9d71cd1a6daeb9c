"""The real `tinker` SDK against `molt serve-tinker` on loopback: the service's endpoints, the
training loops of the cookbook's shape, Molt's own losses as the numerical reference, bad
requests."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import tinker
from tinker import types


def test_molt_cli_commands_adds_serve_tinker():
    """The plugin's `molt_cli_commands` hook gives `molt serve-tinker`; core commands stay."""
    from molt_tools.commands import COMMANDS, plugin_commands
    commands = plugin_commands()
    assert commands["serve-tinker"][2] == "molt_tinker.server:main"
    assert {k: commands[k] for k in COMMANDS} == COMMANDS
    out = subprocess.run([sys.executable, "-m", "molt_tools", "serve-tinker", "-h"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--session-timeout" in out.stdout, out.stderr[-2000:]


def test_health_capabilities_and_a_session(server: str):
    rest = tinker.RestClient()
    caps = rest.get_server_capabilities().result()
    (model,) = caps.supported_models
    assert model.trainable and model.sampleable and model.max_context_length > 0
    with tinker.ServiceClient() as service:
        tc = service.create_lora_training_client(base_model=model.model_name, rank=4).result()
        info = tc.get_info()
        assert info.is_lora and info.lora_rank == 4 and info.model_data.model_name == model.model_name
        tok = tc.get_tokenizer()            # offline: the tokenizer id is the local model dir
        assert tok.decode(tok.encode("abc")) == "abc"
