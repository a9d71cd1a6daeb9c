"""`molt view RUN_DIR`: browse the saved trajectories of a run.

Writes `RUN_DIR/view/`: an index page of per-step summaries and one script per step that the
page loads when the step is opened, so a run of any length opens at once (no server, no
network: open `index.html` in any browser, or copy the folder); `--single` writes one
self-contained HTML file instead, and `--terminal` prints with rich. Per step and rollout, each
token is coloured by its role (prompt / trainable / tool or env feedback), by the weight version
that sampled it, or by the engine-vs-trainer log-prob gap; turns and segments are marked, with
their rewards; steps and rollouts are filtered by reward, turn count, version, lag and gap.
"""

from __future__ import annotations

import argparse
import html
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

__all__ = ["add_args", "data_file", "decoder", "iter_steps", "load_rows", "main",
           "read_trajectories", "render_terminal", "segment_links", "step_record", "token_roles",
           "write_paged", "write_single"]

Decode = Callable[[list[int]], dict[int, str]]


def _files(path: str | Path) -> list[Path]:
    path = Path(path)
    if path.is_dir() and (path / "trajectories").is_dir():
        path = path / "trajectories"
    return sorted(path.glob("*.parquet")) if path.is_dir() else [path]


def read_trajectories(path: str | Path, steps: list[int] | None = None) -> list[dict[str, Any]]:
    """Rows (plain dicts) of a run directory, its `trajectories/` folder or one Parquet file."""
    import pyarrow.parquet as pq
    rows = [r for f in _files(path) for r in pq.read_table(f).to_pylist()]
    return [r for r in rows if steps is None or r["step"] in steps]


def iter_steps(path: str | Path, keep: Callable[[dict], bool] | None = None,
               steps: list[int] | None = None, digits: int | None = None
               ) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """(step, its kept rows) in step order, one Parquet file in memory at a time (the store
    writes whole steps to a file); `digits`: log-probs rounded, and each row's `gap` added."""
    import pyarrow.parquet as pq
    for f in _files(path):
        table = pq.read_table(f, filters=[("step", "in", steps)] if steps else None)
        by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for r in (_rounded(table, digits) if digits is not None else table).to_pylist():
            if keep is None or keep(r):
                by_step[r["step"]].append(r)
        yield from sorted(by_step.items())


