"""`molt view RUN_DIR`: browse the saved trajectories of a run.

Writes one self-contained HTML file (no server, no network: open it in any browser) or, with
`--terminal`, prints them with rich. Per step and rollout, each token is coloured by its role
(prompt / trainable / tool or env feedback), by the weight version that sampled it, or by the
engine-vs-trainer log-prob gap; turns and segments are marked, with their rewards; rollouts can
be filtered by reward.
"""

from __future__ import annotations

import argparse
import html
import json
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

__all__ = ["add_args", "load_rows", "main", "read_trajectories", "render_terminal", "token_roles",
           "write_html"]


def read_trajectories(path: str | Path, steps: list[int] | None = None) -> list[dict[str, Any]]:
    """Rows (plain dicts) of a run directory, its `trajectories/` folder or one Parquet file."""
    import pyarrow.parquet as pq
    path = Path(path)
    if path.is_dir() and (path / "trajectories").is_dir():
        path = path / "trajectories"
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    rows = [r for f in files for r in pq.read_table(f).to_pylist()]
    return [r for r in rows if steps is None or r["step"] in steps]


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
    from transformers import AutoTokenizer

    run_dir = Path(run_dir)
    rows = read_trajectories(run_dir)
    tok = AutoTokenizer.from_pretrained(tokenizer_path or tokenizer_dir(run_dir))
    for r in rows:
        r["tokens"] = tok.batch_decode([[i] for i in r["token_ids"]])
        r["roles"] = token_roles(r)
        r["turns"] = _turns(r)
    return rows


def _compact(r: dict[str, Any]) -> dict[str, Any]:
    r4 = lambda xs: [round(x, 4) for x in xs]     # noqa: E731
    return {"step": r["step"], "group": r["group_id"], "rollout": r["rollout_id"],
            "task": r["task"], "reward": r["reward"], "turn_rewards": r["turn_rewards"],
            "truncated": r["truncated"], "tokens": r["tokens"], "ids": r["token_ids"],
            "roles": r["roles"], "lp": r4(r["behavior_logprobs"]),
            "tlp": r4(r["trainer_logprobs"]), "versions": r["versions"],
            "segments": r["segments"], "turns": r["turns"], "info": r["info"],
            "images": [{k: im[k] for k in ("start", "num_tokens", "ref")} for im in r["images"]]}


def write_html(rows: list[dict[str, Any]], out: str | Path, title: str = "molt view") -> Path:
    """The self-contained viewer: data as JSON inside the page, rendered by inline JS."""
    data = json.dumps([_compact(r) for r in rows]).replace("</", "<\\/")
    page = _PAGE.replace("__TITLE__", html.escape(title)).replace("__DATA__", data)
    out = Path(out)
    out.write_text(page)
    return out


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
        for i, (tok, role) in enumerate(zip(r["tokens"], r["roles"])):
            if i in r["segments"] and i:
                text.append(" ‖ ", style="bold red")
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


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", default="", help="HTML file (default: RUN_DIR/view.html)")
    p.add_argument("--terminal", action="store_true", help="print with rich instead")
    p.add_argument("--step", type=int, action="append", help="only these steps")
    p.add_argument("--min-reward", type=float, default=None)
    p.add_argument("--max-reward", type=float, default=None)
    p.add_argument("--colour", default="role", choices=["role", "version", "gap"])
    p.add_argument("--limit", type=int, default=20, help="rollouts printed (--terminal)")
    p.add_argument("--per-step", type=int, default=64,
                   help="rollouts per step put in the HTML file (0: all)")
    p.add_argument("--tokenizer", default=None, help="default: RUN_DIR/final, else the run's model.path")


def main(args: argparse.Namespace) -> int:
    rows = [r for r in load_rows(args.run_dir, args.tokenizer)
            if (not args.step or r["step"] in args.step)
            and (args.min_reward is None or r["reward"] >= args.min_reward)
            and (args.max_reward is None or r["reward"] <= args.max_reward)]
    if args.terminal:
        render_terminal(rows, args.colour, limit=args.limit)
        return 0
    seen: Counter[int] = Counter()
    kept = []
    for r in rows:
        seen[r["step"]] += 1
        if not args.per_step or seen[r["step"]] <= args.per_step:
            kept.append(r)
    rows = kept
    out = write_html(rows, args.out or Path(args.run_dir) / "view.html",
                     f"molt view: {Path(args.run_dir).resolve().name}")
    print(f"view: {out} ({len(rows)} rollouts)")
    return 0


_PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:14px system-ui,sans-serif;margin:0;background:#fafafa;color:#222}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #ddd;padding:8px 12px;
 display:flex;gap:14px;align-items:center;flex-wrap:wrap;z-index:1}
