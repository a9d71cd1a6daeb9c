"""Adapter versions on the hf engine (issue 43 item 2): with `engine.args.keep_versions`, rows in
flight at an adapter push finish on the version they started with (no re-prefill, each token
stamped with it); live versions stay within `max_adapters`, an eviction re-prefills its rows on
the newest and is counted. Real in-process HF engines on the tiny Qwen3."""

from __future__ import annotations

import asyncio

from molt_core.engines.hf import HFEngine
from test_lora import SAMPLING as BASE_SAMPLING
from test_lora_sync import TOL, _adapter, _load

SAMPLING = BASE_SAMPLING | {"max_new_tokens": 24, "stop_token_ids": []}
PROMPTS = [[5, 9, 11], [7, 8], [12, 13, 14]]


async def _push_mid_wave(engine: HFEngine, pushes: list[tuple[str, dict, int]],
                         adapter: str | None = None) -> list:
    """Three rows of `adapter` start; once each has a few tokens, the engine pauses, loads
    `pushes` (id, tensors, version) and resumes; their completions."""
    task = asyncio.ensure_future(engine.generate_batch(
        PROMPTS, [SAMPLING | {"seed": i} | ({"adapter": adapter} if adapter else {})
                  for i in range(3)]))
    start = (await engine.stats())["tokens_generated"]
    while (await engine.stats())["tokens_generated"] < start + 3 * 4:
        assert not task.done(), task.result()
        await asyncio.sleep(0)
    await engine.pause()
    for aid, named, v in pushes:
        await _load(engine, aid, named, v)
    await engine.resume()
    return await task


async def _alone(path: str, named: dict) -> list:
    """The same rows on an engine holding only `named` (as its policy adapter)."""
    solo = HFEngine(path)
    await _load(solo, "", named, 1)
    return await solo.generate_batch(PROMPTS, [SAMPLING | {"seed": i} for i in range(3)])


def _same(got: list, want: list) -> None:
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < TOL


def test_in_flight_rows_keep_their_adapter_version(tiny_model_dir):
    """keep_versions: the rows started on v1 decode to the end on v1 across pushes of v2 and v3
    (tokens and log-probs those of an engine with only v1; no re-prefill; two live versions at
    most); then an adapter a2 fills the bound, so a push of v5 evicts the rows' v4: they
    re-prefill and go on under v5 (one eviction counted). Without the switch the rows switch to
    the pushed version at once (one re-prefill)."""
    path = str(tiny_model_dir)

    async def run():
        engine = HFEngine(path, keep_versions=True, max_adapters=2)
        v = {k: _adapter(engine, k) for k in range(1, 6)}
        await _load(engine, "", v[1], 1)
        got = await _push_mid_wave(engine, [("", v[2], 2), ("", v[3], 3)])
        assert all(c.versions == [1] * 24 for c in got)
        _same(got, await _alone(path, v[1]))
        s = await engine.stats()
        assert (s["reprefills"], s["live_versions_peak"], s["adapter_evictions"]) == (0, 2, 0)
        assert s["adapters"] == {"policy": 3} and s["live_versions"] == 1    # v1 left with them
        # new rows take the newest; a2 fills the bound, so v5 evicts the rows' v4
        await _load(engine, "", v[4], 4)
        await _load(engine, "a2", v[1], 5)
        evict = await _push_mid_wave(engine, [("", v[5], 6)])
        for c in evict:
            k = c.versions.index(6)
            assert 4 <= k < 24 and c.versions == [4] * k + [6] * (24 - k)
        s = await engine.stats()
        assert (s["reprefills"], s["live_versions_peak"], s["adapter_evictions"]) == (1, 2, 1)
        # without keep_versions: the push moves the rows to v2 (re-prefilled)
        plain = HFEngine(path)
        await _load(plain, "", v[1], 1)
        moved = await _push_mid_wave(plain, [("", v[2], 2)])
        assert all(c.versions[0] == 1 and c.versions[-1] == 2 for c in moved)
        assert (await plain.stats())["reprefills"] == 1

    asyncio.run(run())
