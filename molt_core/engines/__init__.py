"""Rollout engines: `hf` (embedded HF decode loop) and `vllm`. Both take the same explicit
sampling dict, checked here once."""

from __future__ import annotations

__all__ = ["SAMPLING_KEYS", "check_sampling"]

SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens")


def check_sampling(sampling: dict) -> tuple[dict, list[int] | None]:
    """Split `sampling` into the six explicit knobs and the optional stop_token_ids; raise on a
    missing or unknown knob (a silently defaulted knob changes the behavior policy)."""
    sampling = dict(sampling)
    stop = sampling.pop("stop_token_ids", None)
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