h1{font-size:16px;margin:0}
.rollout{background:#fff;border:1px solid #ddd;border-radius:6px;margin:10px 12px;padding:8px}
.meta{font-size:12px;color:#555;margin-bottom:6px}
.meta b{color:#000}
.toks{font:13px ui-monospace,monospace;white-space:pre-wrap;word-break:break-all;line-height:1.7}
.tok{border-radius:2px}
.prompt{background:#eceff1;color:#555}.trainable{background:#b9f6ca}.tool{background:#ffe0b2}
.seg{display:inline-block;border-left:3px solid #d32f2f;height:1.2em;margin:0 4px;
 vertical-align:middle}
.turn{outline:1px dashed #1565c0;border-radius:3px}
.treward{font:bold 11px system-ui;color:#fff;background:#1565c0;border-radius:8px;
 padding:0 5px;margin:0 3px}
.img{background:#ce93d8;padding:0 4px;border-radius:3px;font:11px system-ui}
.legend span{padding:1px 6px;margin-right:4px;border-radius:3px;font-size:12px}
#count{color:#555}
input{width:6em}
</style></head><body>
<header><h1>__TITLE__</h1>
<label>step <select id="step"></select></label>
<label>colour <select id="colour"><option value="role">prompt / trainable / tool</option>
<option value="version">weight version</option><option value="gap">engine vs trainer gap</option>
</select></label>
<label>reward &ge; <input id="rmin" type="number" step="any" size="5"></label>
<label>&le; <input id="rmax" type="number" step="any" size="5"></label>
<span class="legend" id="legend"></span><span id="count"></span></header>
<main id="list"></main>
<script id="data" type="application/json">__DATA__</script>
<script>
const ROWS = JSON.parse(document.getElementById('data').textContent);
const $ = id => document.getElementById(id);
const steps = [...new Set(ROWS.map(r => r.step))].sort((a, b) => a - b);
$('step').innerHTML = '<option value="all">all</option>' +
  steps.map(s => `<option value="${s}">${s}</option>`).join('');
if (steps.length) $('step').value = String(steps[0]);
const HUES = [210, 330, 45, 120, 270, 0, 180, 90];
function versionColour(v) { return v < 0 ? '#eceff1' : `hsl(${HUES[v % HUES.length]},70%,80%)`; }
function gapColour(g) {
  const t = Math.min(1, Math.log10(1 + g * 1e4) / 4);     // 0 -> green, >= 1 nat -> red
  return `hsl(${120 - 120 * t},75%,75%)`;
}
function esc(s) { return s.replace(/[&<>]/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;'})[c]); }
function tokenHtml(r, i, mode) {
  const role = r.roles[i];
  let style = '';
  if (mode === 'version') style = `background:${versionColour(r.versions[i])}`;
  if (mode === 'gap') style = role === 'trainable' && r.tlp.length
      ? `background:${gapColour(Math.abs(r.tlp[i] - r.lp[i]))}` : 'background:#eceff1';
  const tip = `id ${r.ids[i]} | ${role} | version ${r.versions[i]} | behavior lp ${r.lp[i]}` +
      (r.tlp.length ? ` | trainer lp ${r.tlp[i]}` : '');
  const cls = mode === 'role' ? `tok ${role}` : 'tok';
  return `<span class="${cls}" data-i="${i}" style="${style}" title="${tip}">${esc(r.tokens[i])}</span>`;
}
function rolloutHtml(r, mode) {
  const segs = new Set(r.segments), ends = new Map(r.turns.map((t, k) => [t[1], k]));
  const starts = new Set(r.turns.map(t => t[0]));
  const imgs = new Map(r.images.map(im => [im.start, im]));
  let out = '';
  for (let i = 0; i < r.tokens.length; i++) {
    if (segs.has(i) && i) out += '<span class="seg" title="new segment"></span>';
    if (starts.has(i)) out += '<span class="turn">';
    const im = imgs.get(i);
    if (im) { out += `<span class="img" title="image ${im.ref}">[image ${im.num_tokens} tokens]</span>`;
              i += im.num_tokens - 1; continue; }
    out += tokenHtml(r, i, mode);
    if (ends.has(i + 1)) {
      const k = ends.get(i + 1), tr = r.turn_rewards;
      out += '</span>' + (tr && k < tr.length ? `<span class="treward">r=${tr[k]}</span>` : '');
    }
  }
  const turns = r.turn_rewards ? ` &middot; turn rewards <b>${r.turn_rewards.join(', ')}</b>` : '';
  return `<div class="rollout" data-reward="${r.reward}" data-step="${r.step}">
<div class="meta">step <b>${r.step}</b> &middot; group <b>${r.group}</b> &middot; rollout
<b>${r.rollout}</b> &middot; task ${r.task} &middot; reward <b class="reward">${r.reward}</b>${turns}
&middot; ${r.segments.length} segment(s) &middot; ${r.tokens.length} tokens${r.truncated ? ' &middot; truncated' : ''}
&middot; info <code>${esc(r.info)}</code></div>
<div class="toks">${out}</div></div>`;
}
function legend(mode) {
  if (mode === 'role') return '<span class="prompt">prompt</span><span class="trainable">trainable</span>' +
      '<span class="tool">tool / env</span>';
  if (mode === 'version') return [...new Set(ROWS.flatMap(r => r.versions))].filter(v => v >= 0)
      .sort((a, b) => a - b).map(v => `<span style="background:${versionColour(v)}">v${v}</span>`).join('');
  return [0, 1e-4, 1e-2, 1].map(g => `<span style="background:${gapColour(g)}">|gap| ${g}</span>`).join('');
}
function render() {
  const step = $('step').value, mode = $('colour').value;
  const lo = parseFloat($('rmin').value), hi = parseFloat($('rmax').value);
  const shown = ROWS.filter(r => (step === 'all' || r.step === +step) &&
      (isNaN(lo) || r.reward >= lo) && (isNaN(hi) || r.reward <= hi));
  $('list').innerHTML = shown.map(r => rolloutHtml(r, mode)).join('');
  $('legend').innerHTML = legend(mode);
  $('count').textContent = `${shown.length} of ${ROWS.length} rollouts`;
}
for (const id of ['step', 'colour', 'rmin', 'rmax']) $(id).addEventListener('input', render);
const q = new URLSearchParams(location.search);
for (const k of ['step', 'colour', 'rmin', 'rmax']) if (q.has(k)) $(k).value = q.get(k);
render();
</script></body></html>
"""
