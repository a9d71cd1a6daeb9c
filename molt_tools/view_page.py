"""The page of `molt view`: plain HTML and JS (nothing fetched; it opens from file://).

`__INDEX__`: the per-step summaries; a step's rollouts come by `molt_step(record)`, from
`steps/step_NNNNNN.js` added as a `<script src>` when the step is opened (`__PAGED__`), or inline
in `__STEPS__` (one self-contained file). Filters test each rollout of the open step, and each
step's ranges in the index (a listed step may hold a match; an unlisted one holds none).
"""

PAGE = r"""<!doctype html>
<html><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:14px system-ui,sans-serif;margin:0;background:#fafafa;color:#222}
header{position:sticky;top:0;background:#fff;border-bottom:1px solid #ddd;padding:8px 12px;
 display:flex;gap:12px;align-items:center;flex-wrap:wrap;z-index:2}
h1{font-size:16px;margin:0}
#wrap{display:flex;align-items:flex-start}
nav{position:sticky;top:var(--top,52px);flex:none;width:420px;height:calc(100vh - var(--top,52px));
 display:flex;flex-direction:column;background:#fff;border-right:1px solid #ddd}
#index{overflow-y:auto;flex:1}
.row{display:flex;font:12px/17px ui-monospace,monospace;cursor:pointer;
 content-visibility:auto;contain-intrinsic-size:auto 17px}
.row span{flex:none;box-sizing:border-box;text-align:right;padding:0 4px;white-space:nowrap;
 overflow:hidden}
.row span:nth-child(1){width:44px}.row span:nth-child(2){width:30px}
.row span:nth-child(3){width:54px}.row span:nth-child(4){width:92px}
.row span:nth-child(5){width:44px}.row span:nth-child(6){width:84px}
.row span:nth-child(7){width:54px}
.head{background:#f5f5f5;font-weight:600;cursor:default;padding-right:15px}
#index .row:hover{background:#e3f2fd}#index .row.cur{background:#bbdefb}
#spark{display:block;margin:6px}
main{flex:1;min-width:0}
.rollout{background:#fff;border:1px solid #ddd;border-radius:6px;margin:10px 12px;padding:8px;
 content-visibility:auto;contain-intrinsic-size:auto 120px}
.meta{font-size:12px;color:#555;margin-bottom:6px}
.meta b{color:#000}
.toks{font:13px ui-monospace,monospace;white-space:pre-wrap;word-break:break-all;line-height:1.7}
.tok{border-radius:2px}
.prompt{background:#eceff1;color:#555}.trainable{background:#b9f6ca}.tool{background:#ffe0b2}
.seg{display:inline-block;border-left:3px solid #d32f2f;height:1.2em;margin:0 4px;
 vertical-align:middle}
.link{font:bold 11px system-ui;color:#fff;background:#d32f2f;border-radius:8px;padding:0 5px;
 margin:0 3px}
.turn{outline:1px dashed #1565c0;border-radius:3px}
.treward{font:bold 11px system-ui;color:#fff;background:#1565c0;border-radius:8px;
 padding:0 5px;margin:0 3px}
.img{background:#ce93d8;padding:0 4px;border-radius:3px;font:11px system-ui}
.legend span{padding:1px 6px;margin-right:4px;border-radius:3px;font-size:12px}
.body{display:flex;gap:10px;align-items:flex-start}.body .toks{flex:1;min-width:0}
.data{flex:0 0 32%;max-width:32%;border-collapse:collapse;font-size:12px;background:#f3f8ff}
.data caption{text-align:left;font-weight:600;padding:2px 0;word-break:break-all}
.data th,.data td{border:1px solid #d0dff0;padding:2px 5px;vertical-align:top;text-align:left}
.data th{white-space:nowrap;color:#345}.data td{font:12px ui-monospace,monospace;
 white-space:pre-wrap;word-break:break-word}
#count,.note{color:#555}.note{margin:12px}
input{width:4.5em}#step{width:5.5em}
</style></head><body>
<header><h1>__TITLE__</h1>
<label>step <button id="prev" title="previous listed step (&larr;)">&lsaquo;</button><input
 id="step" type="number"><button id="next" title="next listed step (&rarr;)">&rsaquo;</button></label>
<label>colour <select id="colour"><option value="role">prompt / trainable / tool</option>
<option value="version">weight version</option><option value="gap">engine vs trainer gap</option>
</select></label>
<label title="rollout reward">reward <input id="rmin" type="number" step="any"> &ndash;
 <input id="rmax" type="number" step="any"></label>
<label title="policy turns">turns <input id="tmin" type="number"> &ndash;
 <input id="tmax" type="number"></label>
<label title="a token sampled by a weight version in this range">version <input id="vmin"
 type="number"> &ndash; <input id="vmax" type="number"></label>
<label title="versions behind the weights of the step (step - 1) for the oldest version that sampled a token: 0 on-policy">lag &ge; <input id="lag"
 type="number"></label>
<label title="max |trainer - engine| log-prob of a trainable token">|gap| &ge; <input id="gap"
 type="number" step="any"></label>
<span class="legend" id="legend"></span><span id="count"></span></header>
<div id="wrap"><nav><svg id="spark" width="400" height="70"></svg><div class="row head"><span>step</span>
<span title="rollouts">n</span><span title="mean reward">reward</span><span>min..max</span>
<span>turns</span><span>versions</span><span title="max |trainer - engine| log-prob">|gap|</span>
</div><div id="index"></div></nav><main id="list"></main></div>
<script>
const T0 = performance.now().toFixed(1);      // the bench reads T0, index and first-step times
const INDEX = __INDEX__, PAGED = __PAGED__, DATA = __DATA__, STEPS = {}, PAGE = 50;
const BY_STEP = new Map(INDEX.map(x => [x.step, x]));
const $ = id => document.getElementById(id);
const FILTERS = ['rmin', 'rmax', 'tmin', 'tmax', 'vmin', 'vmax', 'lag', 'gap'];
const ROLE = {p: 'prompt', t: 'trainable', o: 'tool'};
let cur = null, listed = [], limit = PAGE;
function molt_step(rec) {
  STEPS[rec.step] = rec;
  if (rec.step === cur && document.readyState !== 'loading') drawStep();
}
const HUES = [210, 330, 45, 120, 270, 0, 180, 90];
function versionColour(v) { return v < 0 ? '#eceff1' : `hsl(${HUES[v % HUES.length]},70%,80%)`; }
function gapColour(g) {
  const t = Math.min(1, Math.log10(1 + g * 1e4) / 4);     // 0 -> green, >= 1 nat -> red
  return `hsl(${120 - 120 * t},75%,75%)`;
}
function esc(s) { return s.replace(/[&<>"]/g, c => ({'&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;'})[c]); }
function fmt(x, p = 3) { return x === null || x === undefined ? '' : String(+x.toPrecision(p)); }
function filters() {
  const f = {};
  for (const k of FILTERS) f[k] = parseFloat($(k).value);
  return f;
}
// [a, b] meets [lo, hi]; an unset bound (NaN) passes
function meets(lo, hi, a, b) { return !(lo > b) && !(hi < a); }
// x: a step's summary or a rollout's, as ranges; a step passes where it may hold a match
function passes(x, step, f) {
  const v = x.versions;
  return meets(f.rmin, f.rmax, ...x.rewards) && meets(f.tmin, f.tmax, ...x.turns)
      && (isNaN(f.vmin) && isNaN(f.vmax) || v !== null && meets(f.vmin, f.vmax, ...v))
      && (isNaN(f.lag) || v !== null && step - 1 - v[0] >= f.lag)
      && (isNaN(f.gap) || x.gap !== null && x.gap >= f.gap);
}
function asRanges(r) {
  return {rewards: [r.reward, r.reward], turns: [r.turns.length, r.turns.length],
          versions: r.vrange, gap: r.gap};
}
function tokenHtml(r, text, i, mode) {
  const role = ROLE[r.roles[i]];
  let style = '';
  if (mode === 'version') style = `background:${versionColour(r.versions[i])}`;
  if (mode === 'gap') style = role === 'trainable' && r.tlp.length
      ? `background:${gapColour(Math.abs(r.tlp[i] - r.lp[i]))}` : 'background:#eceff1';
  const cls = mode === 'role' ? `tok ${role}` : 'tok';
  return `<span class="${cls}" data-i="${i}"${style && ` style="${style}"`}>${esc(text)}</span>`;
}
function tip(e) {           // a token's tooltip, made when hovered (not for every token drawn)
  const t = e.target.closest('.tok'), d = t && t.closest('.rollout');
  if (!d || t.title) return;
  const r = STEPS[cur].rollouts[+d.dataset.k], i = +t.dataset.i;
  t.title = `id ${r.ids[i]} | ${ROLE[r.roles[i]]} | version ${r.versions[i]} | behavior lp ${r.lp[i]}` +
      (r.tlp.length ? ` | trainer lp ${r.tlp[i]}` : '');
}
// the data row a rollout's reward compared (env `dataset`: info's line, row and columns) and each
// reward function's value, beside the tokens; the rest of info stays in the meta line
function dataHtml(info) {
  if (!info.columns) return '';
  const cell = v => esc(typeof v === 'string' ? v : JSON.stringify(v));
  const rows = Object.entries(info.columns).map(([k, v]) => `<tr><th>${esc(k)}</th><td>${cell(v)}</td></tr>`)
      .concat(Object.entries(info).filter(([k]) => k.startsWith('reward/'))
      .map(([k, v]) => `<tr><th>${esc(k)}</th><td>${cell(v)}</td></tr>`));
  return `<table class="data"><caption title="${esc(DATA)}">${esc(DATA.split('/').pop() || 'data')}` +
      ` line ${info.line} (row ${info.row} of its split)</caption>${rows.join('')}</table>`;
}
function rolloutHtml(r, k, vocab, step, mode) {
  const segs = new Map(r.segments.map((s, k) => [s, r.links[k]]));
  const ends = new Map(r.turns.map((t, k) => [t[1], k]));
  const starts = new Set(r.turns.map(t => t[0]));
  const imgs = new Map(r.images.map(im => [im.start, im]));
  let out = '';
  for (let i = 0; i < r.ids.length; i++) {
    if (segs.has(i) && (i || segs.get(i))) out += '<span class="seg" title="new segment"></span>' +
        (segs.get(i) ? `<span class="link">${esc(segs.get(i))}</span>` : '');
    if (starts.has(i)) out += '<span class="turn">';
    const im = imgs.get(i);
    if (im) { out += `<span class="img" title="image ${im.ref}">[image ${im.num_tokens} tokens]</span>`;
              i += im.num_tokens - 1; continue; }
    out += tokenHtml(r, vocab[r.ids[i]], i, mode);
    if (ends.has(i + 1)) {
      const k = ends.get(i + 1), tr = r.turn_rewards;
      out += '</span>' + (tr && k < tr.length ? `<span class="treward">r=${tr[k]}</span>` : '');
    }
  }
  const turns = r.turn_rewards ? ` &middot; turn rewards <b>${r.turn_rewards.join(', ')}</b>` : '';
  const v = r.vrange ? ` &middot; versions ${r.vrange[0]}..${r.vrange[1]}` : '';
  const info = JSON.parse(r.info || '{}'), data = dataHtml(info);
  const rest = data ? Object.fromEntries(Object.entries(info).filter(([k]) =>
      !['columns', 'line', 'row'].includes(k) && !k.startsWith('reward/'))) : info;
  return `<div class="rollout" data-k="${k}" data-reward="${r.reward}" data-step="${step}">
<div class="meta">step <b>${step}</b> &middot; group <b>${r.group}</b> &middot; rollout
<b>${r.rollout}</b> &middot; task ${r.task} &middot; reward <b class="reward">${fmt(r.reward, 4)}</b>${turns}
&middot; ${r.turns.length} turn(s) &middot; ${r.segments.length} segment(s) &middot; ${r.ids.length}
tokens${v}${r.gap !== null ? ` &middot; max |gap| ${r.gap}` : ''}${r.truncated ? ' &middot; truncated' : ''}
${Object.keys(rest).length ? ` &middot; info <code>${esc(JSON.stringify(rest))}</code>` : ''}</div>
<div class="body"><div class="toks">${out}</div>${data}</div></div>`;
}
function legend(mode, rec) {
  if (mode === 'role') return '<span class="prompt">prompt</span><span class="trainable">trainable</span>' +
      '<span class="tool">tool / env</span>';
  if (mode === 'version') return [...new Set(rec.rollouts.flatMap(r => r.versions))].filter(v => v >= 0)
      .sort((a, b) => a - b).map(v => `<span style="background:${versionColour(v)}">v${v}</span>`).join('');
  return [0, 1e-4, 1e-2, 1].map(g => `<span style="background:${gapColour(g)}">|gap| ${g}</span>`).join('');
}
function drawStep() {
  const rec = STEPS[cur], mode = $('colour').value, f = filters();
  const shown = rec.rollouts.map((r, k) => [r, k]).filter(([r]) => passes(asRanges(r), cur, f));
  $('list').innerHTML = shown.slice(0, limit).map(([r, k]) => rolloutHtml(r, k, rec.vocab, cur, mode)).join('') +
      (shown.length > limit ? `<button id="more" class="note">show ${Math.min(PAGE, shown.length - limit)} more of ${shown.length - limit}</button>` : '');
  if ($('more')) $('more').onclick = () => { limit += PAGE; drawStep(); };
  $('legend').innerHTML = legend(mode, rec);
  $('count').textContent = `step ${cur}: ${shown.length} of ${rec.rollouts.length} rollouts`;
  if (!document.body.dataset.rendered) document.body.dataset.rendered = performance.now().toFixed(1);
}
function openStep(step) {
  if (!BY_STEP.has(step)) return;
  cur = step; limit = PAGE; $('step').value = step;
  for (const el of document.querySelectorAll('#index .cur')) el.classList.remove('cur');
  const row = document.querySelector(`#index [data-step="${step}"]`);
  if (row) { row.classList.add('cur'); row.scrollIntoView({block: 'nearest'}); }
  drawSpark();
  if (STEPS[step]) return drawStep();
  $('list').innerHTML = `<p class="note">loading step ${step}&hellip;</p>`;
  if (!PAGED) return;
  const s = document.createElement('script');
  s.src = `steps/step_${String(step).padStart(6, '0')}.js`; s.charset = 'utf-8';
  s.onerror = () => { $('list').innerHTML = `<p class="note">cannot load ${s.src}: is the steps/ folder next to this page?</p>`; };
  document.head.appendChild(s);
}
function listSteps() { const f = filters(); listed = INDEX.filter(x => x.n && passes(x, x.step, f)); }
function drawIndex() {
  listSteps();
  $('index').innerHTML = listed.map(x => `<div class="row" data-step="${x.step}"><span>${x.step}</span>
<span>${x.n}</span><span>${fmt(x.reward)}</span><span>${x.rewards.map(v => v.toFixed(2)).join('..')}</span>
<span>${x.turns.join('..')}</span><span>${x.versions ? x.versions.join('..') : ''}</span>
<span>${fmt(x.gap)}</span></div>`).join('');
  const row = document.querySelector(`#index [data-step="${cur}"]`);
  if (row) row.classList.add('cur');
  drawSpark();
}
function drawSpark() {      // mean reward per step; the listed steps dark, the open one marked
  const w = 400, h = 70, svg = $('spark');
  if (!INDEX.length) return;
  const s0 = INDEX[0].step, s1 = INDEX[INDEX.length - 1].step || 1;
  const ys = INDEX.map(x => x.reward), lo = Math.min(...ys), hi = Math.max(...ys);
  const X = s => 4 + (w - 8) * (s - s0) / Math.max(1, s1 - s0), Y = r => h - 4 - (h - 8) * (r - lo) / ((hi - lo) || 1);
  const line = xs => xs.map(x => `${X(x.step).toFixed(1)},${Y(x.reward).toFixed(1)}`).join(' ');
  svg.innerHTML = `<polyline fill="none" stroke="#90caf9" stroke-width="1" points="${line(INDEX)}"/>` +
      (listed.length < INDEX.length ? listed.map(x => `<circle cx="${X(x.step)}" cy="${Y(x.reward)}" r="1.5" fill="#0d47a1"/>`).join('') : '') +
      (cur !== null ? `<line x1="${X(cur)}" x2="${X(cur)}" y1="0" y2="${h}" stroke="#d32f2f"/>` : '') +
      `<text x="6" y="12" font-size="10" fill="#555">mean reward ${fmt(lo)}..${fmt(hi)}, steps ${s0}..${s1}</text>`;
  svg.onclick = e => { const s = s0 + (e.offsetX - 4) / (w - 8) * (s1 - s0);
    openStep(INDEX.reduce((a, b) => Math.abs(b.step - s) < Math.abs(a.step - s) ? b : a).step); };
}
function move(d) {
  const steps = listed.map(x => x.step), i = steps.findIndex(s => d > 0 ? s > cur : s >= cur);
  const j = d > 0 ? i : (i < 0 ? steps.length : i) - 1;
  if (j >= 0 && j < steps.length) openStep(steps[j]);
}
function init() {
  const q = new URLSearchParams(location.search);
  document.body.style.setProperty('--top', `${document.querySelector('header').offsetHeight}px`);
  for (const k of ['colour', ...FILTERS]) if (q.has(k)) $(k).value = q.get(k);
  for (const k of FILTERS) $(k).addEventListener('input', () => { drawIndex(); if (STEPS[cur]) { limit = PAGE; drawStep(); } });
  $('colour').addEventListener('input', () => STEPS[cur] && drawStep());
  $('list').addEventListener('mouseover', tip);
  $('index').addEventListener('click', e => { const row = e.target.closest('.row'); if (row) openStep(+row.dataset.step); });
  $('step').addEventListener('change', () => { const v = +$('step').value;
    const x = INDEX.find(x => x.step >= v) || INDEX[INDEX.length - 1]; if (x) openStep(x.step); });
  $('prev').onclick = () => move(-1); $('next').onclick = () => move(1);
  document.addEventListener('keydown', e => { if (e.target.tagName === 'INPUT') return;
    if (e.key === 'ArrowLeft') move(-1); if (e.key === 'ArrowRight') move(1); });
  listSteps();      // the first step's script loads while the index is drawn
  const want = q.has('step') ? INDEX.find(x => x.step >= +q.get('step')) : listed[0] || INDEX[0];
  if (want || INDEX.length) openStep((want || INDEX[INDEX.length - 1]).step);
  else $('list').innerHTML = '<p class="note">no saved steps</p>';
  drawIndex();
  const row = document.querySelector(`#index [data-step="${cur}"]`);
  if (row) row.scrollIntoView({block: 'nearest'});
  Object.assign(document.body.dataset, {script: T0, index: performance.now().toFixed(1)});
}
document.addEventListener('DOMContentLoaded', init);
</script>
__STEPS__
</body></html>
"""
