"""`molt view`: the paged HTML viewer (and its single-file mode) in a real headless Chromium
(DOM after its scripts ran, and a screenshot), and the rich terminal view. Trajectories are
built and saved in-test (the store's own writer), so no training run is needed."""

from __future__ import annotations

import asyncio
import html
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest
import torch
import yaml
from rich.console import Console
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoTokenizer

from molt_tools.commands import main
from molt_core.trajectory import Completion, ImageInput, Trajectory
from molt_core.run.trajectory_store import trajectory_rows, write_trajectories
from molt_tools.view import load_rows, read_trajectories, render_terminal, token_roles

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(CHROMIUM is None,
                                   reason="no chromium (apt-get install chromium)")


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False).input_ids


@pytest.fixture
def run_dir(tmp_path, tiny_chars_dir) -> Path:
    """Step 1: a two-turn rollout (env feedback between the turns, reward per turn) and a
    one-turn one, sampled by version 0; step 2: a two-segment rollout sampled by versions 0 and 1
    (a partial rollout: lag 1), with a trainer gap."""
    tok = AutoTokenizer.from_pretrained(tiny_chars_dir)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"model": {"path": str(tiny_chars_dir)}}))
    a = Trajectory(0, 0, reward=1.5, turn_rewards=[0.5, 1.0])
    a.add_prompt(ids(tok, "guess 1-9: "))
    a.add_completion(Completion(ids(tok, "5"), [-0.7], [0]))
    a.add_prompt(ids(tok, " lower "))
    a.add_completion(Completion(ids(tok, "3"), [-0.2], [0]))
    b = Trajectory(0, 1, reward=0.0)
    b.add_prompt(ids(tok, "guess 1-9: "))
    b.add_completion(Completion(ids(tok, "9"), [-2.0], [0]))
    c = Trajectory(1, 0, reward=0.25)
    c.add_prompt(ids(tok, "after c "), [ImageInput(torch.ones(4, 6), [1, 2, 2], 0, 2)])
    c.add_completion(Completion(ids(tok, "dd"), [-0.1, -0.3], [0, 0]))
    c.segments.append(len(c))
    c.add_prompt(ids(tok, "again "))
    c.add_completion(Completion(ids(tok, "e"), [-0.4], [1]))
    out = tmp_path / "trajectories"
    out.mkdir()
    for step, trajs in ((1, [a, b]), (2, [c])):
        lp = pad_sequence([torch.tensor(s.logprobs) + 0.5 * (step - 1) * torch.tensor(s.loss_mask)
                           for t in trajs for s in t.split_segments()], batch_first=True)
        write_trajectories(out / f"step_{step:06d}.parquet", trajectory_rows(step, trajs, tok, lp))
    return tmp_path


def test_roles_and_terminal_view(run_dir):
    rows = load_rows(run_dir)
    assert [r["reward"] for r in rows] == [1.5, 0.0, 0.25]
    roles = token_roles(rows[0])
    assert roles[0] == "prompt" and roles[-1] == "trainable" and "tool" in roles
    assert "tool" not in token_roles(rows[2]), "a new segment starts with its own prompt"
    assert rows[2]["images"][0]["num_tokens"] == 2 and len(rows[2]["images"][0]["ref"]) == 16
    console = Console(record=True, width=120, file=open("/dev/null", "w"))
    render_terminal(rows, "role", console)
    text = console.export_text()
    assert "step 1  group 0  rollout 0  reward 1.500  turns [0.5, 1.0]" in text
    assert "guess 1-9: 5 [r=0.5] lower 3 [r=1]" in text and "after c dd ‖ again e" in text
    console = Console(record=True, width=120, color_system="standard", file=open("/dev/null", "w"))
    render_terminal(rows[2:], "gap", console)
    assert "\x1b[1;31md" in console.export_text(styles=True)     # |gap| 0.5: red


def chromium(*args: str) -> str:
    """The page as the browser rendered it, without its scripts (the data and the templates)."""
    out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                          "--disable-dev-shm-usage", "--virtual-time-budget=3000", *args],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return re.sub(r"<script.*?</script>", "", out, flags=re.S)


def listed_steps(dom: str) -> list[int]:
    return [int(s) for s in re.findall(r'<div class="row[^"]*" data-step="(\d+)"', dom)]


def shown_tokens(dom: str) -> list[list[tuple[int, str]]]:
    """Per rollout drawn: (token position, its text) of each token span."""
    return [[(int(i), html.unescape(t)) for i, t in
             re.findall(r'<span class="tok[^"]*" data-i="(\d+)"[^>]*>([^<]*)</span>', part)]
            for part in dom.split('<div class="rollout"')[1:]]


