"""Rollout engines: `hf` (embedded HF decode loop) and `vllm`. Both take the same explicit
sampling dict, checked here once, and stop on the same default tokens."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

__all__ = ["Requests", "SAMPLING_KEYS", "check_sampling", "default_stop_ids"]

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")


def check_sampling(sampling: dict) -> tuple[dict, list[int] | None]:
    """Split `sampling` into the six explicit knobs and the optional stop_token_ids; raise on a
    missing or unknown knob (a silently defaulted knob changes the behavior policy)."""
    stop = (sampling := dict(sampling)).pop("stop_token_ids", None)
    missing = [k for k in SAMPLING_KEYS if k not in sampling]
    unknown = [k for k in sampling if k not in SAMPLING_KEYS]
    if missing or unknown:
        raise ValueError(f"sampling must give exactly {', '.join(SAMPLING_KEYS)} (+ optional "
                         f"stop_token_ids); missing {missing}, unknown {unknown}")
    if sampling["temperature"] <= 0:
        raise ValueError(f"temperature must be > 0, got {sampling['temperature']}")
    if sampling["max_new_tokens"] < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {sampling['max_new_tokens']}")
    return sampling, stop


def default_stop_ids(model_path: str, config: Any) -> list[int]:
    """Stop ids without `stop_token_ids`: generation_config's eos (may be a list), else config's."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        eos = None
    eos = config.eos_token_id if eos is None else eos
    return [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]


class Requests:
    """An engine's requests in flight by caller id, so that a caller who gave up (timeout, pool
    cancellation) stops its requests engine-side instead of letting them decode to the end."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Future] = {}

    async def gather(self, aws: list[Awaitable], ids: list[str] | None) -> list[object | Exception]:
        """Await `aws` (futures stay futures, coroutines become tasks) with their ids."""
        tasks = [asyncio.ensure_future(a) for a in aws]
        ids = ids or []
        self._tasks.update(zip(ids, tasks))
        try:
            out = await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for i in ids:
                self._tasks.pop(i, None)
        return [RuntimeError("request aborted") if isinstance(o, asyncio.CancelledError) else o
                for o in out]

    def abort(self, ids: list[str]) -> None:
        for i in ids:
            if (task := self._tasks.pop(i, None)) is not None:
                task.cancel()
