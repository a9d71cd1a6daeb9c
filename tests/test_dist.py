"""`make dist`: the wheels of molt-core and every plugin install into a clean venv from the local
wheelhouse alone (`pip --no-index --find-links`), list their plugins and train 3 steps; one
plugin installed alone pulls molt-core from the wheelhouse."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PLUGINS = sorted(p.parent for p in [*ROOT.glob("plugins/*/*/pyproject.toml"),
                                    *ROOT.glob("examples/*/pyproject.toml")])


def _run(cmd: list, timeout: float = 600, cwd: Path | str = "/", **kw) -> str:
    """Run outside the checkout (from it, `python -c` would import the source tree's molt_core)."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, **kw)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _dist_name(project: Path) -> str:
    return tomllib.loads((project / "pyproject.toml").read_text())["project"]["name"]


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What `make dist` builds (same pip command), into a temp dir."""
    wh = tmp_path_factory.mktemp("wheelhouse")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", wh, ROOT, *PLUGINS])
    for project in (ROOT, *PLUGINS):    # setuptools stages in-tree copies under build/
        shutil.rmtree(Path(project) / "build", ignore_errors=True)
    return wh


@pytest.fixture(scope="module")
def deps_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project venv's site-packages without anything Molt (links to torch, ray, transformers,
    ...): third-party dependencies resolve offline, Molt's distributions only from wheels."""
    site = tmp_path_factory.mktemp("deps")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        name = entry.name.lower()
        if not (name.startswith(("molt", "_molt", "__editable__")) or name.endswith(".pth")):
            (site / entry.name).symlink_to(entry)
    return site


def _clean_venv(root: Path, deps_site: Path) -> Path:
    _run([sys.executable, "-m", "venv", "--without-pip", root])
    py = root / "bin" / "python"
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    (Path(purelib) / "_molt_test_deps.pth").write_text(f"{deps_site}\n")
    return py


def _install(py: Path, wheelhouse: Path, *names: str) -> str:
    return _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index",
                 "--find-links", wheelhouse, *names])


def test_wheelhouse_has_core_and_every_plugin(wheelhouse):
    names = {w.name.split("-")[0] for w in wheelhouse.glob("*.whl")}
    assert names == {_dist_name(p).replace("-", "_") for p in [ROOT, *PLUGINS]}


def test_all_wheels_install_list_and_train(tmp_path, wheelhouse, deps_site, tiny_recipe):
    py = _clean_venv(tmp_path / "venv", deps_site)
    _install(py, wheelhouse, *(_dist_name(p) for p in [ROOT, *PLUGINS]))
    where = _run([py, "-c", "import molt_core, molt_grpo; print(molt_core.__file__, "
                            "molt_grpo.__file__)"])
    assert where.count(str(tmp_path / "venv")) == 2          # installed copies, not the checkout
    molt = tmp_path / "venv" / "bin" / "molt"
    listed = _run([molt, "plugins"])
    for project in PLUGINS:
        assert f"({_dist_name(project)} 0." in listed
    assert "molt-core" in _run([molt, "--version"])
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")     # unix socket paths are short
    try:
        out = _run([molt, "run", tiny_recipe, "trainer.steps=3", "rollout.groups_per_step=2",
                    "--no-progress"], env={**_env(), "RAY_TMPDIR": ray_tmp})
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert "(3 steps)" in out


def test_one_plugin_alone_pulls_the_core_from_the_wheelhouse(tmp_path, wheelhouse, deps_site):
    py = _clean_venv(tmp_path / "venv", deps_site)
    log = _install(py, wheelhouse, "molt-estimator-grpo")
    assert f"{wheelhouse}/molt_core-" in log and "Successfully installed" in log
    listed = _run([tmp_path / "venv" / "bin" / "molt", "plugins"])
    assert "(molt-estimator-grpo 0." in listed and "gym" not in listed


def test_a_new_plugin_in_its_own_venv_takes_the_core_from_the_wheelhouse(tmp_path, wheelhouse,
                                                                          deps_site):
    """docs/plugins.md, "Developing a plugin": `pip install --find-links WHEELHOUSE -e PKG` of a
    `molt new-plugin` package in a venv without Molt resolves molt-core from the wheelhouse, and
    `molt`, `python -m molt_core` and `python -m molt_core.cli` there list the plugin."""
    from molt_tools.scaffold import new_plugin

    py = _clean_venv(tmp_path / "venv", deps_site)
    pkg = new_plugin("mine", "estimator", tmp_path)
    log = _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-index",
                "--no-build-isolation", "--find-links", wheelhouse, "-e", pkg])
    assert f"{wheelhouse}/molt_core-" in log and "Successfully installed" in log
    for cmd in ([tmp_path / "venv" / "bin" / "molt"], [py, "-m", "molt_core"],
                [py, "-m", "molt_core.cli"]):
        listed = _run([*cmd, "plugins"], env=_env())
        assert "mine  (molt-estimator-mine 0.1.0)" in listed and "grpo" not in listed, cmd


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