def _rounded(table: Any, digits: int) -> Any:
    """Log-probs rounded (short JSON) and `gap`: max |trainer - behavior| log-prob over a row's
    trainable tokens (None without trainer log-probs), in numpy: a Python loop over every
    token costs a 1,000-step run most of a minute."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    cols = {c: table[c].combine_chunks() for c in ("behavior_logprobs", "trainer_logprobs",
                                                  "loss_mask")}
    for c in ("behavior_logprobs", "trainer_logprobs"):
        x = cols[c]
        table = table.set_column(table.schema.get_field_index(c), c, pa.ListArray.from_arrays(
            pc.subtract(x.offsets, x.offsets[0]), pc.round(pc.cast(x.flatten(), pa.float64()),
                                                           digits)))
    has = pc.list_value_length(cols["trainer_logprobs"]).to_numpy(zero_copy_only=False) > 0
    gap = np.full(len(table), np.nan)
    if has.any():
        lp, tlp, m = (pc.filter(cols[c], pa.array(has)) for c in cols)
        d = np.abs(tlp.flatten().to_numpy() - lp.flatten().to_numpy())
        m = m.flatten().to_numpy(zero_copy_only=False)
        starts = (tlp.offsets.to_numpy() - tlp.offsets[0].as_py())[:-1]
        gap[has] = np.where(np.logical_or.reduceat(m, starts),
                            np.maximum.reduceat(d * m, starts), np.nan)
    return table.append_column("gap", pa.array(np.round(gap, digits), from_pandas=True))


def decoder(tokenizer_path: str | Path) -> Decode:
    """`decode(ids)`: {id: its text}, each id decoded once, on its own (what a token shows);
    with `tokenizers` alone where the directory has a tokenizer.json (no transformers import)."""
    if (Path(tokenizer_path) / "tokenizer.json").is_file():
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(Path(tokenizer_path) / "tokenizer.json"))
        batch = lambda ids: tok.decode_batch(ids, skip_special_tokens=False)    # noqa: E731
    else:
        from transformers import AutoTokenizer
        batch = AutoTokenizer.from_pretrained(tokenizer_path).batch_decode
    cache: dict[int, str] = {}

    def decode(ids: list[int]) -> dict[int, str]:
        new = sorted(set(ids) - cache.keys())
        cache.update(zip(new, batch([[i] for i in new])))
        return {i: cache[i] for i in set(ids)}
    return decode


def token_roles(row: dict[str, Any]) -> list[str]:
    """Per token: `prompt` (before the first sampled token of its segment), `trainable`, or
    `tool` (context after the policy's first turn: tool results, env feedback)."""
    roles, seen = [], False
    starts = set(row["segments"])
    for i, m in enumerate(row["loss_mask"]):
        seen = seen and i not in starts
        roles.append("trainable" if m else "tool" if seen else "prompt")
        seen = seen or m
    return roles


def _turns(row: dict[str, Any]) -> list[tuple[int, int]]:
    """Token spans of the policy's turns: `info["turn_spans"]` (chat) or the runs of trainable
    tokens."""
    spans = json.loads(row["info"] or "{}").get("turn_spans")
    if spans:
        return [tuple(s) for s in spans]
    out, start = [], None
    for i, m in enumerate(row["loss_mask"] + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def segment_links(roles: list[str] | None) -> list[str]:
    """Per segment, how it links to the one before (chat `info["segment_roles"]`, e.g. a
    compaction's ["", "summary", ""]): "summary of segment 0", "continues from segment 1's
    summary"; [] without roles."""
    out = []
    for k, role in enumerate(roles or ()):
        prev = roles[k - 1] if k else ""
        out.append(f"segment {k}: {role}" + (f" of segment {k - 1}" if k else "") if role else
                   f"segment {k}: continues from segment {k - 1}'s {prev}" if prev else "")
    return out


def tokenizer_dir(run_dir: str | Path) -> Path:
    """RUN_DIR/final (the run's own copy), else the run's `model.path` if it is a directory here;
    a one-line RunDirError when neither is (a copied run dir whose model path was relative)."""
    from molt_core.run.metrics import RunDirError

    run_dir = Path(run_dir)
    final = run_dir / "final"
    if any((final / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return final
    try:
        model = Path(yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"])
    except (OSError, KeyError, TypeError):
        model = None
    if model is not None and model.is_dir():
        return model.resolve()
    raise RunDirError(f"no tokenizer for {run_dir}: neither {final} nor the run's model.path "
                      f"({model or 'missing in config.yaml'}) is a tokenizer directory here; "
                      "pass --tokenizer DIR")


def load_rows(run_dir: str | Path, tokenizer_path: str | None = None) -> list[dict[str, Any]]:
    """Saved rows with per-token text (`tokens`), roles and turn spans added."""
    decode = decoder(tokenizer_path or tokenizer_dir(run_dir))
    rows = read_trajectories(run_dir)
    for r in rows:
        text = decode(r["token_ids"])
        r["tokens"] = [text[i] for i in r["token_ids"]]
        r["roles"] = token_roles(r)
        r["turns"] = _turns(r)
    return rows


_ROLE = {"prompt": "p", "trainable": "t", "tool": "o"}


def _rollout(r: dict[str, Any]) -> dict[str, Any]:
    """A row as the page reads it: roles one letter a token, with what the filters test
    (`vrange`: oldest and newest sampling version; `gap`: max |trainer - behavior| log-prob)."""
    sampled = [v for v in r["versions"] if v >= 0]
    return {"group": r["group_id"], "rollout": r["rollout_id"], "task": r["task"],
            "reward": r["reward"], "turn_rewards": r["turn_rewards"], "truncated": r["truncated"],
            "ids": r["token_ids"], "roles": "".join(_ROLE[x] for x in token_roles(r)),
            "lp": r["behavior_logprobs"], "tlp": r["trainer_logprobs"], "versions": r["versions"],
            "segments": r["segments"], "turns": _turns(r), "info": r["info"],
            "links": segment_links(json.loads(r["info"] or "{}").get("segment_roles")),
            "images": [{k: im[k] for k in ("start", "num_tokens", "ref")} for im in r["images"]],
            "vrange": [min(sampled), max(sampled)] if sampled else None,
            "gap": r.get("gap")}


def step_record(step: int, rows: list[dict[str, Any]], decode: Decode) -> dict[str, Any]:
    """One step for the page: its rollouts (rows of `iter_steps(..., digits=4)`) and the text
    of each token id they hold."""
    return {"step": step, "vocab": decode([i for r in rows for i in r["token_ids"]]),
            "rollouts": [_rollout(r) for r in rows]}


def _summary(rec: dict[str, Any]) -> dict[str, Any]:
    """A step's line in the index: ranges the page's filters test before loading the step."""
    ro = rec["rollouts"]
    span = lambda xs: [min(xs), max(xs)] if xs else None     # noqa: E731
    vr = [v for r in ro if r["vrange"] for v in r["vrange"]]
    gaps = [r["gap"] for r in ro if r["gap"] is not None]
    return {"step": rec["step"], "n": len(ro),
            "reward": round(sum(r["reward"] for r in ro) / len(ro), 4),
            "rewards": span([r["reward"] for r in ro]),
            "turns": span([len(r["turns"]) for r in ro]),
            "versions": span(vr), "gap": max(gaps) if gaps else None,
            "tokens": round(sum(len(r["ids"]) for r in ro) / len(ro))}


def _js(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")


def _step_js(rec: dict[str, Any]) -> str:
    """The step's script: JSON in a string (V8 parses JSON.parse's argument ~2x faster than the
    same object as code: a 150 kB step opens ~0.3 s sooner on a loaded box)."""
    return f"molt_step(JSON.parse({json.dumps(_js(rec), ensure_ascii=False)}));\n"


def data_file(run_dir: str | Path) -> str:
    """The run's data file (env `dataset`: `agent.args.env_args.data`), "" for other envs."""
    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
        return str(cfg["agent"]["args"]["env_args"]["data"])
    except (OSError, KeyError, TypeError):
        return ""


def _page(out: Path, title: str, index: list[dict], paged: bool, inline: str = "",
          data: str = "") -> Path:
    from molt_tools.view_page import PAGE

    page = (PAGE.replace("__TITLE__", html.escape(title)).replace("__PAGED__", _js(paged))
            .replace("__DATA__", _js(data)).replace("__INDEX__", _js(index))
            .replace("__STEPS__", inline))
    out.write_text(page, encoding="utf-8")
    return out


def write_paged(steps: Iterator[tuple[int, list[dict]]], out: str | Path, decode: Decode,
                title: str = "molt view", data: str = "") -> tuple[Path, list[dict]]:
    """`out/index.html` (the per-step summaries) and `out/steps/step_NNNNNN.js` per step, which
    the page loads by `<script src>` when the step is opened (from file:// too); `data`: the
    data file named beside each row's line."""
    out = Path(out)
    (out / "steps").mkdir(parents=True, exist_ok=True)
    for old in (out / "steps").glob("step_*.js"):
        old.unlink()
    index = []
    for step, rows in steps:
        rec = step_record(step, rows, decode)
        (out / "steps" / f"step_{step:06d}.js").write_text(_step_js(rec), encoding="utf-8")
        index.append(_summary(rec))
    return _page(out / "index.html", title, index, True, data=data), index


def write_single(steps: Iterator[tuple[int, list[dict]]], out: str | Path, decode: Decode,
                 title: str = "molt view", data: str = "") -> tuple[Path, list[dict]]:
    """One self-contained HTML file: the same page, every step inline."""
    recs = [step_record(step, rows, decode) for step, rows in steps]
    inline = "".join(f"<script>{_step_js(rec)}</script>" for rec in recs)
    index = [_summary(r) for r in recs]
    return _page(Path(out), title, index, False, inline, data), index


def render_terminal(rows: list[dict[str, Any]], colour: str = "role", console: Any = None,
                    limit: int = 20) -> None:
    """Rollouts as rich text: tokens styled by `colour` (role | version | gap)."""
    from rich.console import Console
    from rich.text import Text
    console = console or Console()
    palette = ["cyan", "magenta", "yellow", "green", "blue", "red"]
    for r in rows[:limit]:
        turns = r["turn_rewards"] or []
        console.rule(f"step {r['step']}  group {r['group_id']}  rollout {r['rollout_id']}  "
                     f"reward {r['reward']:.3f}" + (f"  turns {turns}" if turns else "")
                     + ("  truncated" if r["truncated"] else ""))
        text = Text()
        ends = {b for _, b in r["turns"]}
        links = segment_links(json.loads(r["info"] or "{}").get("segment_roles"))
        for i, (tok, role) in enumerate(zip(r["tokens"], r["roles"])):
            if i in r["segments"] and (i or links):
                k = r["segments"].index(i)
                text.append(f" ‖ {links[k]} ‖ " if links and links[k] else " ‖ " * bool(i),
                            style="bold red")
            if colour == "version" and r["versions"][i] >= 0:
                style = f"bold {palette[r['versions'][i] % len(palette)]}"
            elif colour == "gap" and role == "trainable" and r["trainer_logprobs"]:
                gap = abs(r["trainer_logprobs"][i] - r["behavior_logprobs"][i])
                style = "bold red" if gap > 1e-2 else "yellow" if gap > 1e-4 else "green"
            else:
                style = {"trainable": "bold green", "tool": "yellow", "prompt": "dim"}[role]
            text.append(tok, style=style)
            if i + 1 in ends:
                k = [b for _, b in r["turns"]].index(i + 1)
                if k < len(turns):
                    text.append(f" [r={turns[k]:g}]", style="bold blue")
        console.print(text)
        if "columns" in (info := json.loads(r["info"] or "{}")):    # what the reward compared
            shown = {**info["columns"],
                     **{k: v for k, v in info.items() if k.startswith("reward/")}}
            console.print(f"data line {info['line']} (row {info['row']} of its split): "
                          + ", ".join(f"{k}={v!r}" for k, v in shown.items()),
                          style="cyan", markup=False, highlight=False)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", default="",
                   help="folder (default: RUN_DIR/view/), or the file with --single "
                        "(default: RUN_DIR/view.html)")
    p.add_argument("--single", action="store_true",
                   help="one self-contained HTML file (small runs: every step inside it)")
    p.add_argument("--terminal", action="store_true", help="print with rich instead")
    p.add_argument("--step", type=int, action="append", help="only these steps")
    p.add_argument("--min-reward", type=float, default=None)
    p.add_argument("--max-reward", type=float, default=None)
    p.add_argument("--colour", default="role", choices=["role", "version", "gap"])
    p.add_argument("--limit", type=int, default=20, help="rollouts printed (--terminal)")
    p.add_argument("--per-step", type=int, default=None,
                   help="rollouts kept per step (0: all; default: all, 64 with --single)")
    p.add_argument("--eval", action="store_true",
                   help="the held-out evaluations' rollouts (trajectories/eval/) instead")
    p.add_argument("--tokenizer", default=None,
                   help="default: RUN_DIR/final, else the run's model.path")


def main(args: argparse.Namespace) -> int:
    from molt_core.run.metrics import RunDirError

    run_dir = Path(args.run_dir)
    src = run_dir / "trajectories" / "eval" if args.eval else run_dir
    if not any(f.is_file() for f in _files(src)):
        raise RunDirError(f"no saved trajectories in {src}: is it a run dir, and was "
                          "log.trajectories_every > 0" + (" and eval.every?" if args.eval else "?"))
    tok = args.tokenizer or str(tokenizer_dir(run_dir))
    keep = lambda r: ((not args.step or r["step"] in args.step)      # noqa: E731
                      and (args.min_reward is None or r["reward"] >= args.min_reward)
                      and (args.max_reward is None or r["reward"] <= args.max_reward))
    if args.terminal:
        render_terminal([r for r in load_rows(src, tok) if keep(r)], args.colour,
                        limit=args.limit)
        return 0
    decode = decoder(tok)
    per_step = (64 if args.single else 0) if args.per_step is None else args.per_step
    steps = ((s, rows[:per_step or None]) for s, rows in iter_steps(src, keep, args.step, 4))
    title = f"molt view: {run_dir.resolve().name}{' (eval)' if args.eval else ''}"
    name = "view-eval" if args.eval else "view"
    write = write_single if args.single else write_paged
    out, index = write(steps, args.out or run_dir / (f"{name}.html" if args.single else name),
                       decode, title, data_file(run_dir))
    print(f"view: {out} ({sum(s['n'] for s in index)} rollouts, {len(index)} steps)")
    return 0
