"""Actor -> engines weight sync: every trainer rank gathers, rank 0 sends versioned buckets.

Each rank's `push_weights` gathers full tensors (a collective, so all ranks must take part); rank 0
sends dtype-preserving buckets to every engine with a timeout per transfer and then asks each engine
to check that every one of its parameters was assigned (`finish_weight_update`).
"""

from __future__ import annotations

from typing import Any

import ray

__all__ = ["WeightSyncError", "push"]


class WeightSyncError(RuntimeError):
    """A trainer rank or an engine failed during a weight push."""


def push(workers: list, engines: list, version: int, bucket_bytes: int, timeout_s: float
         ) -> dict[str, Any]:
    """Push the trainer's weights to `engines` as `version`; returns rank 0's stats.

    Fails fast on the first rank error (engine timeouts surface there as `TimeoutError`); ranks
    stuck in a gather end at the trainer's process-group timeout.
    """
    refs = [w.push_weights.remote(engines, version, bucket_bytes, timeout_s) for w in workers]
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done)
        except ray.exceptions.RayTaskError as e:
            rank = refs.index(done[0])
            if isinstance(e.cause, TimeoutError):
                raise TimeoutError(f"trainer rank {rank}: {e.cause}") from None
            raise WeightSyncError(f"weight push of version {version} failed on trainer rank "
                                  f"{rank}: {e.cause!r}") from e
        except ray.exceptions.RayError as e:
            raise WeightSyncError(f"weight push of version {version}: trainer rank "
                                  f"{refs.index(done[0])} died: {e}") from None
    return ray.get(refs[0])