@needs_browser
def test_paged_view_in_headless_chromium(run_dir, tmp_path, capsys):
    """An index page and a script per step, loaded when opened; the filters over the index
    and over the open step's rollouts; a screenshot with trainable tokens drawn."""
    assert main(["view", str(run_dir)]) == 0
    page = run_dir / "view" / "index.html"
    assert f"view: {page} (3 rollouts, 2 steps)" in capsys.readouterr().out
    assert sorted(f.name for f in (run_dir / "view" / "steps").iterdir()) == [
        "step_000001.js", "step_000002.js"]
    assert "guess 1-9" not in page.read_text(), "the index holds no rollouts"
    url = page.as_uri()
    dom = chromium("--dump-dom", url)                  # first step shown by default
    assert listed_steps(dom) == [1, 2] and "step 1: 2 of 2 rollouts" in dom
    assert dom.count('class="rollout"') == 2 and dom.count('class="treward"') == 2
    assert 'class="tok trainable"' in dom and 'class="tok tool"' in dom
    assert 'class="tok prompt"' in dom
    dom = chromium("--dump-dom", url + "?step=2&colour=version")
    assert "v0</span>" in dom and "v1</span>" in dom and "hsl(330,70%,80%)" in dom
    assert "[image 2 tokens]" in dom and 'class="seg"' in dom
    for query, steps, count in [("rmin=0.2&rmax=1", [1, 2], "step 1: 0 of 2"),  # by reward
                                ("tmax=1", [1], "step 1: 1 of 2"),              # by turns
                                ("vmin=1", [2], "step 2: 1 of 1"),              # by version
                                ("lag=1", [2], "step 2: 1 of 1"),  # on-policy step 1: lag 0
                                ("gap=0.4&lag=0", [2], "step 2: 1 of 1")]:      # by |gap|
        dom = chromium("--dump-dom", f"{url}?{query}")
        assert listed_steps(dom) == steps and count in dom, query
    shot = tmp_path / "shot.png"
    chromium(f"--screenshot={shot}", "--window-size=1000,700", url)
    img = matplotlib.image.imread(shot)[..., :3]
    assert img.shape[:2] == (700, 1000) and img.std() > 0.02
    trainable = np.array([0xb9, 0xf6, 0xca]) / 255                      # .trainable background
    assert (np.abs(img - trainable).max(-1) < 0.02).sum() > 20, "no trainable token drawn"


@needs_browser
def test_page_shows_the_stored_tokens_from_a_copied_run_dir(run_dir, tiny_chars_dir, tmp_path,
                                                            monkeypatch):
    """Run dir copied (its recipe's model path relative, the tokenizer in final/), viewed from
    another directory, the view folder then moved on its own: each token drawn is the store's
    id at that position, decoded alone, and a segment's tokens spell the store's own text."""
    tok = AutoTokenizer.from_pretrained(tiny_chars_dir)
    tok.save_pretrained(run_dir / "final")
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"path": ".cache/tiny-chars"}}))
    copy = shutil.copytree(run_dir, tmp_path / "copy" / "run")
    monkeypatch.chdir(tmp_path)
    assert main(["view", str(copy), "--out", "elsewhere"]) == 0
    moved = shutil.move(tmp_path / "elsewhere", tmp_path / "moved")
    stored = {(r["step"], r["rollout_id"]): r for r in read_trajectories(copy)}
    for step, n in ((1, 2), (2, 1)):
        dom = chromium("--dump-dom", (moved / "index.html").as_uri() + f"?step={step}")
        drawn = shown_tokens(dom)
        assert len(drawn) == n
        for k, toks in enumerate(drawn):
            r = stored[step, k]
            skipped = {im["start"] + j for im in r["images"] for j in range(im["num_tokens"])}
            assert [i for i, _ in toks] == [i for i in range(len(r["token_ids"]))
                                            if i not in skipped]
            assert [t for _, t in toks] == [tok.decode([r["token_ids"][i]]) for i, _ in toks]
            if not skipped:
                assert "".join(t for _, t in toks) == "".join(r["segment_text"])
    script = (moved / "steps" / "step_000002.js").read_text()
    rec = json.loads(json.loads(script[len("molt_step(JSON.parse("):-len("));\n")]))
    assert rec["rollouts"][0]["ids"] == stored[2, 0]["token_ids"]


@needs_browser
def test_single_file_view(run_dir, capsys):
    """`--single`: one file, every step inside it, the same page (no steps/ folder)."""
    assert main(["view", str(run_dir), "--single"]) == 0
    page = run_dir / "view.html"
    assert f"view: {page} (3 rollouts, 2 steps)" in capsys.readouterr().out
    assert not (run_dir / "view").exists()
    dom = chromium("--dump-dom", page.as_uri() + "?step=2")
    assert "step 2: 1 of 1 rollouts" in dom and "[image 2 tokens]" in dom


