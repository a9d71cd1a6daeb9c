"""`molt new-plugin`: the generated packages pip-install into a fresh venv, pass their own tests,
and `--plugin NAME` selects them (validate) and runs them (one training step)."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
import uuid
from pathlib import Path

import pytest
import yaml

from molt_tools.commands import main
from molt_tools.scaffold import new_plugin


def _run(cmd: list[str], cwd: Path | None = None, timeout: float = 300) -> str:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new venv (no pip of its own) that sees the project's venv through a .pth file, so molt
    and torch resolve while what we install lands only here."""
    root = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", root])
    py = root / "bin" / "python"
    site = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    parent = sysconfig.get_paths()["purelib"]
    (Path(site) / "_molt_parent_venv.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    return py


def test_generated_plugins_install_test_and_select(tmp_path, fresh_venv, tiny_recipe):
    tag = uuid.uuid4().hex[:6]
    names = {"estimator": f"est_{tag}", "agent": f"agent_{tag}", "rollout": f"roll_{tag}"}
    pkgs = {}
    for kind, name in names.items():
        assert main(["new-plugin", name, "--kind", kind, "--dir", str(tmp_path)]) == 0
        pkgs[kind] = tmp_path / name
        assert (pkgs[kind] / "pyproject.toml").is_file()
    _run([sys.executable, "-m", "pip", "--python", fresh_venv, "install", "-q", "--no-deps",
          "--no-build-isolation", "--no-index", *pkgs.values()])

    for kind, pkg in pkgs.items():                       # each template passes its own test
        out = _run([fresh_venv, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd=pkg)
        assert " passed" in out and "failed" not in out

    molt = [fresh_venv, "-m", "molt_tools"]
    est, agent, roll = names["estimator"], names["agent"], names["rollout"]
    out = _run([*molt, "validate", tiny_recipe, "--plugin", est])
    assert f"estimator={est}, loss={est}" in out
    out = _run([*molt, "validate", tiny_recipe, "agent.args={}", "--plugin", agent])
    assert f"agent={agent}" in out
    out = _run([*molt, "validate", tiny_recipe, "--plugin", roll])
    assert f"scheme={roll}" in out
    # not installed in the project's venv: the plugin exists only where it was installed
    assert main(["validate", tiny_recipe, "--plugin", est]) == 2

    # one real training step with the new estimator: scale=0 zeroes every advantage
    out = _run([*molt, "run", tiny_recipe, "trainer.steps=1", "--plugin", est,
                "rollout.groups_per_step=2", "--no-progress", "algorithm.estimator_args.scale=0.0"])
    assert "reward: first step" in out
    run_dir = next((Path(yaml.safe_load(open(tiny_recipe))["out_dir"])).iterdir())
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["algorithm"]["estimator"] == est and cfg["algorithm"]["loss"] == est
    step = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert step["adv/abs_mean"] == 0.0 and "clip_fraction" in step
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["plugins"][est]["distribution"] == f"molt-estimator-est-{tag}"


def test_bad_names_and_existing_directories_are_rejected(tmp_path, capsys):
    with pytest.raises(ValueError, match="lowercase Python identifier"):
        new_plugin("My-Plugin", "estimator", tmp_path)
    with pytest.raises(ValueError, match="valid: estimator, agent, rollout"):
        new_plugin("mine", "loss", tmp_path)
    new_plugin("mine", "agent", tmp_path)
    assert main(["new-plugin", "mine", "--kind", "agent", "--dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