def test_tokenizer_from_final_in_a_copied_run_dir_else_one_line_error(run_dir, tiny_chars_dir,
                                                                       tmp_path, monkeypatch,
                                                                       capsys):
    """A recipe's relative model.path died in huggingface_hub ('Repo id must use alphanumeric
    chars') from another directory, although RUN_DIR/final holds the tokenizer; a dir without
    saved trajectories gets one line too."""
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"model": {"path": ".cache/tiny-chars"}}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["view", str(run_dir), "--terminal"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no tokenizer for {run_dir}") and err.count("\n") == 1
    AutoTokenizer.from_pretrained(tiny_chars_dir).save_pretrained(run_dir / "final")
    assert main(["view", str(run_dir), "--terminal"]) == 0
    assert "guess 1-9" in capsys.readouterr().out
    assert main(["view", str(elsewhere)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: no saved trajectories in {elsewhere}") and err.count("\n") == 1


@pytest.fixture
def dataset_run(tmp_path, tiny_chars_dir, monkeypatch) -> Path:
    """One step of rollouts scored by the real `dataset` env on a JSONL file whose rows sit on
    lines 3 and 5 (blank lines and a held-out row before them), saved by the store's writer."""
    from molt_gym import Dataset

    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "view_rewards.py").write_text(
        "def exact(completion, answer):\n    return float(completion.strip() == answer)\n")
    data = tmp_path / "letters.jsonl"
    data.write_text("\n".join([json.dumps({"prompt": "after a ", "answer": "b", "split": "test"}),
                               "", json.dumps({"prompt": "after b ", "answer": "c", "hint": 2}),
                               "", json.dumps({"prompt": "after c ", "answer": "d", "hint": 3})]))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "model": {"path": str(tiny_chars_dir)},
        "agent": {"name": "gym", "args": {"env": "dataset", "env_args": {"data": str(data)}}}}))
    tok = AutoTokenizer.from_pretrained(tiny_chars_dir)
    env = Dataset(data=str(data), reward="view_rewards:exact", test_fraction=0.0, shuffle=False)
    trajs = []
    for k, reply in enumerate(["c", "x"]):
        traj = Trajectory(0, k)
        traj.add_prompt(ids(tok, asyncio.run(env.reset(k))))
        traj.add_completion(Completion(ids(tok, reply), [-0.5], [0]))
        _, traj.reward, _, traj.info = asyncio.run(env.step(reply))
        trajs.append(traj)
    (tmp_path / "trajectories").mkdir()
    write_trajectories(tmp_path / "trajectories" / "step_000000.parquet",
                       trajectory_rows(0, trajs, tok))
    sys.modules.pop("view_rewards", None)
    return tmp_path


def test_terminal_view_shows_the_data_row_each_reward_compared(dataset_run, capsys):
    assert main(["view", str(dataset_run), "--terminal"]) == 0
    out = " ".join(capsys.readouterr().out.split())      # the console wraps long lines
    assert ("data line 3 (row 0 of its split): answer='c', hint=2, reward/view_rewards:exact=1.0"
            in out)
    assert "data line 5 (row 1 of its split): answer='d', hint=3, reward/view_rewards:exact=0.0" \
        in out


@needs_browser
def test_page_shows_each_completion_beside_its_data_row(dataset_run, tmp_path):
    """Each rollout's tokens with a table beside them: the data file and line, the row's
    columns and each reward function's value; a screenshot has the table drawn."""
    assert main(["view", str(dataset_run)]) == 0
    url = (dataset_run / "view" / "index.html").as_uri()
    dom = chromium("--dump-dom", url)
    tables = re.findall(r'<table class="data">(.*?)</table>', dom)
    data = dataset_run / "letters.jsonl"                 # named, its full path in the title
    assert [re.search(r'<caption title="(.*?)">(.*?)</caption>', t).groups() for t in tables] == [
        (str(data), "letters.jsonl line 3 (row 0 of its split)"),
        (str(data), "letters.jsonl line 5 (row 1 of its split)")]
    cells = [dict(re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", t)) for t in tables]
    assert cells == [{"answer": "c", "hint": "2", "reward/view_rewards:exact": "1"},
                     {"answer": "d", "hint": "3", "reward/view_rewards:exact": "0"}]
    assert "info <code>" not in dom            # nothing else in info: no empty info line
    shot = tmp_path / "data.png"
    chromium(f"--screenshot={shot}", "--window-size=1000,500", url)
    img = matplotlib.image.imread(shot)[..., :3]
    table = np.array([0xf3, 0xf8, 0xff]) / 255                          # .data background
    assert (np.abs(img - table).max(-1) < 0.01).sum() > 500, "no data table drawn"
